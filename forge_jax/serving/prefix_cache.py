"""The serving engine's prefix cache: full pages of the KV cache kept after their request
ends, keyed by their tokens and everything before them, shared through the block
manager's reference counts and evicted least-recently-used only when the pool needs pages.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from forge_jax.kv_cache import BlockManager


def page_keys(tokens: Sequence[int], page_size: int, count: int,
              known: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of the first ``count`` full pages of ``tokens``: page ``i``'s key is a hash
    of page ``i - 1``'s key and page ``i``'s tokens (so it names the whole prefix).
    ``known``: keys of the first pages computed before (only the pages after them are
    hashed: a growing sequence pays for its new pages only)."""
    keys = list(known[:count])
    previous = keys[-1] if keys else b""
    ids = np.asarray(tokens[len(keys) * page_size:count * page_size], np.int64)
    for i in range(count - len(keys)):
        previous = hashlib.blake2b(previous + ids[i * page_size:(i + 1) * page_size].tobytes(),
                                   digest_size=16).digest()
        keys.append(previous)
    return keys


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since the cache was made.

    Attributes:
      queried_tokens: prompt tokens looked up (a request's known tokens when it is admitted).
      hit_tokens: of those, tokens found in cached pages (not prefilled again).
      reused_pages: cached pages handed to a request.
      evicted_pages: cached pages given back to the pool.
    """

    queried_tokens: int = 0
    hit_tokens: int = 0
    reused_pages: int = 0
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Full pages, keyed by :func:`page_keys`, each held once (``BlockManager.hold``) so
    that it outlives its request.

    A page whose only reference is the cache's hold is reclaimable: :meth:`evict` releases
    such pages, least recently used first, when an allocation needs them.

    Args:
      manager: the engine's :class:`BlockManager`.
      enabled: False keeps nothing (every prompt is prefilled in full).
    """

    def __init__(self, manager: BlockManager, *, enabled: bool = True):
        self.manager = manager
        self.enabled = enabled
        self.pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self.pages)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The cached pages of ``tokens``' longest cached prefix of full pages, leaving at
        least its last token to compute (its logits are needed); marks them used."""
        self.stats.queried_tokens += len(tokens)
        if not self.enabled:
            return []
        page_size = self.manager.page_size
        found = []
        for key in page_keys(tokens, page_size, (len(tokens) - 1) // page_size):
            page = self.pages.get(key)
            if page is None:
                break
            self.pages.move_to_end(key)
            found.append(page)
        self.stats.hit_tokens += len(found) * page_size
        self.stats.reused_pages += len(found)
        return found

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start: int,
               keys: Sequence[bytes] | None = None) -> int:
        """Keeps the full pages ``start ..`` of a sequence whose cached tokens are
        ``tokens`` (its pages ``pages``; ``keys``: their :func:`page_keys`, if known);
        returns the number of full pages now covered."""
        page_size = self.manager.page_size
        full = len(tokens) // page_size
        if not self.enabled or full <= start:
            return max(start, full)
        keys = page_keys(tokens, page_size, full, keys or ())
        for i, key in enumerate(keys[start:full], start):
            if key in self.pages:
                self.pages.move_to_end(key)
                continue
            self.manager.hold(int(pages[i]))
            self.pages[key] = int(pages[i])
        return full

    def reclaimable(self) -> int:
        """Cached pages no request holds (freed by :meth:`evict`)."""
        return sum(self.manager.refcount(p) == 1 for p in self.pages.values())

    def evict(self, count: int) -> int:
        """Releases up to ``count`` reclaimable pages, least recently used first; returns how
        many it released."""
        released = []
        for key, page in self.pages.items():
            if len(released) == count:
                break
            if self.manager.refcount(page) == 1:
                released.append(key)
        for key in released:
            self.manager.release(self.pages.pop(key))
        self.stats.evicted_pages += len(released)
        return len(released)

    def clear(self) -> None:
        """Releases every cached page (those requests still use stay with them)."""
        for page in self.pages.values():
            self.manager.release(page)
        self.stats.evicted_pages += len(self.pages)
        self.pages.clear()
