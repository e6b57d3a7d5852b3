"""The contiguous latent cache of multi-head latent attention: one ``[batch, max_len, width]``
buffer of latents per layer (the latent cache of a fixed batch, as
:class:`~forge_jax.kv_cache.ContiguousKVCache` is a K/V cache's).

Token ``i`` of row ``b`` is the vector ``[latent, k_pe]`` at ``buffers[layer][b, i]``
(``width >= kv_lora_rank + rope_dim``, :func:`~forge_jax.kv_cache.latent.pool_width`). The
buffer of a layer *is* a page pool of one page per row (``page_size == max_len``, row ``b``
owning page ``b``), so writing and the weight-absorbed attention are the paged latent
cache's own (:func:`forge_jax.mla_paged_write`, :func:`forge_jax.mla_paged_attention`) with
that trivial block table: no copy, one code path. The contract's members are those of
:class:`~forge_jax.kv_cache.PagedLatentCache` (:mod:`forge_jax.kv_cache.latent`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax.kv_cache import _base
from forge_jax.kv_cache.latent import PagedLatentCache, pool_width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousLatentCache:
    """One latent buffer per layer and row.

    Attributes:
      buffers: tuple (one entry per layer) of ``[batch, max_len, width]`` arrays.
      lengths: int32 ``[batch]``, tokens in each row before this step.
      kv_lora_rank, rope_dim: static, the widths of the latent and of the RoPE key.
    """

    buffers: tuple[jax.Array, ...]
    lengths: jax.Array
    kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))
    rope_dim: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, *, num_layers: int, batch: int, max_len: int, kv_lora_rank: int,
               rope_dim: int, dtype: Any = jnp.float32, width: int | None = None
               ) -> ContiguousLatentCache:
        """An empty cache (zeros, ``lengths == 0``); ``width`` as for
        :meth:`PagedLatentCache.create` (None: :func:`pool_width`)."""
        num_layers, shape, dtype = _base.geometry(num_layers, dict(
            batch=batch, max_len=max_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim), dtype)
        batch, max_len, kv_lora_rank, rope_dim = shape
        if width is None:
            width = pool_width(kv_lora_rank, rope_dim)
        elif width < kv_lora_rank + rope_dim:
            raise ValueError(f"width must hold kv_lora_rank + rope_dim = {kv_lora_rank} + "
                             f"{rope_dim}, got {width=}")
        return cls(buffers=_base.zeros_per_layer(num_layers, (batch, max_len, width), dtype),
                   lengths=jnp.zeros((batch,), jnp.int32), kv_lora_rank=kv_lora_rank,
                   rope_dim=rope_dim)

    @property
    def num_layers(self) -> int:
        return len(self.buffers)

    @property
    def batch(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.buffers[0].shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.buffers[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers, measured from the arrays."""
        return sum(int(b.nbytes) for b in self.buffers)

    def _paged(self, layer: int) -> PagedLatentCache:
        """Layer ``layer``'s buffer as a one-layer pool of one ``max_len`` page per row."""
        layer = _base.layer_index(layer, self.num_layers)
        return PagedLatentCache(
            pages=(self.buffers[layer],),
            block_tables=jnp.arange(self.batch, dtype=jnp.int32)[:, None],
            lengths=self.lengths, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim)

    def write(self, layer: int, k, v, positions, valid) -> ContiguousLatentCache:
        """Stores the latents ``k [batch, t, 1, kv_lora_rank]`` and RoPE keys ``v [batch, t,
        1, rope_dim]`` at ``positions [batch, t]`` (``valid`` False, a negative position or
        one at or past ``max_len``: skipped), as :meth:`PagedLatentCache.write`."""
        written = self._paged(layer).write(0, k, v, positions, valid)
        return dataclasses.replace(self, buffers=_base.replace_layer(
            self.buffers, _base.layer_index(layer, self.num_layers), written.pages[0]))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None,
               up_proj=None) -> jax.Array:
        """Weight-absorbed latent attention of ``q = concat(q_nope, q_pe)`` ``[batch, t,
        heads, nope_dim + rope_dim]`` over layer ``layer``'s buffer, with the masking and
        arguments of :meth:`PagedLatentCache.attend`. Returns ``[batch, t, heads, v_dim]``."""
        return self._paged(layer).attend(
            0, q, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            implementation=implementation, up_proj=up_proj)

    def as_stored(self, x: jax.Array) -> jax.Array:
        """``x`` rounded to the buffers' dtype (what :meth:`attend` reads)."""
        return x.astype(self.dtype)

    def with_lengths(self, lengths) -> ContiguousLatentCache:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=_base.lengths_array("lengths", lengths,
                                                                     self.batch))
