"""The packed latent cache: a latent page pool seen through one packed row of many sequences
(the serving engine's step over multi-head latent attention), as
:class:`~forge_jax.kv_cache.RaggedBatchCache` is a K/V pool's.

:meth:`RaggedLatentCache.write` puts each token's latent and RoPE key in the slot its
sequence's block table gives (:func:`~forge_jax.kv_cache.ragged.packed_slots`, the same rule
as a K/V pool's) and :meth:`RaggedLatentCache.attend` is one
:func:`forge_jax.mla_paged_attention` over every sequence, laid out by the step's
:class:`~forge_jax.kv_cache.RaggedMetadata`. Page ids are the engine's
:class:`~forge_jax.kv_cache.BlockManager`'s, so prefix sharing and copy-on-write work on the
latent pool unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forge_jax import _checks
from forge_jax.kv_cache import _base
from forge_jax.kv_cache.latent import PagedLatentCache, check_attend_options
from forge_jax.kv_cache.ragged import RaggedMetadata, packed_slots
from forge_jax.ops.mla import mla_paged_attention, mla_paged_write


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedLatentCache:
    """The pools of a :class:`PagedLatentCache` and one packed step's
    :class:`RaggedMetadata`: a latent cache with one row (``batch == 1``) holding many
    sequences.

    Attributes:
      pages: per layer ``[num_pages, page_size, width]`` pools.
      metadata: the step's :class:`RaggedMetadata`.
      lengths: int32 ``[1]``, carried for the contract (the sequences' lengths are
        ``metadata.kv_lengths``).
      kv_lora_rank, rope_dim: static, as a :class:`PagedLatentCache`'s.
    """

    pages: tuple[jax.Array, ...]
    metadata: RaggedMetadata
    lengths: jax.Array
    kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))
    rope_dim: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_pool(cls, pool: PagedLatentCache, metadata: RaggedMetadata) -> RaggedLatentCache:
        """The packed view of ``pool``'s pages (its own block tables and lengths unused)."""
        return cls(pages=pool.pages, metadata=metadata, lengths=jnp.zeros((1,), jnp.int32),
                   kv_lora_rank=pool.kv_lora_rank, rope_dim=pool.rope_dim)

    def into_pool(self, pool: PagedLatentCache) -> PagedLatentCache:
        """``pool`` holding this cache's (written) pages."""
        return dataclasses.replace(pool, pages=self.pages)

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def batch(self) -> int:
        return 1

    @property
    def page_size(self) -> int:
        return self.pages[0].shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.pages[0].dtype

    def write(self, layer: int, k, v, positions, valid) -> RaggedLatentCache:
        """Stores the packed row's latents ``k [1, tokens, 1, kv_lora_rank]`` and RoPE keys
        ``v [1, tokens, 1, rope_dim]`` at ``positions [1, tokens]`` of their sequences
        (``valid`` False, padding past the step's sequences, a negative position or one past
        the block table: skipped)."""
        layer = _base.layer_index(layer, self.num_layers)
        _checks.array("k", k, ndim=4)
        _checks.array("v", v, ndim=4)
        tokens = k.shape[1]
        if tuple(k.shape) != (1, tokens, 1, self.kv_lora_rank) or \
                tuple(v.shape) != (1, tokens, 1, self.rope_dim):
            raise ValueError(f"k and v must be [1, tokens, 1, kv_lora_rank / rope_dim] with "
                             f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, got "
                             f"{k.shape=}, {v.shape=}")
        with jax.named_scope("kv_cache_write"):
            pool = mla_paged_write(self.pages[layer], k.reshape(tokens, -1),
                                   v.reshape(tokens, -1).astype(k.dtype),
                                   packed_slots(self.metadata, self.page_size, positions, valid))
        return dataclasses.replace(self, pages=_base.replace_layer(self.pages, layer, pool))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None,
               up_proj=None) -> jax.Array:
        """``q = concat(q_nope, q_pe)`` ``[1, tokens, heads, nope_dim + rope_dim]`` over the
        pool: each sequence's rows see its own latents causally
        (:func:`forge_jax.mla_paged_attention`, weight-absorbed with ``up_proj=(w_uk,
        w_uv)``), lengths and query spans from :attr:`metadata` (``q_positions`` and
        ``kv_lengths`` are not read, as for any packed cache). Returns ``[1, tokens, heads,
        v_dim]``."""
        layer = _base.layer_index(layer, self.num_layers)
        check_attend_options(sliding_window, logits_soft_cap, up_proj)
        _checks.array("q", q, ndim=4)
        width = q.shape[3]
        m = self.metadata
        out = mla_paged_attention(
            q[0, :, :, :width - self.rope_dim], q[0, :, :, width - self.rope_dim:],
            self.pages[layer], *up_proj, m.block_tables, m.kv_lengths, m.cu_q_lens,
            m.num_seqs, scale=scale, implementation=implementation)
        return out[None]

    def as_stored(self, x: jax.Array) -> jax.Array:
        """``x`` rounded to the pool's dtype."""
        return x.astype(self.dtype)

    def with_lengths(self, lengths) -> RaggedLatentCache:
        """The same cache with ``lengths`` (int ``[1]``) replaced."""
        return dataclasses.replace(self, lengths=_base.lengths_array("lengths", lengths, 1))
