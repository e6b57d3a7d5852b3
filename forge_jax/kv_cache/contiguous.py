"""The contiguous KV cache: one ``[batch, max_len, kv_heads, head_dim]`` buffer per layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, sharding
from forge_jax.kv_cache import _base
from forge_jax.ops import kv_quant
from forge_jax.ops.attention import attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousKVCache(_base.KVCacheBase):
    """One K and one V buffer per layer and sequence: ``[batch, max_len, kv_heads, head_dim]``.

    Token ``i`` of sequence ``b`` lives at ``k[layer][b, i]``. ``lengths`` is carried
    for the caller (tokens in the cache per sequence); :meth:`write` does not change
    it, :meth:`with_lengths` does.

    Attributes:
      k, v: tuples (one entry per layer) of ``[batch, max_len, kv_heads, head_dim]`` arrays,
        or of int8/fp8 ``QuantizedArray`` buffers of that shape, a scale per token and KV
        head (:mod:`forge_jax.ops.kv_quant`).
      lengths: int32 ``[batch]``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def create(cls, *, num_layers: int, batch: int, max_len: int, kv_heads: int,
               head_dim: int, dtype: Any = jnp.float32,
               quantize: str | None = None) -> ContiguousKVCache:
        """An empty cache (zeros, ``lengths == 0``) of the given geometry and dtype;
        ``quantize="int8"`` or ``"fp8"`` for quantized buffers standing for ``dtype``."""
        num_layers, shape, dtype = _base.geometry(num_layers, dict(
            batch=batch, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim), dtype)
        return cls(k=_base.zeros_per_layer(num_layers, shape, dtype, quantize),
                   v=_base.zeros_per_layer(num_layers, shape, dtype, quantize),
                   lengths=jnp.zeros((shape[0],), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[2]

    def _kv(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        return self.k, self.v

    def _with_kv(self, k, v) -> ContiguousKVCache:
        return dataclasses.replace(self, k=k, v=v)

    def _write_layer(self, layer, k, v, positions, valid) -> tuple[jax.Array, jax.Array]:
        k, v, positions, valid = map(jnp.asarray, (k, v, positions, valid))
        positions = positions.astype(jnp.int32)
        # Skipped tokens go out of bounds and are dropped (.at[] would wrap negatives).
        keep = valid & (positions >= 0)
        positions = jnp.where(keep, positions, self.max_len)

        def scatter(buffer, new, positions):  # per shard on a mesh (forge_jax.sharding)
            rows = jnp.broadcast_to(jnp.arange(buffer.shape[0], dtype=jnp.int32)[:, None],
                                    positions.shape)
            return buffer.at[rows, positions].set(new.astype(buffer.dtype), mode="drop")

        def write(buffer, new):
            return sharding.per_shard(_write_partition, scatter, dict(
                buffer=jnp.asarray(buffer), new=new, positions=positions))()

        def write_pool(pool, new):
            if not kv_quant.is_quantized(pool):
                return write(pool, new)
            values, scales = kv_quant.quantize_vectors(new, pool.format)
            return kv_quant.with_values(pool, write(pool.values, values),
                                        write(pool.scales, scales))

        with jax.named_scope("kv_cache_write"):
            return write_pool(self.k[layer], k), write_pool(self.v[layer], v)

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None, sinks=None,
               attention_chunk_size=None):
        """:func:`forge_jax.attention` of ``q`` over layer ``layer``'s keys and values.

        Causal with explicit positions: query ``t`` of sequence ``b`` at position
        ``q_positions[b, t]`` sees keys ``j <= q_positions[b, t]`` with
        ``j < kv_lengths[b]`` (and within ``sliding_window`` when given). A cache
        stored in another dtype than ``q`` is promoted for the math (e.g. bfloat16 cache,
        float32 queries); the result is in ``q.dtype``. A quantized cache's layer is
        dequantized (to float32) before :func:`forge_jax.attention` reads it.

        Args:
          layer: static layer index.
          q: ``[batch, t, q_heads, head_dim]``.
          q_positions: int ``[batch, t]``.
          kv_lengths: int ``[batch]``, valid tokens per sequence (the new ones included).
          scale, sliding_window, logits_soft_cap, implementation, sinks,
            attention_chunk_size: as in ``fj.attention``.

        Returns:
          ``[batch, t, q_heads, head_dim]`` in ``q.dtype``.
        """
        layer = _base.layer_index(layer, self.num_layers)
        _checks.array("q", q, ndim=4)
        # fj.attention reads a cache of another dtype as is (float32 math, q.dtype out):
        # no cast of the whole cache per step.
        k, v = (kv_quant.dequantize_pool(x, jnp.float32) for x in (self.k[layer], self.v[layer]))
        return attention(q, k, v, scale=scale,
                         q_positions=q_positions, kv_lengths=kv_lengths,
                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                         implementation=implementation, sinks=sinks,
                         attention_chunk_size=attention_chunk_size)


def _write_partition(args, config):
    """How a contiguous cache write splits over a mesh (:mod:`forge_jax.sharding`)."""
    # ContiguousKVCache.write: each data shard writes its own rows, each tensor shard its
    # own heads; without the rule XLA's scatter gathers the new rows across the data axis.
    buf = args["buffer"]  # [batch, max_len, kv_heads, head_dim]
    b = sharding.divisible(config, config.dp_name, buf.shape[0])
    h = sharding.divisible(config, config.tp_name, buf.shape[2])
    spec = P(b, None, h, None)
    return {"buffer": spec, "new": spec, "positions": P(b, None)}, spec
