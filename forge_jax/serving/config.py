"""The serving engine's knobs: :class:`EngineConfig`, a frozen dataclass passed whole to
:class:`forge_jax.serving.engine.Engine` (vary it with :func:`dataclasses.replace`)."""

from __future__ import annotations

import dataclasses
import numbers
import warnings

from forge_jax.generation.speculative import SpeculativeConfig
from forge_jax.kv_cache import CacheSpec


def _int_at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {name}={value!r}")


# Engine(...)'s keywords of the last release -> (where they now live, the CacheSpec field).
_CACHE_KEYWORDS = {"page_size": "page_size", "cache_dtype": "dtype", "kv_cache_dtype": "kv_dtype"}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an :class:`~forge_jax.serving.engine.Engine` batches, caches and stops.

    Checked on creation: a ValueError (TypeError for a wrong type) names the field and value.

    Attributes:
      max_batch_tokens: tokens per step (decode tokens plus prefill chunks); rounded up to a
        power of two, at least 8.
      min_batch_tokens: the smallest row bucket, ``1 <= min_batch_tokens <= max_batch_tokens``:
        a step's rows are padded to a power of two at least this (a step of a few decodes
        then computes a few rows, not a prefill's), or to three quarters of one from 192
        rows up (``forge_jax.serving.batch_step.row_bucket``).
      max_seqs: sequences per step (and running at once).
      num_pages: pages in the pool (of ``cache.page_size`` tokens each).
      max_model_len: prompt plus new tokens per request at most (None: the model's
        ``max_position_embeddings``).
      max_waiting: requests waiting at most; more raise ``QueueFull``.
      prefix_caching: keep full pages for later requests with the same prefix.
      overlap: dispatch each step before reading the previous step's tokens: a sequence
        whose token is still on the device gets it from there, and the host hands out the
        previous step's tokens while the device runs the next. The tokens are the same; a
        request that a stop token or string ends has computed one row more than it needed.
        False: each step's tokens are read and handed out before the next is scheduled.
      eos_token_ids: ids that end every request (None: the model's; a list is kept as a
        tuple).
      cache: the page pool's :class:`~forge_jax.kv_cache.CacheSpec`, of kind ``"paged"``:
        ``page_size``; ``dtype`` (None: the model's compute dtype; on CPU with JAX 0.10, XLA
        rewrites a whole bfloat16 pool at every write, JAX 0.11 and 0.12 write in place,
        BENCHMARKS.md); ``kv_dtype`` ``"int8"`` or ``"fp8"`` for quantized pages, a float32
        scale per token and KV head beside them (:mod:`forge_jax.ops.kv_quant`), written,
        shared by the prefix cache, copied and freed with their pages.
      speculative: a :class:`~forge_jax.generation.speculative.SpeculativeConfig`
        (prompt-lookup drafts, or a draft model's with ``draft_model=``, verified in the
        same ragged step as the other rows) or None. It serves the requests without a
        grammar, penalties or a logit bias (the others run as without it; logprobs are
        served); such a request decodes every other step while others share its steps
        (its drafts need its last token on the host).
    """

    max_batch_tokens: int = 512
    min_batch_tokens: int = 1
    max_seqs: int = 64
    num_pages: int = 512
    max_model_len: int | None = None
    max_waiting: int = 1024
    prefix_caching: bool = True
    overlap: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    cache: CacheSpec = CacheSpec()
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        for name in ("max_batch_tokens", "min_batch_tokens", "max_seqs", "num_pages",
                     "max_waiting"):
            _int_at_least(name, getattr(self, name), 1)
        if self.min_batch_tokens > self.max_batch_tokens:
            raise ValueError(f"min_batch_tokens must be <= max_batch_tokens, got "
                             f"min_batch_tokens={self.min_batch_tokens} and "
                             f"max_batch_tokens={self.max_batch_tokens}")
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 1)
        for name in ("prefix_caching", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        if self.eos_token_ids is not None:
            ids = self.eos_token_ids
            if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__") or any(
                    isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0
                    for t in ids):
                raise ValueError(f"eos_token_ids must be ints >= 0 or None, got "
                                 f"eos_token_ids={ids!r}")
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in ids))
        if not isinstance(self.cache, CacheSpec):
            raise TypeError(f"cache must be a forge_jax.kv_cache.CacheSpec, got "
                            f"cache={self.cache!r:.80}")
        if self.speculative is not None and not isinstance(self.speculative,
                                                           SpeculativeConfig):
            raise TypeError(f"speculative must be a forge_jax.generation.SpeculativeConfig "
                            f"or None, got speculative={self.speculative!r:.80}")
        if self.cache.kind != "paged":
            raise ValueError(f"cache.kind must be 'paged' (the engine's pool is paged), got "
                             f"cache.kind={self.cache.kind!r}")


def from_keywords(config: EngineConfig | None, keywords: dict) -> EngineConfig:
    """``Engine(model, tokenizer, max_batch_tokens=..., page_size=..., ...)``, the keywords of
    the last release, as an :class:`EngineConfig` (over ``config``'s values, if given), with a
    ``DeprecationWarning`` naming the new form; removed in the next release."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache"}
    unknown = sorted(set(keywords) - fields - set(_CACHE_KEYWORDS))
    if unknown:
        raise TypeError(f"Engine() got an unexpected keyword argument {unknown[0]!r}")
    warnings.warn(f"Engine(): the keywords {', '.join(sorted(keywords))} are deprecated and "
                  f"will be removed in the next release; pass config=EngineConfig(...) (page "
                  f"size and dtypes in its cache=CacheSpec(...))", DeprecationWarning,
                  stacklevel=3)
    config = EngineConfig() if config is None else config
    cache = {_CACHE_KEYWORDS[k]: v for k, v in keywords.items() if k in _CACHE_KEYWORDS}
    return dataclasses.replace(
        config, **{k: v for k, v in keywords.items() if k in fields},
        **({"cache": dataclasses.replace(config.cache, **cache)} if cache else {}))
