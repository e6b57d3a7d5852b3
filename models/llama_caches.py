"""The Llama model's caches: its side of the model contract
(:class:`forge_jax.models.protocol.CausalLM`) besides ``forward_cached``.

A K/V cache of ``kv_heads`` heads of ``head_dim`` per layer: a
:class:`~forge_jax.kv_cache.PagedKVCache` or a :class:`~forge_jax.kv_cache.ContiguousKVCache`
(optionally int8/fp8-quantized, :class:`~forge_jax.kv_cache.CacheSpec`'s ``kv_dtype``), the
engine's packed row a :class:`~forge_jax.kv_cache.RaggedBatchCache`; on a mesh the pools split
by KV head over the tensor axis (:mod:`forge_jax.models.llama_sharding`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from forge_jax import sharding as fj_sharding
from forge_jax.kv_cache import (
    CacheSpec,
    ContiguousKVCache,
    KVCache,
    PagedKVCache,
    RaggedBatchCache,
    RaggedMetadata,
    cache_geometry,
)
from forge_jax.ops import kv_quant


class LlamaCaches:
    """The cache members of :class:`forge_jax.models.llama_model.Llama` (a mixin: it reads
    the model's ``config``, ``dtype``, ``kv_heads``, ``layout`` and ``mesh``)."""

    def create_cache(self, spec: CacheSpec, *, batch: int, max_len: int,
                     num_pages: int | None = None, block_tables=None) -> KVCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.create_cache`."""
        config = self.config
        dtype = spec.resolved_dtype(self.dtype)
        if spec.kind == "paged":
            make = functools.partial(
                PagedKVCache.create, **cache_geometry(config), num_pages=num_pages,
                page_size=spec.page_size, kv_heads=self.kv_heads, dtype=dtype,
                block_tables=block_tables, quantize=spec.kv_dtype)
        else:
            make = functools.partial(
                ContiguousKVCache.create, **cache_geometry(config), batch=batch,
                max_len=max_len, kv_heads=self.kv_heads, dtype=dtype, quantize=spec.kv_dtype)
        return create_cache(make, self.mesh)

    def create_pool(self, spec: CacheSpec, *, num_pages: int, pages_per_seq: int,
                    prefix_caching: bool = False,
                    max_seqs: int | None = None) -> PagedKVCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.create_pool`: a
        :class:`~forge_jax.kv_cache.PagedKVCache`, never folded (its pages shared freely)."""
        del prefix_caching, max_seqs
        make = functools.partial(
            PagedKVCache.create, **cache_geometry(self.config),
            num_pages=num_pages, page_size=spec.page_size, kv_heads=self.kv_heads,
            dtype=spec.resolved_dtype(self.dtype),
            block_tables=np.zeros((0, pages_per_seq), np.int32), quantize=spec.kv_dtype,
            fold=False)
        return create_cache(make, self.mesh)

    def packed_cache(self, pool: PagedKVCache, metadata: RaggedMetadata) -> RaggedBatchCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.packed_cache`."""
        return RaggedBatchCache.from_pool(pool, metadata)

    def cache_shardings(self, cache: Any) -> Any:
        """See :meth:`forge_jax.models.protocol.CausalLM.cache_shardings`
        (:func:`cache_shardings`)."""
        return cache_shardings(cache, self.mesh)

    def cache_bytes(self, spec: CacheSpec, *, batch: int, max_len: int,
                    num_pages: int | None = None) -> int:
        """See :meth:`forge_jax.models.protocol.CausalLM.cache_bytes`: K and V of every
        layer, one device's KV heads (copies included) and, contiguous, batch rows."""
        config, mesh = self.config, self.mesh
        layers, kv_heads, head_dim = getattr(config, "kv_cache_geometry", None) or (
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        kv_dim = kv_heads * head_dim
        if mesh is not None:
            kv_dim = self.layout.kv_repeat * kv_dim // mesh.tp
            if spec.kind != "paged":
                kv_dim //= mesh.dp
        slots = num_pages * spec.page_size if spec.kind == "paged" else batch * max_len
        per_value = kv_quant.bytes_per_value(spec.kv_dtype, spec.resolved_dtype(self.dtype),
                                             head_dim)
        return int(2 * layers * slots * kv_dim * per_value)


def cache_shardings(cache: Any, mesh: fj_sharding.MeshConfig) -> Any:
    """The sharding of every buffer of a KV cache (the same pytree, NamedSharding leaves).

    Paged: pools split by KV head over the tensor axis, block tables and lengths
    replicated. Contiguous: buffers split by batch over the data axis (when it divides)
    and by KV head over the tensor axis; lengths replicated.
    """
    tp = mesh.tp_name if cache.kv_heads % mesh.tp == 0 else None
    if isinstance(cache, PagedKVCache):
        pool = mesh.sharding(tp, None, None, None)
        return dataclasses.replace(
            cache, k_pages=tuple(pool for _ in cache.k_pages),
            v_pages=tuple(pool for _ in cache.v_pages),
            block_tables=mesh.replicated(), lengths=mesh.replicated())
    if isinstance(cache, ContiguousKVCache):
        buffer = mesh.sharding(mesh.batch_axis(cache.batch), None, tp, None)
        return dataclasses.replace(cache, k=tuple(buffer for _ in cache.k),
                                   v=tuple(buffer for _ in cache.v), lengths=mesh.replicated())
    raise TypeError(f"not a forge_jax KV cache: {type(cache).__name__}")


def create_cache(make, mesh: fj_sharding.MeshConfig | None):
    """``make()`` (a cache constructor) with every buffer created directly in its shards
    (never whole on one device first); ``make()`` as is without a mesh."""
    if mesh is None:
        return make()
    shardings = cache_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)()
