"""The packed state pool: a :class:`~forge_jax.kv_cache.RecurrentStatePool` seen through one
packed row of many sequences (the serving engine's step over linear-attention layers), as
:class:`~forge_jax.kv_cache.RaggedBatchCache` is a K/V pool's.

A linear-attention layer's recurrence runs along one sequence, so the layer cannot scan the
packed row as it comes: :meth:`RaggedStatePool.to_sequences` gathers the packed row into a
grid ``[seqs, span]`` (sequence ``s``'s new tokens in row ``s``, right-padded), the layer runs
its ops on the grid with :meth:`RaggedStatePool.sequence_lengths` and the states
:meth:`RaggedStatePool.read` gives (one per sequence, from its slot), and
:meth:`RaggedStatePool.from_sequences` scatters the outputs back into the packed row. The
grid and each sequence's slot come from the step's
:class:`~forge_jax.kv_cache.RaggedMetadata` (``segment_rows`` and ``state_slots``, built by
the host). A sequence whose first new token is at position 0 starts from zero states
whatever its slot held (a slot is reused by later sequences without clearing); slots of
sequences not in the step are neither read nor written.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from forge_jax import _checks
from forge_jax.kv_cache import _base
from forge_jax.kv_cache.ragged import RaggedMetadata
from forge_jax.kv_cache.recurrent import RecurrentStatePool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedStatePool:
    """The state arrays of a :class:`RecurrentStatePool` and one packed step's layout: a
    :class:`~forge_jax.kv_cache.contract.StateCache` with one row (``batch == 1``) holding
    many sequences.

    Attributes:
      conv, state: per layer, the pool's ``[num_slots, kernel - 1, conv_dim]`` and
        ``[num_slots, v_heads, dk, dv]`` arrays.
      slots: int32 ``[seqs]``, each sequence's slot (``-1``: none; it reads zeros and
        writes nothing).
      fresh: bool ``[seqs]``, the sequences whose first new token is at position 0: they
        read zero states.
      rows: int32 ``[seqs, span]``, the packed row of each new token of each sequence,
        ``-1`` past them (the metadata's ``segment_rows``).
      lengths: int32 ``[1]``, the packed row's length as the model last set it (carried for
        the contract).
    """

    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]
    slots: jax.Array
    fresh: jax.Array
    rows: jax.Array
    lengths: jax.Array

    @classmethod
    def from_pool(cls, pool: RecurrentStatePool, metadata: RaggedMetadata) -> RaggedStatePool:
        """The packed view of ``pool``'s states (its own slots and lengths unused) for the
        step ``metadata`` lays out; the metadata must carry ``state_slots`` and
        ``segment_rows``."""
        if metadata.state_slots is None or metadata.segment_rows is None:
            raise ValueError("a packed step over linear-attention layers needs the metadata's "
                             "state_slots and segment_rows (one state slot per sequence), got "
                             f"state_slots={metadata.state_slots} and segment_rows="
                             f"{metadata.segment_rows}")
        rows = jnp.asarray(metadata.segment_rows, jnp.int32)
        slots = jnp.asarray(metadata.state_slots, jnp.int32)
        _checks.array("segment_rows", rows, ndim=2, kind="int")
        _checks.array("state_slots", slots, ndim=1, kind="int")
        seqs = rows.shape[0]
        if slots.shape[0] != seqs or seqs > metadata.kv_lengths.shape[0]:
            raise ValueError(f"state_slots must be [seqs] with segment_rows' [seqs, span] and "
                             f"seqs at most kv_lengths' {metadata.kv_lengths.shape[0]}, got "
                             f"{slots.shape=}, {rows.shape=}")
        new = jnp.sum(rows >= 0, axis=1, dtype=jnp.int32)  # [seqs]
        kv_lengths = jnp.asarray(metadata.kv_lengths, jnp.int32)[:seqs]
        in_step = (jnp.arange(seqs) < metadata.num_seqs) & (new > 0)
        return cls(conv=pool.conv, state=pool.state, slots=jnp.where(in_step, slots, -1),
                   fresh=kv_lengths - new <= 0, rows=rows,
                   lengths=jnp.zeros((1,), jnp.int32))

    def into_pool(self, pool: RecurrentStatePool) -> RecurrentStatePool:
        """``pool`` holding this view's (written) states."""
        return dataclasses.replace(pool, conv=self.conv, state=self.state)

    @property
    def num_layers(self) -> int:
        return len(self.state)

    @property
    def num_slots(self) -> int:
        return self.state[0].shape[0]

    @property
    def batch(self) -> int:
        return 1

    @property
    def num_sequences(self) -> int:
        """The grid's sequences (``seqs``: the step's, then padding)."""
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in (*self.conv, *self.state))

    def read(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """``(conv_state [seqs, kernel - 1, conv_dim], state [seqs, v_heads, dk, dv])`` of
        layer ``layer`` per sequence of the grid: its slot's, zeros for a sequence starting
        at position 0 or without a slot."""
        layer = _base.layer_index(layer, self.num_layers)
        zero = (self.slots < 0) | self.fresh
        index = jnp.maximum(self.slots, 0)

        def gather(pool):
            rows = pool[index]
            return jnp.where(zero.reshape((-1,) + (1,) * (rows.ndim - 1)), 0, rows)

        return gather(self.conv[layer]), gather(self.state[layer])

    def write_state(self, layer: int, conv_state, state) -> RaggedStatePool:
        """Stores each sequence's new states of layer ``layer`` in its slot (sequences
        without one dropped); the other slots are untouched."""
        layer = _base.layer_index(layer, self.num_layers)
        for name, new, pool in (("conv_state", conv_state, self.conv[layer]),
                                ("state", state, self.state[layer])):
            _checks.array(name, new)
            want = (self.num_sequences, *pool.shape[1:])
            if tuple(new.shape) != want:
                raise ValueError(f"{name} must be [seqs, ...] = {want} for this step, got "
                                 f"{name}.shape={tuple(new.shape)}")
        index = jnp.where(self.slots < 0, self.num_slots, self.slots)  # out of bounds: dropped

        def scatter(pool, new):
            return pool.at[index].set(new.astype(pool.dtype), mode="drop")

        with jax.named_scope("state_pool_write"):
            conv = _base.replace_layer(self.conv, layer, scatter(self.conv[layer], conv_state))
            st = _base.replace_layer(self.state, layer, scatter(self.state[layer], state))
        return dataclasses.replace(self, conv=conv, state=st)

    def to_sequences(self, x: jax.Array) -> jax.Array:
        """The packed row ``x`` ``[1, tokens, ...]`` as the grid ``[seqs, span, ...]``
        (zeros past each sequence's new tokens)."""
        cells = x[0][jnp.maximum(self.rows, 0)]  # [seqs, span, ...]
        pad = (self.rows < 0).reshape(self.rows.shape + (1,) * (cells.ndim - 2))
        return jnp.where(pad, 0, cells).astype(x.dtype)

    def from_sequences(self, y: jax.Array, tokens: int) -> jax.Array:
        """The grid ``y`` ``[seqs, span, ...]`` back in a packed row ``[1, tokens, ...]``
        (zeros in the rows no sequence holds)."""
        index = jnp.where(self.rows < 0, tokens, self.rows)  # out of bounds: dropped
        out = jnp.zeros((tokens, *y.shape[2:]), y.dtype)
        return out.at[index].set(y, mode="drop")[None]

    def sequence_lengths(self, lengths) -> jax.Array:
        """int32 ``[seqs]``: each grid row's real tokens (the per-row ``lengths`` of the
        packed row do not describe its sequences and are not read)."""
        del lengths
        return jnp.sum(self.rows >= 0, axis=1, dtype=jnp.int32)

    def with_lengths(self, lengths) -> RaggedStatePool:
        """The same view with ``lengths`` (int ``[1]``) replaced."""
        return dataclasses.replace(self, lengths=_base.lengths_array("lengths", lengths, 1))
