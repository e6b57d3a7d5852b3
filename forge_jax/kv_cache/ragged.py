"""The ragged batch cache: a page pool seen through one packed row of many sequences.

A serving step packs the new tokens of many sequences (prefill chunks and decode tokens
alike) into one row ``[1, tokens]``; :class:`RaggedMetadata` says which rows belong to which
sequence, where each sequence's pages are and how long it is after the step, and
:class:`RaggedBatchCache` is the :class:`~forge_jax.kv_cache.KVCache` a model's
``forward_cached`` writes into and attends over with it
(:func:`forge_jax.ragged_paged_attention`). Both are pytrees; the host builds the metadata
per step (``forge_jax.serving.batch_step``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forge_jax.kv_cache import _base
from forge_jax.kv_cache.paged import PagedKVCache
from forge_jax.ops.paged import paged_write
from forge_jax.ops.ragged import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMetadata:
    """The layout of one packed step (the arguments of :func:`forge_jax.ragged_paged_attention`
    besides the queries and pages).

    Sequence ``s < num_seqs`` owns the rows ``cu_q_lens[s] .. cu_q_lens[s + 1] - 1`` of the
    packed row, the last ``cu_q_lens[s + 1] - cu_q_lens[s]`` of its ``kv_lengths[s]`` tokens;
    its token ``i`` lives in page ``block_tables[s, i // page_size]``. Rows past
    ``cu_q_lens[num_seqs]`` are padding.

    Attributes:
      block_tables: int32 ``[max_seqs, pages_per_seq]``.
      kv_lengths: int32 ``[max_seqs]``, tokens in the cache after this step, per sequence.
      cu_q_lens: int32 ``[max_seqs + 1]``, non-decreasing, ``cu_q_lens[0] == 0``.
      num_seqs: int32 scalar, the sequences in the step.
      state_slots: for a model whose layers keep a state per sequence (a
        :class:`~forge_jax.kv_cache.RaggedStatePool`), int32 ``[seqs]``: sequence ``s``'s
        slot in the state pool, ``-1`` for none; None otherwise.
      segment_rows: with ``state_slots``, int32 ``[seqs, span]``: the packed row of new token
        ``i`` of sequence ``s``, ``-1`` past its new tokens (the grid the per-sequence layers
        gather the packed row into: ``seqs >= num_seqs``, ``span`` at least the longest
        sequence's new tokens); None otherwise.
    """

    block_tables: jax.Array
    kv_lengths: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    state_slots: jax.Array | None = None
    segment_rows: jax.Array | None = None

    def sequence_of_rows(self, rows: int) -> jax.Array:
        """int32 ``[rows]``: the sequence each row of the packed row belongs to
        (``>= num_seqs`` for padding rows)."""
        row = jnp.arange(rows, dtype=jnp.int32)
        ends = jnp.asarray(self.cu_q_lens, jnp.int32)[1:]  # [max_seqs]
        return jnp.searchsorted(ends, row, side="right").astype(jnp.int32)


def packed_slots(metadata: RaggedMetadata, page_size: int, positions, valid) -> jax.Array:
    """int32 ``[tokens]``: the pool slot of each token of a packed row (``positions``,
    ``valid`` ``[1, tokens]``) laid out by ``metadata``, ``-1`` where it is not written:
    padding (``valid`` False or past the step's sequences), a negative position, or one
    beyond its sequence's block table. Any paged pool's packed view writes through it."""
    positions = jnp.asarray(positions, jnp.int32)[0]  # [tokens]
    m = metadata
    tables = jnp.asarray(m.block_tables, jnp.int32)  # [max_seqs, pages_per_seq]
    seq = m.sequence_of_rows(positions.shape[0])
    index = positions // page_size
    keep = (valid[0] & (seq < m.num_seqs) & (positions >= 0)
            & (index < tables.shape[1]))
    page = tables[jnp.clip(seq, 0, tables.shape[0] - 1),
                  jnp.clip(index, 0, tables.shape[1] - 1)]
    return jnp.where(keep, page * page_size + positions % page_size, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedBatchCache(_base.KVCacheBase):
    """The page pools of a :class:`~forge_jax.kv_cache.PagedKVCache` and the
    :class:`RaggedMetadata` of one packed step: a :class:`~forge_jax.kv_cache.KVCache` with
    one row (``batch == 1``) holding many sequences.

    :meth:`write` puts token ``t`` of the packed row at position ``positions[0, t]`` of the
    sequence the metadata assigns it (its slot from that sequence's block table), skipping
    ``valid == False`` rows; :meth:`attend` is one ragged paged attention over all sequences,
    with each sequence's length and query span read from the metadata (the per-row
    ``q_positions`` and ``kv_lengths`` of the contract do not describe a packed row's
    sequences and are not read).

    Attributes:
      k_pages, v_pages: per layer ``[kv_heads, num_pages, page_size, head_dim]`` pools (float,
        int8/fp8 ``QuantizedArray`` or ``FoldedPages``, as a ``PagedKVCache``'s).
      metadata: the step's :class:`RaggedMetadata`.
      lengths: int32 ``[1]``, the packed row's length as the model last set it (carried for
        the contract; the sequences' lengths are ``metadata.kv_lengths``).
      page_size: static, tokens per page.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    metadata: RaggedMetadata
    lengths: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_pool(cls, pool: PagedKVCache, metadata: RaggedMetadata) -> RaggedBatchCache:
        """The packed view of ``pool``'s pages (its own block tables and lengths unused)."""
        return cls(k_pages=pool.k_pages, v_pages=pool.v_pages, metadata=metadata,
                   lengths=jnp.zeros((1,), jnp.int32), page_size=pool.page_size)

    def into_pool(self, pool: PagedKVCache) -> PagedKVCache:
        """``pool`` holding this cache's (written) pages."""
        return dataclasses.replace(pool, k_pages=self.k_pages, v_pages=self.v_pages)

    @property
    def batch(self) -> int:
        return 1

    @property
    def kv_heads(self) -> int:
        return self.k_pages[0].shape[0]

    def slots(self, positions, valid) -> jax.Array:
        """int32 ``[tokens]``: the slot of each token of the packed row (``positions``,
        ``valid`` ``[1, tokens]``), ``-1`` where it is not written: padding (``valid``
        False or past the step's sequences), a negative position, or one beyond its
        sequence's block table."""
        return packed_slots(self.metadata, self.page_size, positions, valid)

    def _kv(self):
        return self.k_pages, self.v_pages

    def _with_kv(self, k, v) -> RaggedBatchCache:
        return dataclasses.replace(self, k_pages=k, v_pages=v)

    def _write_layer(self, layer, k, v, positions, valid):
        with jax.named_scope("kv_cache_write"):
            return paged_write(self.k_pages[layer], self.v_pages[layer], k[0], v[0],
                               self.slots(positions, valid))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None, sinks=None,
               attention_chunk_size=None):
        """``q`` ``[1, tokens, q_heads, head_dim]`` over the pages: each sequence's rows see
        its own keys causally (:func:`forge_jax.ragged_paged_attention`), the lengths and
        query spans from :attr:`metadata`; ``q_positions`` and ``kv_lengths`` (per row, see
        :meth:`forge_jax.kv_cache.KVCache.attend`) are not read. Returns ``[1, tokens,
        q_heads, head_dim]`` in ``q.dtype``."""
        layer = _base.layer_index(layer, self.num_layers)
        m = self.metadata
        out = ragged_paged_attention(
            q[0], self.k_pages[layer], self.v_pages[layer], m.block_tables, m.kv_lengths,
            m.cu_q_lens, m.num_seqs, scale=scale, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, implementation=implementation, sinks=sinks,
            attention_chunk_size=attention_chunk_size)
        return out[None]
