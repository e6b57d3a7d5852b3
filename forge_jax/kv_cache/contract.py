"""The KV-cache contract: what a model's ``forward_cached`` calls on its cache, written once.

A model (:meth:`forge_jax.models.llama_model.Llama.forward_cached`) threads one cache through
its layers and calls exactly these members on it, in this order per step:

1. ``cache.lengths``: int ``[batch]``, tokens already in each row's sequence; the model
   computes the step's ``kv_lengths = max(lengths, 1 + the last valid position)`` from it.
2. per layer ``cache = cache.write(layer, k, v, positions, valid)``, then either
   ``cache.attend(layer, q, q_positions=..., kv_lengths=...)`` or, for a prefill into an
   empty cache, ``cache.as_stored(k)`` / ``cache.as_stored(v)`` fed to dense attention;
3. ``cache = cache.with_lengths(kv_lengths)``.

Three caches implement it: :class:`~forge_jax.kv_cache.ContiguousKVCache` (a buffer per
row), :class:`~forge_jax.kv_cache.PagedKVCache` (a pool of pages and a block table per row),
and :class:`~forge_jax.kv_cache.RaggedBatchCache` (the serving engine's step: one packed row
holding many sequences, whose layout travels in its
:class:`~forge_jax.kv_cache.RaggedMetadata`). ``batch`` below is the cache's rows: a
sequence each for the first two, 1 for the packed row.

Which cache a model keeps is the model's choice: it creates its caches itself
(``create_cache``, ``create_pool`` and ``packed_cache`` of the model contract,
``forge_jax.models.protocol.CausalLM``), and the runtime only passes them along.

The latent caches of multi-head latent attention,
:class:`~forge_jax.kv_cache.PagedLatentCache` (and its contiguous and packed counterparts,
:class:`~forge_jax.kv_cache.ContiguousLatentCache` and
:class:`~forge_jax.kv_cache.RaggedLatentCache`), keep the contract with the one shared "KV
head" of the absorbed computation: ``write`` takes the latent as ``k`` and the RoPE key as
``v`` (one head each), and ``attend`` takes ``q = concat(q_nope, q_pe)`` and, keyword-only,
the heads' up-projections ``up_proj=(w_uk, w_uv)``, returning ``[batch, t, heads, v_dim]``
(:mod:`forge_jax.kv_cache.latent`).

:class:`KVCache` is a :class:`typing.Protocol` rather than an abstract base: the caches are
frozen dataclasses registered as pytrees, and the contract is what the model may call, not
an implementation to inherit (the shared plumbing is in ``forge_jax.kv_cache._base``); any
pytree with these members is a cache, and ``isinstance(x, KVCache)`` checks the members are
there (not their signatures: the conformance tests call each one).
"""

from __future__ import annotations

from typing import Protocol, Self, runtime_checkable

import jax


@runtime_checkable
class KVCache(Protocol):
    """A per-layer KV cache a model writes its new keys into and attends over.

    A cache is an immutable pytree: every method returns a new cache (under ``jit`` with
    the cache donated, the buffers update in place); ``layer`` is always a static Python
    int in ``[0, num_layers)``.

    Attributes:
      lengths: int32 ``[batch]``, tokens in each row's sequence before this step (what
        :meth:`with_lengths` last set); the model derives the step's ``kv_lengths`` from it.
    """

    lengths: jax.Array

    def write(self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array,
              valid: jax.Array) -> Self:
        """Stores the new keys and values of layer ``layer``.

        Token ``t`` of row ``b`` goes to position ``positions[b, t]`` of that row's
        sequence (for the packed row, of the sequence the metadata assigns the token to).
        Tokens with ``valid[b, t] == False`` (padding), a negative position, or a position
        the cache has no room for are not written. ``k`` and ``v`` are stored in the
        cache's dtype (or quantized).

        Args:
          layer: static layer index.
          k, v: ``[batch, t, kv_heads, head_dim]``, any float dtype (RoPE applied).
          positions: int ``[batch, t]``, absolute positions in the sequence.
          valid: bool ``[batch, t]``.

        Returns:
          The cache with layer ``layer`` updated; ``lengths`` unchanged.
        """
        ...

    def attend(self, layer: int, q: jax.Array, *, q_positions: jax.Array,
               kv_lengths: jax.Array, scale: float | None = None,
               sliding_window: int | None = None, logits_soft_cap: float | None = None,
               implementation: str | None = None, sinks: jax.Array | None = None,
               attention_chunk_size: int | None = None) -> jax.Array:
        """Attention of ``q`` over layer ``layer``'s cached keys and values (after
        :meth:`write`).

        Query ``t`` of row ``b`` at position ``q_positions[b, t]`` sees the keys of its
        sequence at positions ``j <= q_positions[b, t]`` and ``j < kv_lengths[b]`` (and
        within ``sliding_window`` when given). The math is float32 whatever the cache
        dtype; the result is in ``q.dtype``.

        ``q_positions`` and ``kv_lengths`` are per *row*. A packed cache
        (:class:`~forge_jax.kv_cache.RaggedBatchCache`) holds many sequences in its one
        row: there each sequence's length and query span come from its metadata
        (``kv_lengths`` and ``cu_q_lens``, built by the host from the same positions), and
        the per-row arguments are not read: the caller must pass them all the same.

        Args:
          layer: static layer index.
          q: ``[batch, t, q_heads, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
          q_positions: int ``[batch, t]``.
          kv_lengths: int ``[batch]``, valid tokens per row (the new ones included).
          scale, sliding_window, logits_soft_cap, implementation, sinks,
            attention_chunk_size: as in :func:`forge_jax.attention`.

        Returns:
          ``[batch, t, q_heads, head_dim]`` in ``q.dtype``.
        """
        ...

    def as_stored(self, x: jax.Array) -> jax.Array:
        """``x`` ``[..., head_dim]`` as the cache holds and returns it: rounded to the
        cache's dtype, or quantized and dequantized (what :meth:`attend` would read)."""
        ...

    def with_lengths(self, lengths: jax.Array) -> Self:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        ...


@runtime_checkable
class StateCache(Protocol):
    """A per-layer recurrent-state cache: what a linear-attention layer (a gated delta-rule
    layer, :func:`forge_jax.gated_delta_rule`) reads and writes instead of keys and values.

    Per step and linear layer the model calls ``conv_state, state = cache.read(layer)``,
    runs :func:`forge_jax.causal_conv1d` and :func:`forge_jax.gated_delta_rule` from those
    states, and stores what they return with ``cache = cache.write_state(layer, conv_state,
    state)``; ``lengths`` and ``with_lengths`` are as in :class:`KVCache`. The ops run per
    sequence: the layer hands them ``cache.to_sequences(x)`` with
    ``cache.sequence_lengths(lengths)`` and maps their outputs back with
    ``cache.from_sequences(y, t)`` (the identity where row ``b`` is a sequence; a gather
    into one row per sequence for the packed row of the serving engine). Implemented by
    :class:`~forge_jax.kv_cache.RecurrentStatePool` (one slot per sequence), its packed view
    :class:`~forge_jax.kv_cache.RaggedStatePool` and, for the linear layers of a hybrid
    model, :class:`~forge_jax.kv_cache.HybridCache`.

    Attributes:
      lengths: int32 ``[batch]``, tokens in each row's sequence before this step.
    """

    lengths: jax.Array

    def read(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """``(conv_state [seqs, kernel - 1, conv_dim], state [seqs, v_heads, dk, dv])`` of
        layer ``layer`` for the step's sequences (zeros for one with no state yet)."""
        ...

    def write_state(self, layer: int, conv_state: jax.Array, state: jax.Array) -> Self:
        """The cache with layer ``layer``'s states of the step's sequences replaced."""
        ...

    def to_sequences(self, x: jax.Array) -> jax.Array:
        """The step's tokens ``x`` ``[batch, t, ...]`` as one row per sequence ``[seqs,
        span, ...]`` (right-padded), what :meth:`read`'s states go with."""
        ...

    def from_sequences(self, y: jax.Array, tokens: int) -> jax.Array:
        """Per-sequence outputs ``y`` ``[seqs, span, ...]`` back in the step's rows
        ``[batch, tokens, ...]``."""
        ...

    def sequence_lengths(self, lengths: jax.Array) -> jax.Array:
        """int ``[seqs]``, the real tokens of each sequence of :meth:`to_sequences`, from the
        rows' ``lengths`` (int ``[batch]``)."""
        ...

    def with_lengths(self, lengths: jax.Array) -> Self:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        ...
