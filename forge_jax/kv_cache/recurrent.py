"""The recurrent-state pool of linear-attention layers, and hybrid caches.

A gated delta-rule layer (:func:`forge_jax.gated_delta_rule`) keeps no keys per token: each
sequence carries a fixed-size state per layer, the ``[v_heads, dk, dv]`` delta-rule state
and the last ``kernel - 1`` inputs of its short convolution (:func:`forge_jax.causal_conv1d`).
:class:`RecurrentStatePool` holds those for ``num_slots`` sequences, one slot each, and maps
the rows of a step to slots (``slots[b]``; ``-1`` for an idle row, which reads zeros and
writes nothing): generate gives row ``b`` slot ``b``; the serving engine gives each running
request a slot and names it in each packed step's metadata, where the packed view
(:class:`~forge_jax.kv_cache.RaggedStatePool`) reads zeros for a sequence starting at
position 0, so a slot changes hands without :meth:`RecurrentStatePool.reset`.

:class:`HybridCache` is the cache of a model whose layers use different caches (Qwen3-Next:
three linear-attention layers, then one full-attention layer): a
:class:`~forge_jax.kv_cache.KVCache` (contiguous, paged or ragged) over the full-attention
layers and a pool over the linear ones, addressed by the model's own layer index. It is a
:class:`~forge_jax.kv_cache.KVCache` for the attention layers and a
:class:`~forge_jax.kv_cache.contract.StateCache` for the linear ones.

Prefix caching shares a prefix's *pages* between sequences; a recurrent state summarises a
whole prefix and cannot be split into pages, so a cache with linear-attention layers refuses
it (:data:`PREFIX_CACHING_REFUSED`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks
from forge_jax.kv_cache import _base

PREFIX_CACHING_REFUSED = (
    "prefix caching shares a prefix's KV pages between sequences, but linear-attention "
    "layers keep one recurrent state per sequence that summarises its whole prefix and "
    "cannot be shared page by page: serve this model with prefix_caching=False")

LAYER_KINDS = ("attention", "linear")


def _check_slots(slots, num_slots: int) -> jax.Array:
    slots = jnp.asarray(slots)
    _checks.array("slots", slots, ndim=1, kind="int")
    values = _checks.concrete_ints(slots)
    if values is not None:
        bad = np.flatnonzero((values < -1) | (values >= num_slots))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"slots[{b}]={values[b]} must be -1 (idle) or in [0, {num_slots})")
        used = values[values >= 0]
        if len(set(used.tolist())) != used.size:
            raise ValueError(f"slots must not repeat a slot (two rows would race for one "
                             f"state), got {values.tolist()}")
    return slots.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentStatePool:
    """Per linear-attention layer, one delta-rule state and one conv state per slot.

    Attributes:
      conv: per layer ``[num_slots, kernel - 1, conv_dim]``, the convolution's last inputs
        (the model's compute dtype).
      state: per layer ``[num_slots, v_heads, dk, dv]`` (float32: the state integrates
        every token of the sequence).
      slots: int32 ``[batch]``, the slot of each row of the step; ``-1``: an idle row.
      lengths: int32 ``[batch]``, tokens already in each row's sequence.
    """

    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]
    slots: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, *, num_layers: int, num_slots: int, conv_kernel: int, conv_dim: int,
               v_heads: int, k_head_dim: int, v_head_dim: int, dtype: Any = jnp.float32,
               state_dtype: Any = jnp.float32, batch: int | None = None) -> RecurrentStatePool:
        """An empty pool (zeros); rows ``0 .. batch - 1`` on slots ``0 .. batch - 1``
        (``batch`` defaults to ``num_slots``, generate's one slot per row)."""
        num_layers, (num_slots, conv_kernel, conv_dim, v_heads, dk, dv), dtype = \
            _base.geometry(num_layers, dict(num_slots=num_slots, conv_kernel=conv_kernel,
                                            conv_dim=conv_dim, v_heads=v_heads,
                                            k_head_dim=k_head_dim, v_head_dim=v_head_dim), dtype)
        state_dtype = _base.float_dtype(state_dtype)
        batch = num_slots if batch is None else _checks.positive_int("batch", batch)
        slots = np.where(np.arange(batch) < num_slots, np.arange(batch), -1)
        return cls(
            conv=tuple(jnp.zeros((num_slots, conv_kernel - 1, conv_dim), dtype)
                       for _ in range(num_layers)),
            state=tuple(jnp.zeros((num_slots, v_heads, dk, dv), state_dtype)
                        for _ in range(num_layers)),
            slots=jnp.asarray(slots, jnp.int32), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def num_layers(self) -> int:
        return len(self.state)

    @property
    def num_slots(self) -> int:
        return self.state[0].shape[0]

    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every slot's states, measured from the arrays."""
        return sum(int(x.nbytes) for x in (*self.conv, *self.state))

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes one sequence holds, whatever its length."""
        return self.nbytes // self.num_slots

    def read(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """``(conv_state, state)`` of layer ``layer`` for the step's rows: ``[batch, kernel -
        1, conv_dim]`` and ``[batch, v_heads, dk, dv]``; an idle row reads zeros."""
        layer = _base.layer_index(layer, self.num_layers)
        idle = self.slots < 0
        index = jnp.maximum(self.slots, 0)

        def gather(pool):
            rows = pool[index]
            return jnp.where(idle.reshape((-1,) + (1,) * (rows.ndim - 1)), 0, rows)

        return gather(self.conv[layer]), gather(self.state[layer])

    def write_state(self, layer: int, conv_state, state) -> RecurrentStatePool:
        """Stores the rows' new states of layer ``layer`` in their slots (idle rows are
        dropped), cast to the pool's dtypes; with the pool donated under ``jit``, in place."""
        layer = _base.layer_index(layer, self.num_layers)
        for name, new, pool in (("conv_state", conv_state, self.conv[layer]),
                                ("state", state, self.state[layer])):
            _checks.array(name, new)
            want = (self.batch, *pool.shape[1:])
            if tuple(new.shape) != want:
                raise ValueError(f"{name} must be [batch, ...] = {want} for this pool, got "
                                 f"{name}.shape={tuple(new.shape)}")
        # Idle rows go out of bounds and are dropped (.at[] would wrap -1 to the last slot).
        index = jnp.where(self.slots < 0, self.num_slots, self.slots)

        def scatter(pool, new):
            return pool.at[index].set(new.astype(pool.dtype), mode="drop")

        with jax.named_scope("state_pool_write"):
            conv = _base.replace_layer(self.conv, layer, scatter(self.conv[layer], conv_state))
            st = _base.replace_layer(self.state, layer, scatter(self.state[layer], state))
        return dataclasses.replace(self, conv=conv, state=st)

    def reset(self, slots) -> RecurrentStatePool:
        """The pool with the states of ``slots`` (int ``[n]``, ``-1`` entries skipped)
        zeroed in every layer: a sequence starting in a slot starts from zero state."""
        slots = _check_slots(slots, self.num_slots)
        index = jnp.where(slots < 0, self.num_slots, slots)
        clear = lambda pool: pool.at[index].set(0, mode="drop")  # noqa: E731
        return dataclasses.replace(self, conv=tuple(map(clear, self.conv)),
                                   state=tuple(map(clear, self.state)))

    def with_slots(self, slots) -> RecurrentStatePool:
        """The pool with the step's rows mapped to ``slots`` (int ``[batch']``: ``-1`` idle,
        no slot twice); ``lengths`` becomes zeros of the new batch."""
        slots = _check_slots(slots, self.num_slots)
        return dataclasses.replace(self, slots=slots,
                                   lengths=jnp.zeros(slots.shape, jnp.int32))

    def with_lengths(self, lengths) -> RecurrentStatePool:
        """The same pool with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=_base.lengths_array("lengths", lengths,
                                                                       self.batch))

    # Row b of the step is one sequence: the layer runs its ops on the rows as they are.
    def to_sequences(self, x: jax.Array) -> jax.Array:
        """``x`` ``[batch, t, ...]`` as the layer's per-sequence ops take it: unchanged."""
        return x

    def from_sequences(self, y: jax.Array, tokens: int) -> jax.Array:
        """The inverse of :meth:`to_sequences`: ``y`` unchanged."""
        del tokens
        return y

    def sequence_lengths(self, lengths) -> jax.Array:
        """Each sequence's real tokens: the rows' ``lengths`` (int ``[batch]``)."""
        return lengths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """The cache of a model whose layers use different caches.

    Model layer ``i`` is ``kinds[i]``: an ``"attention"`` layer is layer ``index[i]`` of
    ``attention`` (a :class:`~forge_jax.kv_cache.KVCache` built over the attention layers
    only), a ``"linear"`` layer is layer ``index[i]`` of ``linear``. The model calls the
    :class:`~forge_jax.kv_cache.KVCache` members (``write``, ``attend``, ``as_stored``) on
    attention layers and the :class:`~forge_jax.kv_cache.contract.StateCache` members
    (``read``, ``write_state``) on linear ones, always with its own layer index; a member
    called on the other kind of layer raises. ``lengths`` are the attention cache's, and
    :meth:`with_lengths` sets both.

    Attributes:
      attention: the KV cache of the attention layers.
      linear: the :class:`RecurrentStatePool` of the linear layers.
      kinds: static, ``"attention"`` or ``"linear"`` per model layer.
    """

    attention: Any
    linear: RecurrentStatePool
    kinds: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))

    prefix_caching_refused = PREFIX_CACHING_REFUSED

    def __post_init__(self):
        bad = [k for k in self.kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"kinds must each be one of {LAYER_KINDS}, got {self.kinds}")
        n_att = self.kinds.count("attention")
        n_lin = self.kinds.count("linear")
        # Pytree unflattening builds the object with placeholder leaves: check sizes only
        # on real caches.
        if isinstance(self.linear, RecurrentStatePool) and self.linear.num_layers != n_lin:
            raise ValueError(f"linear holds {self.linear.num_layers} layers, kinds name {n_lin} "
                             f"linear layers: {self.kinds}")
        att_layers = getattr(self.attention, "num_layers", n_att)
        if isinstance(att_layers, int) and att_layers != n_att:
            raise ValueError(f"attention holds {att_layers} layers, kinds name {n_att} "
                             f"attention layers: {self.kinds}")

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def lengths(self) -> jax.Array:
        return self.attention.lengths

    @property
    def batch(self) -> int:
        return self.attention.batch

    @property
    def nbytes(self) -> int:
        return int(self.attention.nbytes) + self.linear.nbytes

    def _index(self, layer: int, kind: str) -> int:
        layer = _base.layer_index(layer, self.num_layers)
        if self.kinds[layer] != kind:
            raise ValueError(f"layer {layer} is of kind {self.kinds[layer]!r}, not {kind!r} "
                             f"(kinds={self.kinds})")
        return self.kinds[:layer].count(kind)

    def is_linear(self, layer: int) -> bool:
        return self.kinds[_base.layer_index(layer, self.num_layers)] == "linear"

    # KVCache, on attention layers.
    def write(self, layer: int, k, v, positions, valid) -> HybridCache:
        att = self.attention.write(self._index(layer, "attention"), k, v, positions, valid)
        return dataclasses.replace(self, attention=att)

    def attend(self, layer: int, q, **kwargs) -> jax.Array:
        return self.attention.attend(self._index(layer, "attention"), q, **kwargs)

    def as_stored(self, x) -> jax.Array:
        return self.attention.as_stored(x)

    def with_lengths(self, lengths) -> HybridCache:
        return dataclasses.replace(self, attention=self.attention.with_lengths(lengths),
                                   linear=self.linear.with_lengths(lengths))

    # StateCache, on linear layers.
    def read(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.linear.read(self._index(layer, "linear"))

    def write_state(self, layer: int, conv_state, state) -> HybridCache:
        lin = self.linear.write_state(self._index(layer, "linear"), conv_state, state)
        return dataclasses.replace(self, linear=lin)

    def to_sequences(self, x: jax.Array) -> jax.Array:
        return self.linear.to_sequences(x)

    def from_sequences(self, y: jax.Array, tokens: int) -> jax.Array:
        return self.linear.from_sequences(y, tokens)

    def sequence_lengths(self, lengths) -> jax.Array:
        return self.linear.sequence_lengths(lengths)

    # The serving engine's pool (a paged attention pool and a state pool) and its packed view.
    @property
    def max_sequences(self) -> int:
        """The sequences the state pool holds at once (one slot each): the most a serving
        engine over this pool may run together."""
        return self.linear.num_slots

    def copy_pages(self, copies) -> HybridCache:
        """The attention pool's page copies (the block manager's copy-on-write)."""
        return dataclasses.replace(self, attention=self.attention.copy_pages(copies))

    def into_pool(self, pool: HybridCache) -> HybridCache:
        """``pool`` (the engine's) holding this packed view's written pages and states."""
        return dataclasses.replace(pool, attention=self.attention.into_pool(pool.attention),
                                   linear=self.linear.into_pool(pool.linear))
