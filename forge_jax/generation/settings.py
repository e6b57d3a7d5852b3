"""Generation settings: the one place where a call's sampling, stopping and cache settings
are resolved from the caller's values, the checkpoint's defaults and the model's config.

* :func:`sampling_params`: a checkpoint's ``generation_config.json`` (data, read by
  :mod:`forge_jax.models.checkpoints`) merged with the caller's values into the runtime's
  :class:`SamplingParams`.
* :func:`stopping`: the generation front door for when a sequence stops: its eos ids and
  its token limit (``max_new_tokens``). The generate loop, the text API, the chat session,
  ``forge-jax generate`` and the serving engine all ask it, so they stop alike.
* :func:`encode_prompt` (from :mod:`forge_jax.generation.prompts`): the BOS decision, the
  token ids a text prompt is generated from, shared by the live text API and exported
  programs: the tokenizer's post-processor adds a BOS or none; nothing else prepends one.
* :class:`Callbacks`: the host-side hooks of a generate call (progress, streamed tokens).
* :func:`legacy_keywords`: the loose keywords that :class:`SamplingParams` and
  :class:`~forge_jax.kv_cache.CacheSpec` replaced, still accepted for one release with a
  ``DeprecationWarning`` naming the argument that replaces them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from forge_jax.generation.prompts import encode_prompt  # noqa: F401  (the front door's)
from forge_jax.generation.sampling import SamplingParams
from forge_jax.kv_cache import CacheSpec
from forge_jax.models.checkpoints.generation_config import GenerationConfig
from forge_jax.ops import kv_quant

# The token limit of a call that gives none and whose checkpoint sets none.
DEFAULT_MAX_NEW_TOKENS = 256


def implies_sampling(top_k=None, top_p=None, min_p=None) -> bool:
    """Whether a caller's filters ask for sampling: any of ``top_k`` (other than 0, which
    turns top-k off), ``top_p`` or ``min_p`` given. Without a temperature they sample at
    the generation config's temperature, else 1.0 (:func:`sampling_params`)."""
    return (top_k is not None and top_k != 0) or top_p is not None or min_p is not None


def sampling_params(config: GenerationConfig | None = None, *, temperature=None, top_k=None,
                    top_p=None, min_p=None, repetition_penalty=None,
                    seed: int = 0) -> SamplingParams:
    """The caller's values where given (not None), ``config``'s elsewhere. Without a
    caller's temperature, ``do_sample=True`` or a caller's ``top_k`` (other than 0),
    ``top_p`` or ``min_p`` samples at the config's temperature (1.0 if unset): a filter
    asks for sampling, and is not dropped for greedy decoding. Otherwise it is greedy.
    ``top_k=0`` turns top-k off."""
    config = config or GenerationConfig()
    if temperature is None:
        temperature = (1.0 if config.temperature is None else config.temperature) \
            if config.do_sample or implies_sampling(top_k, top_p, min_p) else 0.0
    top_k = config.top_k if top_k is None else top_k
    return SamplingParams(
        temperature, None if top_k == 0 else top_k, config.top_p if top_p is None else top_p,
        config.min_p if min_p is None else min_p,
        config.repetition_penalty if repetition_penalty is None else repetition_penalty,
        seed=seed)


# What a chat samples with where the checkpoint's generation_config.json says nothing of
# sampling: llama.cpp's defaults (a small instruct model decoded greedily repeats itself).
CHAT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def chat_generation_config(config: GenerationConfig | None, *,
                           says_greedy: bool) -> GenerationConfig:
    """The generation config a chat decodes with: ``config`` as it is when it samples
    (``do_sample``) or when the checkpoint says greedy (``says_greedy``: its
    generation_config.json sets ``"do_sample": false``); otherwise ``config`` sampling,
    with :data:`CHAT_SAMPLING`'s values where it sets none."""
    config = config or GenerationConfig()
    if config.do_sample or says_greedy:
        return config
    return dataclasses.replace(config, do_sample=True, **{
        k: v for k, v in CHAT_SAMPLING.items() if getattr(config, k) is None})


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When a generated sequence stops (:func:`stopping` resolves it).

    Attributes:
      eos_token_ids: a sequence stops after generating one of these (``()``: never early).
      max_new_tokens: new tokens per sequence at most.
    """

    eos_token_ids: tuple[int, ...]
    max_new_tokens: int


def check_eos_token_id(eos_token_id) -> tuple[int, ...]:
    """A caller's ``eos_token_id`` (an int or a collection of ints) as a sorted tuple;
    TypeError naming the value otherwise."""
    if isinstance(eos_token_id, int | np.integer) and not isinstance(eos_token_id, bool):
        return (int(eos_token_id),)
    if isinstance(eos_token_id, Sequence | set | frozenset) and not isinstance(
            eos_token_id, str | bytes) and all(
            isinstance(e, int | np.integer) and not isinstance(e, bool) for e in eos_token_id):
        return tuple(sorted({int(e) for e in eos_token_id}))
    raise TypeError(f"eos_token_id must be an int, a collection of ints (() for none) or "
                    f"None, got {eos_token_id!r}")


def stopping(config, generation_config: GenerationConfig | None = None, *,
             eos_token_id: int | Collection[int] | None = None,
             max_new_tokens: int | None = None, longest_prompt: int | None = None,
             tokenizer_eos_id: int | None = None) -> Stopping:
    """The eos ids and the token limit of a generation, resolved once for every caller.

    Args:
      config: the model's :class:`~forge_jax.models.llama.LlamaConfig` (``model.config``).
      generation_config: the checkpoint's ``generation_config.json`` (``from_pretrained``
        sets ``model.generation_config``; the tokenizer carries it too), or None.
      eos_token_id: the caller's: an id or a collection of ids (``()``: no eos). None:
        ``generation_config``'s, else ``config.json``'s, else ``tokenizer_eos_id`` (as
        transformers' ``generate`` chooses them, the tokenizer's last).
      max_new_tokens: the caller's (an int >= 0). None: ``generation_config``'s, else
        :data:`DEFAULT_MAX_NEW_TOKENS` (256), capped, when ``longest_prompt`` is given, at
        the positions the model has left after it (at least 1).
      longest_prompt: tokens of the longest prompt, for the cap above (None: no cap; a chat
        session caps each turn at its context itself).
      tokenizer_eos_id: the tokenizer's eos token id, the last resort for the eos ids.

    Raises:
      TypeError: ``eos_token_id`` is not an int or a collection of ints.
      ValueError: ``max_new_tokens`` is not an int >= 0.
    """
    if eos_token_id is not None:
        eos = check_eos_token_id(eos_token_id)
    elif generation_config is not None and generation_config.eos_token_id:
        eos = tuple(generation_config.eos_token_id)
    elif getattr(config, "eos_token_ids", None):  # a bare config may have none
        eos = tuple(config.eos_token_ids)
    else:
        eos = () if tokenizer_eos_id is None else (int(tokenizer_eos_id),)
    if max_new_tokens is None:
        if generation_config is not None and generation_config.max_new_tokens:
            max_new_tokens = generation_config.max_new_tokens
        elif longest_prompt is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        else:
            room = config.max_position_embeddings - longest_prompt
            max_new_tokens = max(1, min(DEFAULT_MAX_NEW_TOKENS, room))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    return Stopping(eos, int(max_new_tokens))


@dataclasses.dataclass(frozen=True)
class Callbacks:
    """The host-side hooks of a generate call (:func:`~forge_jax.generation.generate_with_stats`).

    Attributes:
      progress: called as ``progress(done, total)`` after the prefill and after each decode
        step (``done`` new tokens per sequence so far, ``total = max_new_tokens``), e.g. to
        drive a progress bar.
      on_tokens: streams the tokens: called as ``on_tokens(i, tokens)`` with the ``i``-th
        new token of every prompt (int32 NumPy ``[batch]``), for ``i = 0, 1, ...`` in
        order, as soon as they reach the host (one decode step behind the device, the same
        read the eos check makes, so streaming adds no wait per token). A sequence's tokens
        after its eos are passed too (ignore them).
    """

    progress: Callable[[int, int], None] | None = None
    on_tokens: Callable[[int, np.ndarray], None] | None = None


# Loose keywords that SamplingParams and CacheSpec replaced: name -> its field there.
SAMPLING_KEYWORDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
CACHE_KEYWORDS = {"page_size": "page_size", "cache_dtype": "dtype", "kv_cache_dtype": "kv_dtype"}


@dataclasses.dataclass(frozen=True)
class Legacy:
    """The deprecated keywords of one call, sorted by what replaces them."""

    sampling: dict
    cache: dict
    other: dict


def legacy_keywords(function: str, kwargs: dict, *, sampling: SamplingParams | None = None,
                    cache=None, other: Mapping[str, str] | None = None) -> Legacy:
    """Sorts a call's deprecated keywords (``kwargs``): the sampling ones (now
    ``sampling=SamplingParams(...)``), the cache ones (now ``cache=CacheSpec(...)``) and
    ``other``'s (keyword -> the argument that replaces it, e.g. ``"callbacks=Callbacks"``).
    Warns once (``DeprecationWarning``) naming the new arguments; raises TypeError for an
    unknown keyword, or for a deprecated one given with the argument that replaces it."""
    other = other or {}
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYWORDS) - set(CACHE_KEYWORDS) - set(other))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    legacy = Legacy({k: v for k, v in kwargs.items() if k in SAMPLING_KEYWORDS},
                    {CACHE_KEYWORDS[k]: v for k, v in kwargs.items() if k in CACHE_KEYWORDS},
                    {k: v for k, v in kwargs.items() if k in other})
    if legacy.sampling and sampling is not None:
        raise TypeError(f"{function}() got sampling= and {', '.join(legacy.sampling)}=: put "
                        f"them in the SamplingParams")
    if legacy.cache and isinstance(cache, CacheSpec):
        raise TypeError(f"{function}() got cache=CacheSpec(...) and "
                        f"{', '.join(k for k in kwargs if k in CACHE_KEYWORDS)}=: put them in "
                        f"the CacheSpec")
    if kwargs:
        new = []
        if legacy.sampling:
            new.append(f"sampling=SamplingParams({', '.join(f'{k}=...' for k in legacy.sampling)})")
        if legacy.cache:
            new.append(f"cache=CacheSpec({', '.join(f'{k}=...' for k in legacy.cache)})")
        for target in dict.fromkeys(other[k] for k in legacy.other):
            names = [k for k in legacy.other if other[k] == target]
            new.append(f"{target}({', '.join(f'{k}=...' for k in names)})")
        warnings.warn(f"{function}(): the keywords {', '.join(sorted(kwargs))} are deprecated "
                      f"and will be removed in the next release; pass {', '.join(new)}",
                      DeprecationWarning, stacklevel=3)
    return legacy


def cache_spec(function: str, cache, legacy: Legacy | None = None) -> CacheSpec:
    """The :class:`CacheSpec` of a call: ``cache`` itself, ``CacheSpec()`` for None, or,
    deprecated (warning), a kind's name (``"paged"``, ``"contiguous"``) with the loose
    cache keywords of ``legacy``."""
    if isinstance(cache, CacheSpec):
        return cache
    fields = dict(legacy.cache) if legacy is not None else {}
    if "kv_dtype" in fields:  # named as the caller named it
        kv_quant.kv_format("kv_cache_dtype", fields["kv_dtype"])
    if isinstance(cache, str):
        warnings.warn(f"{function}(cache={cache!r}) is deprecated and will be removed in the "
                      f"next release; pass cache=CacheSpec(kind={cache!r})",
                      DeprecationWarning, stacklevel=3)
        fields["kind"] = cache
    elif cache is not None:
        raise TypeError(f"cache must be a forge_jax.kv_cache.CacheSpec or None, got {cache!r}")
    return CacheSpec(**fields)
