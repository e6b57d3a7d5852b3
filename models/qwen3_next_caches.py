"""The caches of the gated delta-rule hybrids (:class:`forge_jax.models.qwen3_next.Qwen3Next`):
their side of the runtime's model contract besides ``forward_cached``.

A cache is a :class:`~forge_jax.kv_cache.HybridCache`: a K/V cache over the full-attention
layers only (:class:`~forge_jax.kv_cache.PagedKVCache` or
:class:`~forge_jax.kv_cache.ContiguousKVCache`, quantized as the
:class:`~forge_jax.kv_cache.CacheSpec`'s ``kv_dtype`` says) and a
:class:`~forge_jax.kv_cache.RecurrentStatePool` over the delta-rule layers, row ``b`` of the
step on slot ``b``.

The serving engine's pool (:meth:`Qwen3NextCaches.create_pool`) is a
:class:`~forge_jax.kv_cache.HybridCache` too: a page pool over the attention layers and a
state pool of one slot per sequence the engine runs at once; its packed view
(:meth:`Qwen3NextCaches.packed_cache`) attends through the pages with ragged paged attention
(:class:`~forge_jax.kv_cache.RaggedBatchCache`) and runs the delta-rule layers per sequence
of the packed row, each from its slot (:class:`~forge_jax.kv_cache.RaggedStatePool`, the
slots in the step's metadata). Prefix caching is refused: a recurrent state cannot be shared
by pages (:data:`~forge_jax.kv_cache.PREFIX_CACHING_REFUSED`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from forge_jax.kv_cache import (
    PREFIX_CACHING_REFUSED,
    CacheSpec,
    ContiguousKVCache,
    HybridCache,
    PagedKVCache,
    RaggedBatchCache,
    RaggedMetadata,
    RaggedStatePool,
)
from forge_jax.ops import kv_quant


class Qwen3NextCaches:
    """The cache members of :class:`~forge_jax.models.qwen3_next.Qwen3Next` (a mixin: it
    reads the model's ``config``, ``dtype``, ``kv_heads``, ``num_attention_layers``, ``mesh``,
    ``layout`` and ``hybrid_cache``)."""

    def create_cache(self, spec: CacheSpec, *, batch: int, max_len: int,
                     num_pages: int | None = None, block_tables=None) -> HybridCache:
        """An empty :class:`~forge_jax.kv_cache.HybridCache` for ``batch`` rows: the
        attention layers' cache of ``spec.kind`` (as
        :meth:`forge_jax.models.protocol.CausalLM.create_cache` describes) and a state pool
        of ``batch`` slots (on a mesh: created in its shards, :meth:`cache_shardings`)."""
        c = self.config
        geometry = dict(num_layers=self.num_attention_layers, kv_heads=self.kv_heads,
                        head_dim=c.head_dim, dtype=spec.resolved_dtype(self.dtype),
                        quantize=spec.kv_dtype)

        def make():
            if spec.kind == "paged":
                return self.hybrid_cache(PagedKVCache.create(
                    num_pages=num_pages, page_size=spec.page_size, block_tables=block_tables,
                    **geometry))
            return self.hybrid_cache(ContiguousKVCache.create(batch=batch, max_len=max_len,
                                                              **geometry))

        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=self.cache_shardings(jax.eval_shape(make)))()

    def create_pool(self, spec: CacheSpec, *, num_pages: int, pages_per_seq: int,
                    prefix_caching: bool = False, max_seqs: int | None = None) -> HybridCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.create_pool`: a
        :class:`~forge_jax.kv_cache.HybridCache` of a page pool over the attention layers
        (never folded) and a state pool of ``max_seqs`` slots (required: one per sequence
        the engine runs at once; on a mesh, created in its shards). ``prefix_caching`` is
        refused (ValueError, :data:`~forge_jax.kv_cache.PREFIX_CACHING_REFUSED`)."""
        if prefix_caching:
            raise ValueError(f"model_type={self.config.model_type!r}: {PREFIX_CACHING_REFUSED}")
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"model_type={self.config.model_type!r} keeps a recurrent state "
                             f"per sequence: create_pool needs max_seqs (an int >= 1, the "
                             f"sequences run at once), got max_seqs={max_seqs!r}")
        c = self.config

        def make():
            return self.hybrid_cache(PagedKVCache.create(
                num_layers=self.num_attention_layers, kv_heads=self.kv_heads,
                head_dim=c.head_dim, dtype=spec.resolved_dtype(self.dtype),
                quantize=spec.kv_dtype, num_pages=num_pages, page_size=spec.page_size,
                block_tables=np.zeros((0, pages_per_seq), np.int32), fold=False),
                num_slots=max_seqs)

        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=self.cache_shardings(jax.eval_shape(make)))()

    def packed_cache(self, pool: HybridCache, metadata: RaggedMetadata) -> HybridCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.packed_cache`: the attention pages
        as a :class:`~forge_jax.kv_cache.RaggedBatchCache`, the states as a
        :class:`~forge_jax.kv_cache.RaggedStatePool` (``metadata`` must carry
        ``state_slots`` and ``segment_rows``)."""
        return HybridCache(attention=RaggedBatchCache.from_pool(pool.attention, metadata),
                           linear=RaggedStatePool.from_pool(pool.linear, metadata),
                           kinds=pool.kinds)

    def cache_shardings(self, cache: Any) -> Any:
        """See :meth:`forge_jax.models.protocol.CausalLM.cache_shardings`
        (:func:`forge_jax.models.qwen3_next_sharding.cache_shardings`: K/V by head, the
        state pool by value head where the delta-rule layers split, rows over the data
        axis)."""
        from forge_jax.models import qwen3_next_sharding

        return qwen3_next_sharding.cache_shardings(
            cache, self.mesh, linear_split=self.layout.linear_groups > 1)

    def cache_bytes(self, spec: CacheSpec, *, batch: int, max_len: int,
                    num_pages: int | None = None) -> int:
        """Bytes of :meth:`create_cache`'s cache: K and V of the attention layers, and the
        state pool's ``batch`` slots (conv states in the compute dtype, delta-rule states in
        float32), whatever the sequences' length; on a mesh, one device's share."""
        c, lin, mesh = self.config, self.config.linear, self.mesh
        dtype = spec.resolved_dtype(self.dtype)
        slots = num_pages * spec.page_size if spec.kind == "paged" else batch * max_len
        per_value = kv_quant.bytes_per_value(spec.kv_dtype, dtype, c.head_dim)
        kv = 2 * self.num_attention_layers * slots * self.kv_heads * c.head_dim * per_value
        linear_layers = c.num_hidden_layers - self.num_attention_layers
        state = (lin.v_heads * lin.k_head_dim * lin.v_head_dim * 4
                 + (lin.conv_kernel - 1) * lin.conv_dim * np.dtype(dtype).itemsize)
        if mesh is not None:  # (each split divides: qwen3_next_sharding.plan)
            kv //= mesh.tp * (mesh.dp if spec.kind != "paged" and mesh.batch_axis(batch)
                              else 1)
            state //= mesh.tp if self.layout.linear_groups > 1 else 1
            state //= mesh.dp if mesh.batch_axis(batch) else 1
        return int(kv + linear_layers * batch * state)
