"""Text in, text out: :func:`generate_text` and :func:`chat` over the token-level generation
loop, with streaming; the tokenizer, the chat template and the streaming detokenizer they
use live in :mod:`~forge_jax.text.tokenizer`, :mod:`~forge_jax.text.chat_template` and
:mod:`~forge_jax.text.streaming` (re-exported here and by :mod:`forge_jax.text`).

Usage::

    from forge_jax import text
    from forge_jax.generation import SamplingParams
    from forge_jax.models import llama
    model = llama.from_pretrained(DIR)
    tokenizer = text.load_tokenizer(DIR)        # tokenizer.json, tokenizer_config.json,
                                                # chat_template.jinja, generation_config.json
    print(text.generate_text(model, tokenizer, "The capital of France is", max_new_tokens=16))
    reply = text.chat(model, tokenizer, [{"role": "user", "content": "Hello!"}],
                      sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=1),
                      stream=lambda piece: print(piece, end="", flush=True))

The eos ids and the default ``max_new_tokens`` come from
:func:`forge_jax.generation.settings.stopping`, the one front door every caller uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forge_jax.generation import settings
from forge_jax.generation.loop import GenerationStats, generate_with_stats
from forge_jax.generation.sampling import SamplingParams
from forge_jax.generation.settings import (  # noqa: F401  (the text API's names, also here)
    DEFAULT_MAX_NEW_TOKENS,
    implies_sampling,
    sampling_params,
)
from forge_jax.kv_cache import CacheSpec
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.protocol import CausalLM
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

# The text API, with the names it takes from the modules beside it; forge_jax.text exports
# these and ChatSession.
__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "ROLES", "ChatTemplateError", "CheckpointError",
    "GenerationConfig", "TextStreamer", "Tokenizer", "chat", "check_messages",
    "default_max_new_tokens", "encode_chat", "eos_ids", "generate_ids", "generate_text",
    "load_generation_config", "load_tokenizer", "render_chat_template",
]
def eos_ids(model: CausalLM, tokenizer: Tokenizer | None, config: GenerationConfig | None,
            eos: int | Sequence[int] | None = None) -> tuple[int, ...]:
    """The ids that end a sequence: ``eos`` (the caller's) if given, else
    generation_config.json's, else config.json's, else the tokenizer's eos token
    (:func:`forge_jax.generation.settings.stopping`)."""
    return settings.stopping(
        model.config, config, eos_token_id=eos,
        tokenizer_eos_id=None if tokenizer is None else tokenizer.eos_token_id).eos_token_ids


def default_max_new_tokens(model_config, longest_prompt: int,
                           generation_config: GenerationConfig | None = None) -> int:
    """The ``max_new_tokens`` of a call that gives none (``forge-jax generate``'s too):
    generation_config.json's, else :data:`DEFAULT_MAX_NEW_TOKENS` (256) capped at the
    positions the model has left after the longest prompt (at least 1)
    (:func:`forge_jax.generation.settings.stopping`)."""
    return settings.stopping(model_config, generation_config,
                             longest_prompt=longest_prompt).max_new_tokens


def _strip_eos(ids: list[int], eos) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def _sampling(function: str, sampling, config, legacy: settings.Legacy) -> SamplingParams:
    """``sampling`` as given, else the generation config's merged with the deprecated loose
    keywords (``temperature=``...)."""
    if sampling is None:
        return sampling_params(config, **legacy.sampling)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"{function}(): sampling must be a SamplingParams or None, got "
                        f"{sampling!r}")
    return sampling


def generate_ids(model: CausalLM, tokenizer: Tokenizer | None, prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 generation_config: GenerationConfig | None = None,
                 stream: Callable[[int, str], None] | None = None,
                 cache: CacheSpec | None = None, **generate_kwargs
                 ) -> tuple[list[str] | None, list[list[int]], GenerationStats]:
    """The engine of :func:`generate_text`, :func:`chat` and ``forge-jax generate``, on
    prompts already encoded: returns the texts, the new ids (eos included where one ended
    the sequence) and the :class:`GenerationStats`.

    ``tokenizer`` may be None (prompts given as ids, a checkpoint without
    ``tokenizer.json``): the texts are then None and ``stream`` is refused.
    ``generate_kwargs`` go to :func:`~forge_jax.generation.generate_with_stats`
    (``allow_beyond_max_positions``, ``callbacks`` with a ``progress``, ``warm_up``); the
    other arguments are :func:`generate_text`'s."""
    legacy = settings.legacy_keywords(
        "generate_ids", {k: v for k, v in generate_kwargs.items()
                         if k in settings.SAMPLING_KEYWORDS or k in settings.CACHE_KEYWORDS},
        sampling=sampling, cache=cache)
    generate_kwargs = {k: v for k, v in generate_kwargs.items()
                       if k not in settings.SAMPLING_KEYWORDS and k not in settings.CACHE_KEYWORDS}
    if generation_config is None and tokenizer is not None:
        generation_config = tokenizer.generation_config
    sampling = _sampling("generate_ids", sampling, generation_config, legacy)
    cache = settings.cache_spec("generate_ids", cache, legacy)
    stop = settings.stopping(
        model.config, generation_config, eos_token_id=eos_token_id,
        max_new_tokens=max_new_tokens, longest_prompt=max((len(p) for p in prompts), default=0),
        tokenizer_eos_id=None if tokenizer is None else tokenizer.eos_token_id)
    callbacks = generate_kwargs.pop("callbacks", None) or settings.Callbacks()
    streamer = None
    if stream is not None:
        if tokenizer is None:
            raise ValueError("stream needs a tokenizer to decode the tokens (tokenizer=None)")
        streamer = TextStreamer(tokenizer, len(prompts), stop.eos_token_ids, stream)
        if callbacks.on_tokens is not None:
            raise ValueError("give stream or callbacks.on_tokens, not both")
        callbacks = settings.Callbacks(callbacks.progress, streamer)
    ids, stats = generate_with_stats(
        model, prompts, stop.max_new_tokens, sampling=sampling, cache=cache,
        eos_token_id=stop.eos_token_ids, callbacks=callbacks, **generate_kwargs)
    if streamer is not None:
        streamer.close()
    texts = None if tokenizer is None else [
        tokenizer.decode(_strip_eos(row, stop.eos_token_ids)) for row in ids]
    return texts, ids, stats



def generate_text(model: CausalLM, tokenizer: Tokenizer, prompts: str | Sequence[str], *,
                  max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
                  eos_token_id: int | Sequence[int] | None = None,
                  generation_config: GenerationConfig | None = None,
                  stream: Callable[[int, str], None] | None = None,
                  cache: CacheSpec | None = None, add_special_tokens: bool = True,
                  **deprecated) -> str | list[str]:
    """Continues text prompts: encode, :func:`~forge_jax.generation.generate`, decode.

    Args:
      model: a :class:`~forge_jax.models.protocol.CausalLM` (a ``Llama``, ``DeepseekV3``, ...).
      tokenizer: from :func:`load_tokenizer` on the same checkpoint.
      prompts: a string, or a list of strings (a batch, of any lengths).
      max_new_tokens: per prompt; default: generation_config.json's, else 256 capped at
        the positions the model has left
        (:func:`forge_jax.generation.settings.stopping`).
      sampling: a :class:`~forge_jax.generation.SamplingParams`, used as given. None:
        ``generation_config``'s (by default the checkpoint's generation_config.json),
        :func:`forge_jax.generation.settings.sampling_params`; without one, greedy
        decoding and no filters. To change one value of the checkpoint's, use
        ``sampling_params(tokenizer.generation_config, temperature=0.7)``.
      eos_token_id: the ids that end a sequence. None: generation_config.json's, else
        config.json's, else the tokenizer's eos token. ``()``: none (always
        ``max_new_tokens`` tokens).
      generation_config: overrides ``tokenizer.generation_config``.
      stream: called as ``stream(index, piece)`` with each piece of text of prompt
        ``index`` as it is decoded (the pieces of a prompt concatenate to its result).
      cache: a :class:`~forge_jax.kv_cache.CacheSpec` (None: paged, in the model's
        compute dtype), as in :func:`~forge_jax.generation.generate`.
      add_special_tokens: apply tokenizer.json's post-processor (e.g. a leading ``<s>``).
      **deprecated: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty`` and ``seed`` (merged with ``generation_config``'s, as
        before), ``kv_cache_dtype``, ``page_size``, ``cache_dtype`` and a kind's name as
        ``cache``: accepted with a ``DeprecationWarning`` until the next release.

    Returns:
      The generated text (without the prompt and the eos token): a string for a string
      prompt, a list for a list.
    """
    legacy = settings.legacy_keywords("generate_text", deprecated, sampling=sampling,
                                      cache=cache)
    config = tokenizer.generation_config if generation_config is None else generation_config
    sampling = _sampling("generate_text", sampling, config, legacy)
    cache = settings.cache_spec("generate_text", cache, legacy)
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
                         sampling=sampling, eos_token_id=eos_token_id,
                         generation_config=config, stream=stream, cache=cache)[0]
    return texts[0] if single else texts


def chat(model: CausalLM, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
         max_new_tokens: int | None = None, sampling: SamplingParams | None = None,
         eos_token_id: int | Sequence[int] | None = None,
         generation_config: GenerationConfig | None = None,
         stream: Callable[[str], None] | None = None, cache: CacheSpec | None = None,
         **deprecated) -> str:
    """The assistant's reply to a conversation, rendered with the checkpoint's chat
    template (``add_generation_prompt=True``).

    Args:
      messages: ``[{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]``.
      stream: called as ``stream(piece)`` with each piece of the reply as it is decoded.
      The others, and the deprecated keywords: as in :func:`generate_text`.

    For a conversation that goes on, :class:`forge_jax.text.chat_session.ChatSession`
    keeps the KV cache between turns instead of prefilling the history again.

    Raises:
      ChatTemplateError: the checkpoint has no chat template.
      ValueError, TypeError: a malformed message (an unknown role, empty content).
    """
    legacy = settings.legacy_keywords("chat", deprecated, sampling=sampling, cache=cache)
    config = tokenizer.generation_config if generation_config is None else generation_config
    sampling = _sampling("chat", sampling, config, legacy)
    cache = settings.cache_spec("chat", cache, legacy)
    ids = encode_chat(tokenizer, messages)
    on_text = None if stream is None else (lambda i, piece: stream(piece))
    return generate_ids(model, tokenizer, [ids], max_new_tokens=max_new_tokens,
                        sampling=sampling, eos_token_id=eos_token_id,
                        generation_config=config, stream=on_text, cache=cache)[0][0]
