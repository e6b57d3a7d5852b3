"""The caches of the gated delta-rule hybrids (:class:`forge_jax.models.qwen3_next.Qwen3Next`):
their side of the runtime's model contract besides ``forward_cached``.

A cache is a :class:`~forge_jax.kv_cache.HybridCache`: a K/V cache over the full-attention
layers only (:class:`~forge_jax.kv_cache.PagedKVCache` or
:class:`~forge_jax.kv_cache.ContiguousKVCache`, quantized as the
:class:`~forge_jax.kv_cache.CacheSpec`'s ``kv_dtype`` says) and a
:class:`~forge_jax.kv_cache.RecurrentStatePool` over the delta-rule layers, row ``b`` of the
step on slot ``b``. The serving engine's packed row of many sequences is refused: its step
carries no recurrent-state slot per sequence, and prefix caching cannot share a recurrent
state by pages (:data:`~forge_jax.kv_cache.PREFIX_CACHING_REFUSED`).
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
)
from forge_jax.ops import kv_quant

ENGINE_REFUSED = (
    "the serving engine packs many sequences into one row, and its steps carry no "
    "recurrent-state slot per sequence for the gated delta-rule layers: generate with "
    "forge_jax.generation.generate")


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
                    prefix_caching: bool = False) -> Any:
        """Refused (ValueError): see the module docstring."""
        if prefix_caching:
            raise ValueError(f"model_type={self.config.model_type!r}: {PREFIX_CACHING_REFUSED}")
        raise ValueError(f"model_type={self.config.model_type!r}: {ENGINE_REFUSED}")

    def packed_cache(self, pool: Any, metadata: Any) -> Any:
        """Refused (ValueError): see the module docstring."""
        raise ValueError(f"model_type={self.config.model_type!r}: {ENGINE_REFUSED}")

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
