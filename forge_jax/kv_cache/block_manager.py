"""The host-side block manager: which pages of a :class:`PagedKVCache` each sequence owns.

Plain Python/NumPy, no device work: allocation, appends, prefix sharing by
:meth:`BlockManager.fork` with copy-on-write, and freeing.
"""

from __future__ import annotations

import dataclasses
import heapq
import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from forge_jax import _checks


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
            self._drop_reservation(src)
        return copies

    # -- mutations ------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int, *,
                 prefix_pages: Sequence[int] = ()) -> np.ndarray:
        """Creates sequence ``seq_id`` with ``num_tokens`` tokens (e.g. its prompt).

        ``prefix_pages`` are pages in use (held by another sequence or by :meth:`hold`)
        whose full contents are this sequence's first ``len(prefix_pages) * page_size``
        tokens: they are shared, not copied (a prefix cache). ``num_tokens`` counts them.

        Returns:
          np.int32 ``[num_tokens]``: the slots of those tokens, for ``paged_write``.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        num_tokens = _count("num_tokens", num_tokens)
        prefix = [int(p) for p in prefix_pages]
        if len(prefix) * self.page_size > num_tokens:
            raise ValueError(f"{len(prefix)} prefix pages hold {len(prefix) * self.page_size} "
                             f"tokens, more than {num_tokens=}")
        for page in prefix:
            self._check_held(page)
        need = self._pages_for(num_tokens) - len(prefix)
        self._ensure(need, f"allocate {num_tokens} tokens for sequence {seq_id!r}")
        for page in prefix:
            self._refs[page] += 1
        seq = _Sequence(pages=prefix + [self._take() for _ in range(need)], length=num_tokens)
        self._seqs[seq_id] = seq
        return self._slots(seq, 0, num_tokens)

    def hold(self, page: int) -> None:
        """Adds a reference to ``page`` (in use) that no sequence owns: a prefix cache's
        hold, which keeps the page out of the pool after its sequences are freed."""
        self._check_held(page)
        self._refs[page] += 1

    def release(self, page: int) -> None:
        """Drops a reference taken by :meth:`hold`; the page returns to the pool once no
        one else holds it."""
        self._check_held(page)
        self._release(page)

    def refcount(self, page: int) -> int:
        """References to ``page``: owning sequences, holds and pending copies reading it."""
        return self._refs[page]

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

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Shortens ``seq_id`` to its first ``num_tokens`` tokens (at most its length),
        releasing the pages past them (a speculative step's rejected drafts)."""
        seq = self._get(seq_id)
        num_tokens = _count("num_tokens", num_tokens)
        if num_tokens > seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of length {seq.length} "
                             f"to {num_tokens} tokens")
        keep = self._pages_for(num_tokens)
        for page in seq.pages[keep:]:
            self._release(page)
        del seq.pages[keep:]
        seq.length = num_tokens

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

    def _check_held(self, page: int) -> None:
        if not (isinstance(page, numbers.Integral) and 0 <= page < self.num_pages
                and self._refs[page] > 0):
            raise ValueError(f"page {page!r} is not in use (num_pages={self.num_pages})")

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
            self._drop_reservation(src)

    def _drop_reservation(self, src: int) -> None:
        """Ends one pending copy's hold on its source page ``src``."""
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
