"""The model contract: what the runtime (generation, chat, the serving engine) calls on a model.

The runtime is written once against :class:`CausalLM`; a family plugs in by implementing it,
never by an ``isinstance`` branch in the runtime. :class:`~forge_jax.models.llama_model.Llama`
(the Llama family and every family :mod:`forge_jax.models.families` maps onto it) and
:class:`~forge_jax.models.deepseek.DeepseekV3` (multi-head latent attention over a latent
cache) implement it.

A model is a Flax NNX module: the runtime splits it with ``nnx.split`` outside its jitted
steps and merges it inside (the weights are arguments of the compiled programs, never
constants), so a model's static attributes (its config, its dtypes) must be hashable. Per
step the runtime calls, in this order:

1. ``cache = model.create_cache(spec, batch=..., max_len=..., ...)`` once, outside the steps
   (or ``model.create_pool(spec, ...)`` for the serving engine's packed steps);
2. inside a jitted step, ``logits, cache = model.forward_cached(tokens, positions, valid,
   cache, logits_at=..., empty_cache=...)``; the cache is one the model created, or
   ``model.packed_cache(pool, metadata)`` for the engine's one packed row, whose written
   pages go back with ``packed.into_pool(pool)``;
3. on a mesh (``model.mesh`` not None), ``model.cache_shardings(cache)`` to keep the cache
   in its shards across steps.

Which kind of cache a model keeps is its own affair (a K/V cache per head, a latent cache,
a recurrent state): every cache it creates implements
:class:`forge_jax.kv_cache.KVCache` (or :class:`~forge_jax.kv_cache.StateCache` for a
linear-attention layer), and the runtime only passes it along, reads ``cache.lengths`` and
``cache.nbytes``, and applies the host's page copies with ``cache.copy_pages`` (the paged
kinds). Page ids come from a :class:`~forge_jax.kv_cache.BlockManager` whatever the pool
holds, so prefix caching works on any paged cache (a model whose cache cannot share pages
says so by raising from :meth:`CausalLM.create_pool` when asked for ``prefix_caching``:
see :data:`forge_jax.kv_cache.PREFIX_CACHING_REFUSED`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from forge_jax.kv_cache import CacheSpec, KVCache, RaggedMetadata


@runtime_checkable
class ModelConfig(Protocol):
    """The config fields the runtime reads (Hugging Face's names).

    Attributes:
      vocab_size: rows of the output logits; prompts' ids must lie in ``[0, vocab_size)``.
      num_hidden_layers: the layers (each cache holds this many).
      max_position_embeddings: the context the model was trained for; generation refuses
        to go past it unless told the RoPE scaling extends it.
      eos_token_ids: ``config.json``'s eos ids (a tuple, possibly empty), what generation
        stops at when ``generation_config.json`` names none.
    """

    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as the runtime drives it.

    Attributes:
      config: a :class:`ModelConfig` (and whatever else the family needs).
      dtype: the compute dtype of the activations (a cache's default dtype).
      param_dtype: the storage dtype of the weights.
      mesh: the :class:`forge_jax.sharding.MeshConfig` the model is sharded over, or None
        on one device.
      generation_config: the checkpoint's
        :class:`~forge_jax.models.checkpoints.generation_config.GenerationConfig`, or None.
    """

    config: ModelConfig
    dtype: Any
    param_dtype: Any
    mesh: Any
    generation_config: Any

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                       cache: KVCache, *, logits_at: jax.Array | None = None,
                       empty_cache: bool = False) -> tuple[jax.Array, KVCache]:
        """Forward over new tokens that attend to themselves and to ``cache``.

        Args:
          tokens: int32 ``[batch, t]``.
          positions: int32 ``[batch, t]``, absolute positions continuing each row's cache.
          valid: bool ``[batch, t]``; False marks padding (never written).
          cache: a cache this model created (or its packed view).
          logits_at: None (logits at every token), int32 ``[batch]`` (one index of the
            ``t`` axis per row) or ``[batch, n]`` (``n`` per row: the packed row's
            sequences' last tokens).
          empty_cache: static; True promises the cache holds no token yet and each row's
            valid tokens come first from position 0 (generate's prefill), so the tokens
            may attend to themselves alone.

        Returns:
          ``(logits, cache)``: float32 ``[batch, t, vocab]`` (``[batch, vocab]`` or
          ``[batch, n, vocab]`` with ``logits_at``), and the cache with the tokens written
          and ``lengths[b] = max(old, 1 + the last valid position of row b)``.
        """
        ...

    def create_cache(self, spec: CacheSpec, *, batch: int, max_len: int,
                     num_pages: int | None = None, block_tables=None) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` tokens each, of
        ``spec.kind``: ``"paged"``, a pool of ``num_pages`` pages of ``spec.page_size``
        tokens with ``block_tables`` (int ``[batch, max_pages]``) naming each row's;
        ``"contiguous"``, a buffer per row (``num_pages`` and ``block_tables`` unused). In
        ``spec.resolved_dtype(self.dtype)``; on ``self.mesh``, created in its shards.
        Raises ValueError naming the spec's field a model cannot honour (a kind it has no
        cache of, a quantized format it does not store)."""
        ...

    def create_pool(self, spec: CacheSpec, *, num_pages: int, pages_per_seq: int,
                    prefix_caching: bool = False, max_seqs: int | None = None) -> Any:
        """The serving engine's page pool (``spec.kind`` must be ``"paged"``): ``num_pages``
        pages, no rows of its own (each packed step brings its block tables, at most
        ``pages_per_seq`` wide), never folded; on ``self.mesh``, created in its shards.
        It has ``copy_pages`` (the block manager's copy-on-write). ``prefix_caching``: the
        engine will share full pages between sequences; a model whose cache cannot (a
        recurrent state per sequence) raises ValueError with the reason
        (:data:`forge_jax.kv_cache.PREFIX_CACHING_REFUSED`). ``max_seqs``: the most sequences
        the engine runs at once; a model keeping a state per sequence holds that many slots
        and says so in the pool's ``max_sequences`` (the engine then admits no more, and
        each packed step's metadata carries every sequence's ``state_slots``), the others
        ignore it."""
        ...

    def packed_cache(self, pool: Any, metadata: RaggedMetadata) -> KVCache:
        """``pool`` (from :meth:`create_pool`) seen as one packed row of many sequences laid
        out by ``metadata``: a cache with ``batch == 1`` that :meth:`forward_cached` writes
        and attends, and whose ``into_pool(pool)`` returns the pool with its pages."""
        ...

    def cache_shardings(self, cache: Any) -> Any:
        """On a mesh: the cache's pytree with a ``NamedSharding`` per buffer (what the steps
        constrain the returned cache to, so the next step takes it donated)."""
        ...

    def cache_bytes(self, spec: CacheSpec, *, batch: int, max_len: int,
                    num_pages: int | None = None) -> int:
        """Bytes on one device of the cache :meth:`create_cache` would make with these
        arguments (its share on a mesh; a quantized cache's scales included): the runtime's
        memory check before it creates one."""
        ...
