"""A checkpoint's tokenizer: ``tokenizer.json`` read by the ``tokenizers`` library, with the
special tokens and chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``)
and the defaults of ``generation_config.json``; a GGUF file's own vocabulary too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from forge_jax.generation.prompts import encode_prompt
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.checkpoints.generation_config import (
    load_generation_config as _read_generation_config,
)
from forge_jax.models.checkpoints.hub import expand_user, resolve_checkpoint
from forge_jax.text.chat_template import ChatTemplateError, check_messages, render_chat_template


def load_generation_config(path: str | os.PathLike, *,
                           revision: str | None = None) -> GenerationConfig | None:
    """``path/generation_config.json`` as a :class:`GenerationConfig`, or None if absent.
    ``path`` may be a Hub repository id (``ORG/NAME``, at ``revision``)."""
    return _read_generation_config(resolve_checkpoint(path, revision=revision))


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                        "cls_token", "mask_token")



def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizer.json`` read by the ``tokenizers`` library, the
    special tokens and chat template of ``tokenizer_config.json`` (or
    ``chat_template.jinja``, which takes precedence, as in transformers) and the
    ``generation_config.json`` defaults. Build it with :func:`load_tokenizer`.

    Attributes:
      backend: the ``tokenizers.Tokenizer``.
      special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` as configured.
      chat_template: the Jinja template source, or None.
      generation_config: a :class:`GenerationConfig`, or None.
    """

    def __init__(self, backend, *, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | None = None,
                 generation_config: GenerationConfig | None = None, name: str = "tokenizer"):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.generation_config = generation_config
        self.name = name

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab {self.backend.get_vocab_size()}, "
                f"chat template: {'yes' if self.chat_template else 'no'})")

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("eos_token"))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies tokenizer.json's
        post-processor (e.g. a leading ``<s>``), as transformers' ``tokenizer(text)`` does
        (:func:`forge_jax.generation.prompts.encode_prompt`, the one BOS decision)."""
        return encode_prompt(self.backend, text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """The conversation rendered with the checkpoint's chat template (text, not ids:
        encode it with ``add_special_tokens=False``, the template writes its own).

        Args:
          messages: ``[{"role": "user", "content": "Hello"}, ...]``; roles from
            :data:`ROLES`, content a non-empty string.
          add_generation_prompt: end with the header of an assistant turn.
          **kwargs: further template variables (e.g. ``tools``), as transformers passes.

        Raises:
          ChatTemplateError: no template, or the template raised (``raise_exception``).
          ValueError, TypeError: a malformed message (named in the message).
        """
        check_messages(messages)
        if not self.chat_template:
            raise ChatTemplateError(
                f"{self.name} has no chat template (no 'chat_template' in tokenizer_config.json "
                f"and no chat_template.jinja): chat needs one; use generate_text with plain text")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens, **kwargs)


def load_tokenizer(path: str | os.PathLike, *, revision: str | None = None) -> Tokenizer:
    """Reads a checkpoint directory's ``tokenizer.json`` (required), ``tokenizer_config.json``,
    ``chat_template.jinja`` and ``generation_config.json`` (each optional). ``path`` may be a
    Hub repository id (``ORG/NAME``, at ``revision``), as in ``from_pretrained``.

    Raises:
      CheckpointError: a missing ``tokenizer.json`` or an unreadable file (named).
    """
    from tokenizers import Tokenizer as Backend

    from forge_jax.models.checkpoints import gguf as gguf_checkpoint

    path = expand_user(path)
    if gguf_checkpoint.is_gguf(path):  # the file's own vocabulary and chat template
        return Tokenizer(**gguf_checkpoint.tokenizer_parts(path), name=str(path))
    path = resolve_checkpoint(path, revision=revision)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no tokenizer.json (the text API reads Hugging Face "
                              f"fast tokenizers only)")
    try:
        backend = Backend.from_file(str(file))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise CheckpointError(f"cannot read {file}: {e}") from None
    config: dict[str, Any] = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
    special = {name: tok for name in _SPECIAL_TOKEN_NAMES
               if (tok := _token_content(config.get(name))) is not None}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text()
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_file}: chat_template must be a string, got "
                              f"{type(template).__name__}")
    return Tokenizer(backend, special_tokens=special, chat_template=template,
                     generation_config=load_generation_config(path), name=str(path))


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """The token ids of a conversation: the template rendered, encoded without adding
    special tokens (as transformers' ``apply_chat_template(..., tokenize=True)``)."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    return tokenizer.encode(rendered, add_special_tokens=False)
