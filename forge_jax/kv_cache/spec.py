"""What KV cache to build: a frozen spec, passed whole (generation, chat, the serving engine).

:class:`CacheSpec` says which kind of cache, its page size, its float dtype and whether its
values are stored quantized; the code that builds a cache reads the sizes (layers, heads,
pages, lengths) from the model and the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from forge_jax.ops import kv_quant

KINDS = ("paged", "contiguous")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A KV cache's kind and storage.

    Attributes:
      kind: ``"paged"`` (:class:`~forge_jax.kv_cache.PagedKVCache`: a pool of pages per
        layer and a block table per sequence) or ``"contiguous"``
        (:class:`~forge_jax.kv_cache.ContiguousKVCache`: one ``[batch, max_len, ...]``
        buffer per layer).
      page_size: tokens per page of a paged cache (>= 1); a contiguous cache rounds nothing.
      dtype: the cache's float dtype (None: the model's compute dtype).
      kv_dtype: ``"int8"`` or ``"fp8"`` to store K and V quantized with a float32 scale per
        token and KV head (:mod:`forge_jax.ops.kv_quant`); None stores ``dtype`` itself.
    """

    kind: str = "paged"
    page_size: int = 16
    dtype: Any = None
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got kind={self.kind!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got page_size={self.page_size!r}")
        if self.dtype is not None:
            try:
                dtype = jnp.dtype(self.dtype)
            except TypeError:
                raise ValueError(f"dtype must be a float dtype or None, got "
                                 f"dtype={self.dtype!r}") from None
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"dtype must be a float dtype or None, got dtype={dtype}")
            object.__setattr__(self, "dtype", dtype)
        kv_quant.kv_format("kv_dtype", self.kv_dtype)

    def resolved_dtype(self, compute_dtype: Any) -> jnp.dtype:
        """The cache's float dtype: :attr:`dtype`, else the model's ``compute_dtype``."""
        return jnp.dtype(compute_dtype if self.dtype is None else self.dtype)


def cache_geometry(config: Any) -> dict[str, int]:
    """``num_layers`` and ``head_dim`` of a model's KV cache, as the caches' ``create``
    takes them: a slot per layer at the config's ``head_dim``; or, for a config with a
    ``kv_cache_geometry`` ``(layers, kv_heads, head_dim)`` (Gemma 4: its shared layers
    hold no slot, its two head widths are stored in the wider), that one's."""
    geometry = getattr(config, "kv_cache_geometry", None)
    if geometry is None:
        return {"num_layers": config.num_hidden_layers, "head_dim": config.head_dim}
    return {"num_layers": geometry[0], "head_dim": geometry[2]}
