"""Text in, text out: a checkpoint's tokenizer, its chat template, its generation config,
and :func:`generate_text` / :func:`chat` over the token-level generation loop, with
streaming.

Usage::

    from forge_jax.models import TINY_DIR, llama
    from forge_jax.text import api as text
    model = llama.from_pretrained(DIR)
    tokenizer = text.load_tokenizer(DIR)        # tokenizer.json, tokenizer_config.json,
                                                # chat_template.jinja, generation_config.json
    print(text.generate_text(model, tokenizer, "The capital of France is", max_new_tokens=16))
    reply = text.chat(model, tokenizer, [{"role": "user", "content": "Hello!"}],
                      stream=lambda i, piece: print(piece, end="", flush=True))

Chat templates are rendered as transformers' ``apply_chat_template`` renders them: Jinja2
in a sandboxed environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, loop controls), with ``messages``, ``add_generation_prompt``, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...), ``raise_exception``,
``strftime_now`` and a ``tojson`` that does not escape HTML.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from forge_jax.generation.loop import GenerationStats, generate_with_stats
from forge_jax.generation.settings import implies_sampling, sampling_params  # noqa: F401
from forge_jax.models.checkpoints.generation_config import (  # noqa: F401  (the text API, also here)
    CheckpointError,
    GenerationConfig,
)
from forge_jax.models.checkpoints.generation_config import (
    load_generation_config as _read_generation_config,
)
from forge_jax.models.checkpoints.hub import resolve_checkpoint
from forge_jax.models.llama_model import Llama


def load_generation_config(path: str | os.PathLike, *,
                           revision: str | None = None) -> GenerationConfig | None:
    """``path/generation_config.json`` as a :class:`GenerationConfig`, or None if absent.
    ``path`` may be a Hub repository id (``ORG/NAME``, at ``revision``)."""
    return _read_generation_config(resolve_checkpoint(path, revision=revision))


# Roles a message may have: the chat roles every template family uses (``developer`` for
# OpenAI-style templates, ``ipython`` for Llama 3.1 tool output).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
DEFAULT_MAX_NEW_TOKENS = 256
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                        "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """No chat template, or a template that cannot render these messages."""


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
        post-processor (e.g. a leading ``<s>``), as transformers' ``tokenizer(text)`` does."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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


def check_messages(messages) -> None:
    """Raises ValueError/TypeError naming the first malformed message of a conversation."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) \
            or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                            f"{m!r:.80}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; known roles: "
                             f"{', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content'] must be a str, got "
                            f"{type(content).__name__}: {content!r:.80}")
        # A model's reply may be empty (an eos first); what is said to it may not.
        if not content.strip() and role != "assistant":
            raise ValueError(f"messages[{i}] ({role}) has empty content: {content!r}")


_JINJA_ENV = None


def _jinja_env():
    """The sandboxed environment transformers renders chat templates in."""
    global _JINJA_ENV  # built once, on first use (importing jinja2 only then)
    if _JINJA_ENV is not None:
        return _JINJA_ENV
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant tokens
        with it): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                          ).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _JINJA_ENV = env
    return env


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **variables) -> str:
    """Renders a Jinja chat template with ``messages``, ``add_generation_prompt`` and
    ``variables`` (``bos_token``, ``eos_token``, ``tools``...) as transformers does.

    Raises:
      ChatTemplateError: the template does not parse, or raised while rendering.
    """
    import jinja2

    try:
        compiled = _jinja_env().from_string(template)
        return compiled.render(messages=[dict(m) for m in messages],
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None


class TextStreamer:
    """Turns the tokens :func:`generate_with_stats` streams (``on_tokens(i, tokens)``)
    into text pieces, one incremental decoder per sequence
    (``tokenizers.decoders.DecodeStream``: a character split across tokens, or a merge
    that changes earlier text, is held back until it is settled). Calls
    ``on_text(index, piece)`` for each non-empty piece of sequence ``index``; a sequence
    stops at its first eos token (not decoded). :meth:`close` flushes what is still held
    back at the end (e.g. the bytes of an incomplete character, decoded as U+FFFD), so
    that the pieces of a sequence concatenate to the decoding of all its tokens.
    """

    def __init__(self, tokenizer: Tokenizer, batch: int, eos: Sequence[int],
                 on_text: Callable[[int, str], None], *, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.on_text, self.eos = tokenizer, on_text, frozenset(eos)
        self.skip_special_tokens = skip_special_tokens
        self.decoders = [DecodeStream(skip_special_tokens=skip_special_tokens)
                         for _ in range(batch)]
        self.finished = np.zeros((batch,), bool)
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.emitted = [0] * batch  # characters passed to on_text, per sequence

    def __call__(self, i: int, tokens: np.ndarray) -> None:
        for b, token in enumerate(np.asarray(tokens).tolist()):
            if self.finished[b]:
                continue
            if token in self.eos:
                self.finished[b] = True
                continue
            self.ids[b].append(token)
            self._emit(b, self.decoders[b].step(self.tokenizer.backend, token))

    def _emit(self, b: int, piece: str | None) -> None:
        if piece:
            self.emitted[b] += len(piece)
            self.on_text(b, piece)

    def close(self) -> None:
        """Passes on the text still held back (once the last token is in)."""
        for b, ids in enumerate(self.ids):
            full = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
            self._emit(b, full[self.emitted[b]:])
            self.finished[b] = True


def eos_ids(model: Llama, tokenizer: Tokenizer, config: GenerationConfig | None,
            eos: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """The ids that end a sequence: ``eos`` (the caller's) if given, else
    generation_config.json's, else config.json's, else the tokenizer's eos token."""
    if eos is not None:
        return (eos,) if isinstance(eos, int) else tuple(eos)
    if config is not None and config.eos_token_id:
        return config.eos_token_id
    if model.config.eos_token_ids:
        return tuple(model.config.eos_token_ids)
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)


def _strip_eos(ids: list[int], eos) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def default_max_new_tokens(model_config, longest_prompt: int,
                           generation_config: GenerationConfig | None = None) -> int:
    """The ``max_new_tokens`` of a call that gives none (``forge-jax generate``'s too):
    generation_config.json's, else :data:`DEFAULT_MAX_NEW_TOKENS` (256) capped at the
    positions the model has left after the longest prompt (at least 1)."""
    if generation_config is not None and generation_config.max_new_tokens:
        return generation_config.max_new_tokens
    room = model_config.max_position_embeddings - longest_prompt
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, room))


def generate_ids(model: Llama, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None,
                 generation_config: GenerationConfig | None = None,
                 stream: Callable[[int, str], None] | None = None, cache: str = "paged",
                 **kwargs) -> tuple[list[str], list[list[int]], GenerationStats]:
    """The engine of :func:`generate_text` and :func:`chat`, on prompts already encoded:
    returns the texts, the new ids (eos included where one ended the sequence) and the
    :class:`GenerationStats`. ``kwargs`` go to :func:`generate_with_stats`."""
    config = tokenizer.generation_config if generation_config is None else generation_config
    params = sampling_params(
        config,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty)
    if max_new_tokens is None:
        max_new_tokens = default_max_new_tokens(
            model.config, max((len(p) for p in prompts), default=0), config)
    eos = eos_ids(model, tokenizer, config, eos_token_id)
    streamer = None if stream is None else TextStreamer(tokenizer, len(prompts), eos, stream)
    ids, stats = generate_with_stats(
        model, prompts, max_new_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        seed=seed, eos_token_id=eos, cache=cache, on_tokens=streamer, **kwargs)
    if streamer is not None:
        streamer.close()
    texts = [tokenizer.decode(_strip_eos(row, eos)) for row in ids]
    return texts, ids, stats


def generate_text(model: Llama, tokenizer: Tokenizer, prompts: str | Sequence[str], *,
                  max_new_tokens: int | None = None, temperature: float | None = None,
                  top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None, repetition_penalty: float | None = None,
                  seed: int = 0, eos_token_id: int | Sequence[int] | None = None,
                  add_special_tokens: bool = True,
                  generation_config: GenerationConfig | None = None,
                  stream: Callable[[int, str], None] | None = None,
                  cache: str = "paged", kv_cache_dtype: str | None = None) -> str | list[str]:
    """Continues text prompts: encode, :func:`~forge_jax.generation.loop.generate`,
    decode.

    Args:
      model: a :class:`~forge_jax.models.llama.Llama`.
      tokenizer: from :func:`load_tokenizer` on the same checkpoint.
      prompts: a string, or a list of strings (a batch, of any lengths).
      max_new_tokens: per prompt; default: generation_config.json's, else 256.
      temperature, top_k, top_p, min_p, repetition_penalty: as in
        :func:`~forge_jax.generation.loop.generate`. None: the value of
        ``generation_config`` (by default the checkpoint's generation_config.json);
        without one, greedy decoding and no filters. ``top_k``, ``top_p`` or ``min_p``
        without a temperature samples (at the config's temperature, else 1.0), as
        :meth:`GenerationConfig.sampling_params`. ``top_k=0`` turns top-k off.
      seed: the sampling seed.
      eos_token_id: the ids that end a sequence. None: generation_config.json's, else
        config.json's, else the tokenizer's eos token. ``()``: none (always
        ``max_new_tokens`` tokens).
      add_special_tokens: apply tokenizer.json's post-processor (e.g. a leading ``<s>``).
      generation_config: overrides ``tokenizer.generation_config``.
      stream: called as ``stream(index, piece)`` with each piece of text of prompt
        ``index`` as it is decoded (the pieces of a prompt concatenate to its result).
      cache: ``"paged"`` or ``"contiguous"``.
      kv_cache_dtype: ``"int8"`` or ``"fp8"`` for a quantized KV cache (None: the model's
        compute dtype), as in :func:`~forge_jax.generation.loop.generate`.

    Returns:
      The generated text (without the prompt and the eos token): a string for a string
      prompt, a list for a list.
    """
    single = isinstance(prompts, str)
    batch = [prompts] if single else prompts
    if isinstance(batch, bytes) or not isinstance(batch, Sequence) or not batch:
        raise ValueError(f"prompts must be a string or a non-empty list of strings, got "
                         f"{prompts!r:.80}")
    encoded = []
    for i, p in enumerate(batch):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] must be a str, got {type(p).__name__}: {p!r:.80}")
        ids = tokenizer.encode(p, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError(f"prompts[{i}]={p!r} encodes to no tokens")
        encoded.append(ids)
    texts = generate_ids(model, tokenizer, encoded, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         repetition_penalty=repetition_penalty, seed=seed,
                         eos_token_id=eos_token_id, generation_config=generation_config,
                         stream=stream, cache=cache, kv_cache_dtype=kv_cache_dtype)[0]
    return texts[0] if single else texts


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """The token ids of a conversation: the template rendered, encoded without adding
    special tokens (as transformers' ``apply_chat_template(..., tokenize=True)``)."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    return tokenizer.encode(rendered, add_special_tokens=False)


def chat(model: Llama, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
         max_new_tokens: int | None = None, temperature: float | None = None,
         top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
         repetition_penalty: float | None = None, seed: int = 0,
         eos_token_id: int | Sequence[int] | None = None,
         generation_config: GenerationConfig | None = None,
         stream: Callable[[str], None] | None = None, cache: str = "paged",
         kv_cache_dtype: str | None = None) -> str:
    """The assistant's reply to a conversation, rendered with the checkpoint's chat
    template (``add_generation_prompt=True``).

    Args:
      messages: ``[{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]``.
      stream: called as ``stream(piece)`` with each piece of the reply as it is decoded.
      The others: as in :func:`generate_text`.

    For a conversation that goes on, :class:`forge_jax.text.chat_session.ChatSession`
    keeps the KV cache between turns instead of prefilling the history again.

    Raises:
      ChatTemplateError: the checkpoint has no chat template.
      ValueError, TypeError: a malformed message (an unknown role, empty content).
    """
    ids = encode_chat(tokenizer, messages)
    on_text = None if stream is None else (lambda i, piece: stream(piece))
    return generate_ids(model, tokenizer, [ids], max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repetition_penalty=repetition_penalty, seed=seed,
                        eos_token_id=eos_token_id, generation_config=generation_config,
                        stream=on_text, cache=cache, kv_cache_dtype=kv_cache_dtype)[0][0]
