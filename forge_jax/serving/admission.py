"""How the serving engine admits requests into a step with its prefix cache: which full
pages a step computes (a later row of the same step may share them), which a running
request has yet to compute (a waiting request whose prefix continues into them waits for
them rather than computing them twice), and a waiting request's admission: its cached
prefix and first chunk allocated if the pool allows (evicting cached pages, never
preempting).

Each function takes the :class:`~forge_jax.serving.engine.Engine` whose manager and
prefix cache it reads.
"""

from __future__ import annotations

from forge_jax.serving.requests import Request


def note_fresh(engine, r: Request, n: int, fresh: dict[bytes, int]) -> None:
    """Adds the full pages of known tokens that ``n`` new rows of ``r`` complete."""
    if not engine.prefix_cache.enabled:
        return
    first = r.computed // engine.page_size
    done = min(r.computed + n, len(r.tokens)) // engine.page_size
    if done > first:
        table = engine.manager.block_table(r.id)
        keys = r.page_keys(engine.page_size, done)
        fresh.update((keys[i], int(table[i])) for i in range(first, done))


def uncomputed_keys(engine, r: Request) -> list[bytes]:
    """The prefix-cache keys of ``r``'s full pages not computed yet."""
    if not engine.prefix_cache.enabled:
        return []
    full = len(r.tokens) // engine.page_size
    return r.page_keys(engine.page_size, full)[r.computed // engine.page_size:]


def prefix_keys(engine, r: Request) -> list[bytes]:
    """The keys of the full pages a lookup of ``r`` may reuse (as ``PrefixCache.lookup``:
    its last token is always computed)."""
    return r.page_keys(engine.page_size, (len(r.tokens) - 1) // engine.page_size)


def next_prefix_key(engine, r: Request, fresh: dict[bytes, int]) -> bytes | None:
    """The key of the first full page of ``r``'s prefix that is neither cached nor
    computed in this step (None: none)."""
    cached = engine.prefix_cache.pages
    return next((k for k in prefix_keys(engine, r) if k not in cached and k not in fresh),
                None)


def admit(engine, r: Request, budget: int, fresh: dict[bytes, int]) -> bool:
    """Allocates a waiting request's cached prefix (continued by the ``fresh`` pages
    this step computes) and first chunk, if the pool allows (evicting cached pages,
    never preempting)."""
    tokens = r.tokens
    cached = engine.prefix_cache.lookup(tokens)
    pages = list(cached)
    if fresh:  # the prefix continues into pages an earlier row of this step fills
        for key in prefix_keys(engine, r)[len(pages):]:
            if key not in fresh:
                break
            pages.append(fresh[key])
    shared = len(pages) - len(cached)
    for page in pages:  # held across the eviction below, which takes only unheld pages
        engine.manager.hold(page)
    try:
        computed = len(pages) * engine.page_size
        n = min(len(tokens) - computed, budget)
        need = -(-(computed + n) // engine.page_size) - len(pages)
        free = engine.manager.usage().free_pages
        if need > free:
            engine.prefix_cache.evict(need - free)
        if need > engine.manager.usage().free_pages:
            stats = engine.prefix_cache.stats  # not admitted: the lookup did not count
            stats.queried_tokens -= len(tokens)
            stats.hit_tokens -= len(cached) * engine.page_size
            stats.reused_pages -= len(cached)
            return False
        engine.manager.allocate(r.id, computed, prefix_pages=pages)
        engine.manager.append(r.id, n)
    finally:
        for page in pages:
            engine.manager.release(page)
    stats = engine.prefix_cache.stats  # shared in this step: reused as a cached page is
    stats.hit_tokens += shared * engine.page_size
    stats.reused_pages += shared
    # The pages shared in this step enter the cache when their own request's rows are
    # booked; this request's booking then finds them there.
    r.computed, r.cached_pages = computed, len(cached)
    return True
