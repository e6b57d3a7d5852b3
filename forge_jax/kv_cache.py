"""KV caches for decoding: a contiguous cache, a paged cache, and the host-side block manager.

Device side, two pytrees with the same interface, so a model is written once
(``cache.write(layer, ...)``, ``cache.attend(layer, ...)``, ``cache.with_lengths(...)``):

* :class:`ContiguousKVCache`: one ``[batch, max_len, kv_heads, head_dim]`` buffer per
  layer for K and for V; the simple choice for a fixed batch (a notebook, a benchmark).
* :class:`PagedKVCache`: per layer one pool of pages ``[kv_heads, num_pages, page_size,
  head_dim]`` shared by all sequences, plus ``block_tables`` naming each sequence's
  pages; the choice of a server with many sequences of different lengths.

Both keep one array per layer in a tuple rather than one stacked ``[layers, ...]``
array: indexing a stacked array inside ``jit`` made XLA copy the whole stack per step
in a measurement on CPU (see the KV-cache design issue). Both are registered pytrees,
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

from __future__ import annotations

import dataclasses
import heapq
import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, sharding
from forge_jax.ops.attention import attention
from forge_jax.ops.paged import copy_pages, paged_attention, paged_write

__all__ = [
    "BlockManager", "CacheFullError", "CacheUsage", "ContiguousKVCache", "PagedKVCache",
]


# ---------------------------------------------------------------------------------------
# Shared validation


def _layer_index(layer: Any, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer must be a Python int (static), got {layer=!r}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer=}")
    return int(layer)


def _check_write(k, v, positions, valid, *, batch, kv_heads, head_dim):
    _checks.array("k", k, ndim=4)
    _checks.array("v", v, ndim=4)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape: {k.shape=}, {v.shape=}")
    if k.shape[0] != batch or tuple(k.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(
            f"k must be [batch, t, kv_heads, head_dim] = [{batch}, t, {kv_heads}, {head_dim}] "
            f"for this cache, got {k.shape=}")
    bt = tuple(k.shape[:2])
    _checks.array("positions", positions, ndim=2, kind="int")
    _checks.array("valid", valid, ndim=2, kind="bool")
    if tuple(positions.shape) != bt:
        raise ValueError(f"positions must be [batch, t] = {bt}, got {positions.shape=}")
    if tuple(valid.shape) != bt:
        raise ValueError(f"valid must be [batch, t] = {bt}, got {valid.shape=}")


def _lengths(name: str, lengths: Any, batch: int) -> jax.Array:
    lengths = jnp.asarray(lengths)
    _checks.array(name, lengths, ndim=1, kind="int")
    if lengths.shape[0] != batch:
        raise ValueError(f"{name} must be [batch] = ({batch},), got {name}.shape="
                         f"{tuple(lengths.shape)}")
    return lengths.astype(jnp.int32)


def _float_dtype(dtype: Any) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype=}")
    return dtype


def _replace_layer(arrays: tuple, layer: int, new: jax.Array) -> tuple:
    return arrays[:layer] + (new,) + arrays[layer + 1:]


# ---------------------------------------------------------------------------------------
# ContiguousKVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousKVCache:
    """One K and one V buffer per layer and sequence: ``[batch, max_len, kv_heads, head_dim]``.

    Token ``i`` of sequence ``b`` lives at ``k[layer][b, i]``. ``lengths`` is carried
    for the caller (tokens in the cache per sequence); :meth:`write` does not change
    it, :meth:`with_lengths` does.

    Attributes:
      k, v: tuples (one entry per layer) of ``[batch, max_len, kv_heads, head_dim]``.
      lengths: int32 ``[batch]``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def create(cls, *, num_layers: int, batch: int, max_len: int, kv_heads: int,
               head_dim: int, dtype: Any = jnp.float32) -> ContiguousKVCache:
        """An empty cache (zeros, ``lengths == 0``) of the given geometry and dtype."""
        shape = tuple(_checks.positive_int(name, value) for name, value in (
            ("batch", batch), ("max_len", max_len), ("kv_heads", kv_heads),
            ("head_dim", head_dim)))
        num_layers = _checks.positive_int("num_layers", num_layers)
        dtype = _float_dtype(dtype)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k=k, v=v, lengths=jnp.zeros((shape[0],), jnp.int32))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k[0].dtype

    def write(self, layer: int, k, v, positions, valid) -> ContiguousKVCache:
        """Stores ``k[b, t]`` and ``v[b, t]`` at position ``positions[b, t]`` of layer ``layer``.

        Tokens with ``valid[b, t] == False`` (padding), a negative position, or a
        position ``>= max_len`` are not written. ``k`` and ``v`` are cast to the cache
        dtype. With the cache donated under ``jit`` the update is in place.

        Args:
          layer: static layer index.
          k, v: ``[batch, t, kv_heads, head_dim]``, any float dtype.
          positions: int ``[batch, t]``, absolute positions in the sequence.
          valid: bool ``[batch, t]``.

        Returns:
          The cache with layer ``layer`` updated; ``lengths`` unchanged.
        """
        layer = _layer_index(layer, self.num_layers)
        _check_write(k, v, positions, valid, batch=self.batch, kv_heads=self.kv_heads,
                     head_dim=self.head_dim)
        k, v, positions, valid = map(jnp.asarray, (k, v, positions, valid))
        positions = positions.astype(jnp.int32)
        # Skipped tokens go out of bounds and are dropped (.at[] would wrap negatives).
        keep = valid & (positions >= 0)
        positions = jnp.where(keep, positions, self.max_len)

        def scatter(buffer, new, positions):  # per shard on a mesh (forge_jax.sharding)
            rows = jnp.broadcast_to(jnp.arange(buffer.shape[0], dtype=jnp.int32)[:, None],
                                    positions.shape)
            return buffer.at[rows, positions].set(new.astype(buffer.dtype), mode="drop")

        with jax.named_scope("kv_cache_write"):
            new_k, new_v = (
                sharding.per_shard(_write_partition, scatter, dict(
                    buffer=jnp.asarray(buffer), new=new, positions=positions))()
                for buffer, new in ((self.k[layer], k), (self.v[layer], v)))
        return dataclasses.replace(self, k=_replace_layer(self.k, layer, new_k),
                                   v=_replace_layer(self.v, layer, new_v))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None):
        """:func:`forge_jax.attention` of ``q`` over layer ``layer``'s keys and values.

        Causal with explicit positions: query ``t`` of sequence ``b`` at position
        ``q_positions[b, t]`` sees keys ``j <= q_positions[b, t]`` with
        ``j < kv_lengths[b]`` (and within ``sliding_window`` when given). A cache
        stored in another dtype than ``q`` is promoted for the math (e.g. bfloat16 cache,
        float32 queries); the result is in ``q.dtype``.

        Args:
          layer: static layer index.
          q: ``[batch, t, q_heads, head_dim]``.
          q_positions: int ``[batch, t]``.
          kv_lengths: int ``[batch]``, valid tokens per sequence (the new ones included).
          scale, sliding_window, logits_soft_cap, implementation: as in ``fj.attention``.

        Returns:
          ``[batch, t, q_heads, head_dim]`` in ``q.dtype``.
        """
        layer = _layer_index(layer, self.num_layers)
        _checks.array("q", q, ndim=4)
        # fj.attention reads a cache of another dtype as is (float32 math, q.dtype out):
        # no cast of the whole cache per step.
        return attention(q, self.k[layer], self.v[layer], scale=scale,
                         q_positions=q_positions, kv_lengths=kv_lengths,
                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                         implementation=implementation)

    def with_lengths(self, lengths) -> ContiguousKVCache:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=_lengths("lengths", lengths, self.batch))


# ---------------------------------------------------------------------------------------
# PagedKVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per layer one pool of pages shared by all sequences, and a block table per sequence.

    Token ``i`` of sequence ``b`` lives in page ``block_tables[b, i // page_size]`` at
    offset ``i % page_size``: ``k_pages[layer][:, page, offset]``. Which pages a
    sequence owns is decided by :class:`BlockManager`; pass its
    ``block_tables(seq_ids, max_pages)`` to :meth:`with_block_tables`.

    Attributes:
      k_pages, v_pages: tuples (one entry per layer) of
        ``[kv_heads, num_pages, page_size, head_dim]``.
      block_tables: int32 ``[batch, max_pages]``.
      lengths: int32 ``[batch]``, carried for the caller (see :meth:`with_lengths`).
      page_size: static.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, *, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
               head_dim: int, dtype: Any = jnp.float32, block_tables,
               lengths=None) -> PagedKVCache:
        """An empty pool (zeros) with the given block tables (int ``[batch, max_pages]``).

        ``lengths`` (int ``[batch]``) defaults to zeros.
        """
        shape = tuple(_checks.positive_int(name, value) for name, value in (
            ("kv_heads", kv_heads), ("num_pages", num_pages), ("page_size", page_size),
            ("head_dim", head_dim)))
        num_layers = _checks.positive_int("num_layers", num_layers)
        dtype = _float_dtype(dtype)
        block_tables = _block_tables(block_tables)
        batch = block_tables.shape[0]
        lengths = (jnp.zeros((batch,), jnp.int32) if lengths is None
                   else _lengths("lengths", lengths, batch))
        k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k_pages=k, v_pages=v, block_tables=block_tables, lengths=lengths,
                   page_size=shape[2])

    @property
    def num_layers(self) -> int:
        return len(self.k_pages)

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_pages[0].shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k_pages[0].dtype

    def slots(self, positions, valid) -> jax.Array:
        """int32 ``[batch, t]``: the slot of each token, ``-1`` where it is not to be written.

        A token is skipped when ``valid`` is False, its position is negative, or it lies
        beyond the block table (``position >= max_pages * page_size``).
        """
        positions = jnp.asarray(positions, jnp.int32)
        index = positions // self.page_size  # [batch, t] index into the block table
        keep = valid & (positions >= 0) & (index < self.max_pages)
        page = jnp.take_along_axis(jnp.asarray(self.block_tables, jnp.int32),
                                   jnp.clip(index, 0, self.max_pages - 1), axis=1)
        return jnp.where(keep, page * self.page_size + positions % self.page_size, -1)

    def write(self, layer: int, k, v, positions, valid) -> PagedKVCache:
        """Stores ``k[b, t]``, ``v[b, t]`` at position ``positions[b, t]`` of sequence ``b``.

        The slot comes from the block table; invalid (padding) tokens, negative positions
        and positions beyond the block table are skipped. ``k`` and ``v`` are cast to the
        cache dtype. Goes through :func:`forge_jax.paged_write`: in place when donated.

        Args:
          layer: static layer index.
          k, v: ``[batch, t, kv_heads, head_dim]``, any float dtype.
          positions: int ``[batch, t]``, absolute positions in the sequence.
          valid: bool ``[batch, t]``.

        Returns:
          The cache with layer ``layer`` updated; ``lengths`` unchanged.
        """
        layer = _layer_index(layer, self.num_layers)
        _check_write(k, v, positions, valid, batch=self.batch, kv_heads=self.kv_heads,
                     head_dim=self.head_dim)
        batch, t = k.shape[:2]
        with jax.named_scope("kv_cache_write"):
            slots = self.slots(positions, valid).reshape(batch * t)
            new_k, new_v = paged_write(
                self.k_pages[layer], self.v_pages[layer],
                k.reshape(batch * t, self.kv_heads, self.head_dim),
                v.reshape(batch * t, self.kv_heads, self.head_dim), slots)
        return dataclasses.replace(self, k_pages=_replace_layer(self.k_pages, layer, new_k),
                                   v_pages=_replace_layer(self.v_pages, layer, new_v))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None):
        """:func:`forge_jax.paged_attention` of ``q`` over layer ``layer``'s pages.

        Same semantics as :meth:`ContiguousKVCache.attend`: query ``t`` of sequence
        ``b`` at ``q_positions[b, t]`` sees keys ``j <= q_positions[b, t]``,
        ``j < kv_lengths[b]``. The math is float32 whatever the cache dtype; the result
        is in ``q.dtype``.

        Args:
          layer: static layer index.
          q: ``[batch, t, q_heads, head_dim]``.
          q_positions: int ``[batch, t]``.
          kv_lengths: int ``[batch]``, valid tokens per sequence (the new ones included).
          scale, sliding_window, logits_soft_cap, implementation: as in
            ``fj.paged_attention``.

        Returns:
          ``[batch, t, q_heads, head_dim]`` in ``q.dtype``.
        """
        layer = _layer_index(layer, self.num_layers)
        return paged_attention(q, self.k_pages[layer], self.v_pages[layer], self.block_tables,
                               kv_lengths, scale=scale, q_positions=q_positions,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               implementation=implementation)

    def with_lengths(self, lengths) -> PagedKVCache:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=_lengths("lengths", lengths, self.batch))

    def with_block_tables(self, block_tables) -> PagedKVCache:
        """The same cache with ``block_tables`` (int ``[batch, max_pages]``) replaced.

        The batch may change (e.g. after sequences finish); then pass matching
        ``lengths`` with :meth:`with_lengths` (lengths are kept only when the batch is).
        """
        block_tables = _block_tables(block_tables)
        lengths = self.lengths
        if block_tables.shape[0] != lengths.shape[0]:
            lengths = jnp.zeros((block_tables.shape[0],), jnp.int32)
        return dataclasses.replace(self, block_tables=block_tables, lengths=lengths)

    def copy_pages(self, copies) -> PagedKVCache:
        """Applies page copies (int ``[n, 2]`` rows ``(src, dst)``, e.g.
        :meth:`BlockManager.take_pending_copies`) to every layer; negative ``src`` rows
        are skipped. Apply them before writing the slots handed out with them."""
        copies = jnp.asarray(copies, jnp.int32).reshape(-1, 2)
        if copies.shape[0] == 0:
            return self
        pairs = [copy_pages(k, v, copies) for k, v in zip(self.k_pages, self.v_pages,
                                                          strict=True)]
        return dataclasses.replace(self, k_pages=tuple(k for k, _ in pairs),
                                   v_pages=tuple(v for _, v in pairs))


def _block_tables(block_tables) -> jax.Array:
    block_tables = jnp.asarray(block_tables)
    _checks.array("block_tables", block_tables, ndim=2, kind="int")
    return block_tables.astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# BlockManager


class CacheFullError(RuntimeError):
    """Not enough free pages for a request; the manager is left exactly as it was.

    Attributes:
      requested_pages: pages the request needed.
      free_pages: pages that were free.
    """

    def __init__(self, message: str, *, requested_pages: int, free_pages: int):
        super().__init__(message)
        self.requested_pages = requested_pages
        self.free_pages = free_pages


@dataclasses.dataclass(frozen=True)
class CacheUsage:
    """A snapshot of a :class:`BlockManager`.

    Attributes:
      used_pages: distinct pages in use (a page shared by several sequences counts once;
        a page kept alive only as the source of a pending copy counts too).
      free_pages: pages available for allocation.
      total_pages: ``used_pages + free_pages``.
      num_sequences: sequences allocated.
      num_tokens: tokens over all sequences (a shared prefix counts once per sequence).
    """

    used_pages: int
    free_pages: int
    total_pages: int
    num_sequences: int
    num_tokens: int


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")
    return int(value)


class BlockManager:
    """Host-side page bookkeeping for a :class:`PagedKVCache` (no device work).

    Each sequence owns an ordered list of pages (its block table); token ``i`` goes to
    slot ``pages[i // page_size] * page_size + i % page_size``. Pages are reference
    counted: :meth:`fork` makes a new sequence that shares all of its source's pages
    (prefix sharing for parallel sampling or beam search). The first append into a
    shared, partly filled last page gives the appending sequence a fresh page and
    records a copy ``(src, dst)`` to be done on the device (copy-on-write); full shared
    pages are never written again, so they stay shared.

    Device protocol: after :meth:`allocate` / :meth:`append`, apply
    :meth:`take_pending_copies` with :func:`forge_jax.copy_pages` (or
    :meth:`PagedKVCache.copy_pages`) *before* writing the returned slots, and write a
    sequence's tokens before forking it. A pending copy's source page stays reserved
    until the copies are taken, so freeing a sequence cannot recycle it first; a
    pending copy whose destination is freed before it is taken is dropped.

    Every method either succeeds or raises leaving the manager unchanged:
    :class:`CacheFullError` when pages run out, ``KeyError`` for unknown sequence ids
    (including double frees), ``ValueError`` for duplicate ids and negative counts.

    Args:
      num_pages: pages in the pool (``num_pages`` of the cache).
      page_size: tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = _checks.positive_int("num_pages", num_pages)
        self.page_size = _checks.positive_int("page_size", page_size)
        self._free = list(range(self.num_pages))  # a heap: lowest page first
        self._refs = [0] * self.num_pages  # owners + pending-copy reservations
        self._reserved: dict[int, int] = {}  # page -> pending copies reading it
        self._seqs: dict[Hashable, _Sequence] = {}
        self._pending: dict[int, int] = {}  # dst -> src, in insertion order

    # -- queries --------------------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The allocated sequences, in allocation order."""
        return tuple(self._seqs)

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens of sequence ``seq_id``."""
        return self._get(seq_id).length

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        """np.int32 ``[pages]``: the pages of ``seq_id`` in order."""
        return np.asarray(self._get(seq_id).pages, np.int32)

    def block_tables(self, seq_ids: Sequence[Hashable], max_pages: int | None = None, *,
                     pad: int = 0) -> np.ndarray:
        """np.int32 ``[len(seq_ids), max_pages]``: block tables, padded with ``pad``.

        ``max_pages`` defaults to the longest table. The padding is never read by the
        paged ops (they stop at each sequence's length), so any page index will do.
        """
        seqs = [self._get(s) for s in seq_ids]
        longest = max((len(s.pages) for s in seqs), default=0)
        if max_pages is None:
            max_pages = longest
        max_pages = _count("max_pages", max_pages)
        if longest > max_pages:
            raise ValueError(f"a sequence has {longest} pages, more than {max_pages=}")
        table = np.full((len(seqs), max_pages), pad, np.int32)
        for row, seq in zip(table, seqs, strict=True):
            row[:len(seq.pages)] = seq.pages
        return table

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> np.ndarray:
        """np.int32: the slots of tokens ``start .. stop - 1`` of ``seq_id`` (default all)."""
        seq = self._get(seq_id)
        stop = seq.length if stop is None else stop
        if not 0 <= start <= stop <= seq.length:
            raise ValueError(f"need 0 <= {start=} <= {stop=} <= seq_len={seq.length}")
        return self._slots(seq, start, stop)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` tokens would fit now."""
        return self._pages_for(_count("num_tokens", num_tokens)) <= len(self._free)

    def usage(self) -> CacheUsage:
        used = self.num_pages - len(self._free)
        return CacheUsage(used_pages=used, free_pages=len(self._free),
                          total_pages=self.num_pages, num_sequences=len(self._seqs),
                          num_tokens=sum(s.length for s in self._seqs.values()))

    def pending_copies(self) -> np.ndarray:
        """np.int32 ``[n, 2]``: page copies ``(src, dst)`` not yet taken (not cleared)."""
        rows = [(src, dst) for dst, src in self._pending.items()]
        return np.asarray(rows, np.int32).reshape(-1, 2)

    def take_pending_copies(self) -> np.ndarray:
        """Like :meth:`pending_copies`, and clears them, releasing their source pages."""
        copies = self.pending_copies()
        pending, self._pending = self._pending, {}
        for src in pending.values():
            self._reserved[src] -= 1
            if not self._reserved[src]:
                del self._reserved[src]
            self._release(src)
        return copies

    # -- mutations ------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> np.ndarray:
        """Creates sequence ``seq_id`` with ``num_tokens`` tokens (e.g. its prompt).

        Returns:
          np.int32 ``[num_tokens]``: the slots of those tokens, for ``paged_write``.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        num_tokens = _count("num_tokens", num_tokens)
        need = self._pages_for(num_tokens)
        self._ensure(need, f"allocate {num_tokens} tokens for sequence {seq_id!r}")
        seq = _Sequence(pages=[self._take() for _ in range(need)], length=num_tokens)
        self._seqs[seq_id] = seq
        return self._slots(seq, 0, num_tokens)

    def append(self, seq_id: Hashable, num_tokens: int = 1) -> np.ndarray:
        """Extends ``seq_id`` by ``num_tokens`` tokens.

        May record a copy-on-write (see :meth:`pending_copies`) when the last page is
        shared and partly filled.

        Returns:
          np.int32 ``[num_tokens]``: the slots of the new tokens, for ``paged_write``.
        """
        seq = self._get(seq_id)
        num_tokens = _count("num_tokens", num_tokens)
        old = seq.length
        if num_tokens == 0:
            return np.zeros((0,), np.int32)
        cow = old % self.page_size != 0 and self._owners(seq.pages[-1]) > 1
        need = int(cow) + self._pages_for(old + num_tokens) - len(seq.pages)
        self._ensure(need, f"append {num_tokens} tokens to sequence {seq_id!r} "
                           f"(length {old}{', copy-on-write of its last page' if cow else ''})")
        if cow:
            seq.pages[-1] = self._copy_on_write(seq.pages[-1])
        seq.pages.extend(self._take() for _ in range(need - int(cow)))
        seq.length = old + num_tokens
        return self._slots(seq, old, seq.length)

    def fork(self, src_seq_id: Hashable, new_seq_id: Hashable) -> None:
        """Creates ``new_seq_id`` sharing all pages (and the length) of ``src_seq_id``."""
        src = self._get(src_seq_id)
        if new_seq_id in self._seqs:
            raise ValueError(f"sequence {new_seq_id!r} is already allocated")
        for page in src.pages:
            self._refs[page] += 1
        self._seqs[new_seq_id] = _Sequence(pages=list(src.pages), length=src.length)

    def free(self, seq_id: Hashable) -> None:
        """Removes ``seq_id``; its pages return to the pool once no one else holds them."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for page in seq.pages:
            self._release(page)

    # -- internals ------------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated or already freed); "
                           f"{len(self._seqs)} sequences allocated") from None

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _slots(self, seq: _Sequence, start: int, stop: int) -> np.ndarray:
        i = np.arange(start, stop)
        pages = np.asarray(seq.pages, np.int64).reshape(-1)
        return (pages[i // self.page_size] * self.page_size + i % self.page_size).astype(np.int32)

    def _ensure(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise CacheFullError(
                f"cannot {what}: needs {need} free pages, {len(self._free)} free "
                f"of {self.num_pages} (page_size {self.page_size})",
                requested_pages=need, free_pages=len(self._free))

    def _owners(self, page: int) -> int:
        return self._refs[page] - self._reserved.get(page, 0)

    def _take(self) -> int:
        page = heapq.heappop(self._free)
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page]:
            return
        heapq.heappush(self._free, page)
        # A pending copy into a page nobody holds any more must not land on its next owner.
        src = self._pending.pop(page, None)
        if src is not None:
            self._reserved[src] -= 1
            if not self._reserved[src]:
                del self._reserved[src]
            self._release(src)

    def _copy_on_write(self, page: int) -> int:
        """A fresh page for the caller's share of ``page``, and the pending copy into it."""
        new = self._take()
        # The caller's reference becomes the reservation of the copy's source. If ``page``
        # is itself the destination of a pending copy it holds nothing yet: copy from its
        # source instead, so that copies in one batch never read each other's output.
        src = self._pending.get(page, page)
        if src != page:
            self._refs[page] -= 1  # others still own it: it was shared
            self._refs[src] += 1
        self._reserved[src] = self._reserved.get(src, 0) + 1
        self._pending[new] = src
        return new


def _write_partition(args, config):
    # ContiguousKVCache.write: each data shard writes its own rows, each tensor shard its
    # own heads; without the rule XLA's scatter gathers the new rows across the data axis.
    buf = args["buffer"]  # [batch, max_len, kv_heads, head_dim]
    b = sharding.divisible(config, config.dp_name, buf.shape[0])
    h = sharding.divisible(config, config.tp_name, buf.shape[2])
    spec = P(b, None, h, None)
    return {"buffer": spec, "new": spec, "positions": P(b, None)}, spec
