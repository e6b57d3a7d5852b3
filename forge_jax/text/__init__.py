"""Text: tokenizers (:mod:`~forge_jax.text.tokenizer`), chat templates
(:mod:`~forge_jax.text.chat_template`), streaming detokenization
(:mod:`~forge_jax.text.streaming`), the text API (:mod:`~forge_jax.text.api`:
:func:`generate_text`, :func:`chat`) and the multi-turn :class:`ChatSession`
(:mod:`~forge_jax.text.chat_session`).

Above :mod:`forge_jax.generation` in the layers: it may import the kernel library,
:mod:`forge_jax.models` and :mod:`forge_jax.generation`, never :mod:`forge_jax.serving` or the
CLI.
"""

from forge_jax.text import api
from forge_jax.text.api import *  # noqa: F403  (the text API: api.__all__)
from forge_jax.text.chat_session import ChatSession

__all__ = [*api.__all__, "ChatSession"]
