"""Text: tokenizers, chat templates, streaming detokenization, the text API
(:func:`generate_text`, :func:`chat`) and the multi-turn :class:`ChatSession`.

Above :mod:`forge_jax.generation` in the layers: it may import the kernel library,
:mod:`forge_jax.models` and :mod:`forge_jax.generation`, never :mod:`forge_jax.serving` or the
CLI.
"""

from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.text.api import (
    DEFAULT_MAX_NEW_TOKENS,
    ROLES,
    ChatTemplateError,
    TextStreamer,
    Tokenizer,
    chat,
    check_messages,
    default_max_new_tokens,
    encode_chat,
    eos_ids,
    generate_ids,
    generate_text,
    load_generation_config,
    load_tokenizer,
    render_chat_template,
)
from forge_jax.text.chat_session import ChatSession

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "ROLES", "ChatSession", "ChatTemplateError", "CheckpointError",
    "GenerationConfig", "TextStreamer", "Tokenizer", "chat", "check_messages",
    "default_max_new_tokens", "encode_chat", "eos_ids", "generate_ids", "generate_text",
    "load_generation_config", "load_tokenizer", "render_chat_template",
]
