"""KV caches for decoding: one contract, three caches, and the host-side block manager.

Device side, pytrees implementing one contract, :class:`KVCache`
(:mod:`forge_jax.kv_cache.contract`: ``lengths``, ``write``, ``attend``, ``as_stored``,
``with_lengths``), so a model is written once:

* :class:`ContiguousKVCache`: one ``[batch, max_len, kv_heads, head_dim]`` buffer per
  layer for K and for V; the simple choice for a fixed batch (a notebook, a benchmark).
* :class:`PagedKVCache`: per layer one pool of pages ``[kv_heads, num_pages, page_size,
  head_dim]`` shared by all sequences, plus ``block_tables`` naming each sequence's
  pages; the choice of a server with many sequences of different lengths. Whether its
  pools are stored folded is :func:`stores_folded`'s decision, from its spec and the platform.
* :class:`RaggedBatchCache`: a paged cache's pools seen through one packed row of many
  sequences, laid out by a :class:`RaggedMetadata` (the serving engine's step).
* :class:`PagedLatentCache`: multi-head latent attention's cache (DeepSeek-V3): per layer
  one pool of pages ``[num_pages, page_size, kv_lora_rank + rope_dim]`` of latents shared
  by every head (:mod:`forge_jax.kv_cache.latent`), on the same block tables and
  :class:`BlockManager` as a K/V pool; :class:`ContiguousLatentCache` keeps one
  ``[batch, max_len, width]`` latent buffer per layer instead, and
  :class:`RaggedLatentCache` is a latent pool's packed view (the serving engine's step).

Linear-attention layers keep a fixed-size state per sequence instead: a
:class:`RecurrentStatePool` (one slot per sequence, the :class:`StateCache` contract), and a
model mixing both kinds of layers gets a :class:`HybridCache` (a KV cache over its attention
layers, a pool over its linear ones; prefix caching refused, :data:`PREFIX_CACHING_REFUSED`);
:class:`RaggedStatePool` is a state pool's packed view (the serving engine's step).

Both may be quantized (``create(..., quantize="int8")`` or ``"fp8"``): each layer's K and V
are then int8/fp8 ``QuantizedArray`` buffers with a float32 scale per token and KV head
(:mod:`forge_jax.ops.kv_quant`), quantized as they are written and dequantized as attention
reads them; ``cache.nbytes`` counts their bytes, scales included.

Both keep one array per layer in a tuple rather than one stacked ``[layers, ...]``
array: indexing a stacked array inside ``jit`` made XLA copy the whole stack per step
in a measurement on CPU. Both are registered pytrees,
meant to be returned from the jitted step function and donated
(``donate_argnames=("cache",)``), so that writes update the buffers in place.

Host side, :class:`BlockManager` decides which pages each sequence owns, in plain
Python/NumPy: allocation, appends, prefix sharing by :meth:`BlockManager.fork` with
copy-on-write, and freeing. A decode loop with a paged cache (one layer shown)::

    manager = BlockManager(num_pages=256, page_size=16)
    cache = PagedKVCache.create(num_layers=1, num_pages=256, page_size=16, kv_heads=8,
                                head_dim=128, dtype=jnp.bfloat16,
                                block_tables=np.zeros((batch, max_pages), np.int32))

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def step(cache, q, k, v, positions, valid, lengths):
        cache = cache.write(0, k, v, positions, valid)      # padding (valid=False) skipped
        return cache, cache.attend(0, q, q_positions=positions, kv_lengths=lengths)

    for seq, n in enumerate(prompt_lengths):
        manager.allocate(seq, n)
    cache = cache.with_block_tables(manager.block_tables(range(batch), max_pages))
    cache, out = step(cache, q, k, v, positions, valid, lengths)   # prefill
    while decoding:
        for seq in range(batch):
            manager.append(seq)                              # room for one more token
        cache = cache.copy_pages(manager.take_pending_copies())   # copy-on-write first
        cache = cache.with_block_tables(manager.block_tables(range(batch), max_pages))
        cache, out = step(cache, q1, k1, v1, lengths[:, None], ones, lengths + 1)
        lengths = lengths + 1
    for seq in range(batch):
        manager.free(seq)
"""

from forge_jax.kv_cache.block_manager import BlockManager, CacheFullError, CacheUsage
from forge_jax.kv_cache.contiguous import ContiguousKVCache
from forge_jax.kv_cache.contract import KVCache, StateCache
from forge_jax.kv_cache.latent import PagedLatentCache
from forge_jax.kv_cache.latent_contiguous import ContiguousLatentCache
from forge_jax.kv_cache.latent_ragged import RaggedLatentCache
from forge_jax.kv_cache.paged import PagedKVCache, stores_folded
from forge_jax.kv_cache.ragged import RaggedBatchCache, RaggedMetadata
from forge_jax.kv_cache.recurrent import PREFIX_CACHING_REFUSED, HybridCache, RecurrentStatePool
from forge_jax.kv_cache.recurrent_ragged import RaggedStatePool
from forge_jax.kv_cache.spec import CacheSpec, cache_geometry

__all__ = [
    "BlockManager", "CacheFullError", "CacheSpec", "CacheUsage", "ContiguousKVCache", "KVCache",
    "PagedKVCache", "PagedLatentCache", "RaggedBatchCache", "RaggedMetadata", "stores_folded",
    "HybridCache", "PREFIX_CACHING_REFUSED", "RecurrentStatePool", "StateCache",
    "ContiguousLatentCache", "RaggedLatentCache",
    "RaggedStatePool",
    "cache_geometry",
]
