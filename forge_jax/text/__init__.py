"""Text: tokenizers (:mod:`~forge_jax.text.tokenizer`), chat templates
(:mod:`~forge_jax.text.chat_template`), streaming detokenization
(:mod:`~forge_jax.text.streaming`), the text API (:mod:`~forge_jax.text.api`:
:func:`generate_text`, :func:`chat`) and the multi-turn :class:`ChatSession`
(:mod:`~forge_jax.text.chat_session`).

Above :mod:`forge_jax.generation` in the layers: it may import the kernel library,
:mod:`forge_jax.models` and :mod:`forge_jax.generation`, never :mod:`forge_jax.serving` or the
CLI.
"""

from forge_jax.generation.settings import DEFAULT_MAX_NEW_TOKENS
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.text.api import (
    chat,
    default_max_new_tokens,
    eos_ids,
    generate_ids,
    generate_text,
)
from forge_jax.text.chat_session import ChatSession
from forge_jax.text.chat_template import (
    ROLES,
    ChatTemplateError,
    check_messages,
    render_chat_template,
)
from forge_jax.text.streaming import TextStreamer
from forge_jax.text.tokenizer import (
    Tokenizer,
    encode_chat,
    load_generation_config,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "ROLES", "ChatSession", "ChatTemplateError", "CheckpointError",
    "GenerationConfig", "TextStreamer", "Tokenizer", "chat", "check_messages",
    "default_max_new_tokens", "encode_chat", "eos_ids", "generate_ids", "generate_text",
    "load_generation_config", "load_tokenizer", "render_chat_template",
]
