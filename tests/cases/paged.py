"""Paged KV caches built from random data: page pools, block tables and the dense keys and
values they stand for.

Every slot no query may see holds non-finite data (or, in the finite copies, large
garbage), unused block-table entries hold huge integers of either sign (a wrapped negative
index would read a page), and sequences sit on randomly permuted pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cases.inputs import GARBAGE
from cases.references import attention_mask_ref


def default_positions(lengths, q_len):
    """int32 ``[batch, q_len]``: the last ``q_len`` positions of each sequence."""
    return (np.asarray(lengths)[:, None] - q_len + np.arange(q_len)[None, :]).astype(np.int32)


@dataclasses.dataclass
class PagedCache:
    """Page pools ``[kv_heads, num_pages, page_size, head_dim]`` and their block tables
    ``[batch, max_pages]``, with the float64 truth behind them."""

    k_pages: jax.Array  # NaN or +-inf in every slot no query sees
    v_pages: jax.Array
    block_tables: jax.Array  # int32
    finite_k: jax.Array  # the same pools with large finite garbage instead of NaN / inf
    finite_v: jax.Array
    dense_k: np.ndarray  # float64 [batch, max_pages * page_size, kv_heads, head_dim]
    dense_v: np.ndarray  # (zero in the slots no query sees), as rounded to the pool's dtype


def paged_cache(gen, lengths, *, page_size, kv_heads, head_dim, dtype, positions=None,
                window=None, spare_pages=3, spare_entries=1, max_pages=None,
                num_pages=None, attention_chunk_size=None) -> PagedCache:
    """Random sequences of ``lengths`` tokens on randomly permuted pages of a poisoned pool.

    Args:
      gen: a NumPy generator.
      lengths: ``[batch]`` tokens per sequence.
      positions: the ``[batch, q_len]`` positions of the queries that will read the cache;
        with ``window``, the slots none of them sees (before every query's window, at or
        after every query's position) are poisoned too. None: every slot before each
        sequence's length holds data.
      attention_chunk_size: like ``window``, the slots outside every query's chunk are
        poisoned too.
      spare_pages, spare_entries: pages no sequence owns, block-table entries past the
        longest sequence's pages (both poisoned); ``max_pages`` and ``num_pages`` fix those
        shapes instead.
    """
    lengths = np.asarray(lengths)
    batch = len(lengths)
    pages_per_seq = [-(-int(n) // page_size) for n in lengths]
    max_pages = max_pages or max(pages_per_seq) + spare_entries
    num_pages = num_pages or sum(pages_per_seq) + spare_pages
    seq = max_pages * page_size
    if positions is None:
        seen = np.arange(seq)[None, :] < lengths[:, None]
    else:
        seen = attention_mask_ref(batch, positions.shape[1], seq, q_positions=positions,
                                  kv_lengths=lengths, sliding_window=window,
                                  attention_chunk_size=attention_chunk_size).any(axis=1)
    shape = (kv_heads, num_pages, page_size, head_dim)
    poison = lambda: gen.choice(np.array([np.nan, np.inf, -np.inf]), shape)  # noqa: E731
    k_pages, v_pages = poison(), poison()
    tables = gen.integers(-2**30, 2**30, (batch, max_pages))
    dense_k = np.zeros((batch, seq, kv_heads, head_dim))
    dense_v = np.zeros_like(dense_k)
    owned = np.split(gen.permutation(num_pages)[:sum(pages_per_seq)],
                     np.cumsum(pages_per_seq)[:-1])
    for b, pages in enumerate(owned):
        tables[b, :pages_per_seq[b]] = pages
        for pos in np.flatnonzero(seen[b]):
            kv = gen.standard_normal((2, kv_heads, head_dim)).astype(np.dtype(dtype))
            dense_k[b, pos], dense_v[b, pos] = kv.astype(np.float64)
            page, off = tables[b, pos // page_size], pos % page_size
            k_pages[:, page, off], v_pages[:, page, off] = kv
    finite = lambda x: np.where(  # noqa: E731
        np.isfinite(x), x, gen.choice([-1, 1], shape) * gen.uniform(GARBAGE, 2 * GARBAGE, shape))
    as_jnp = lambda x: jnp.asarray(x.astype(np.dtype(dtype)))  # noqa: E731
    return PagedCache(as_jnp(k_pages), as_jnp(v_pages), jnp.asarray(tables, jnp.int32),
                      as_jnp(finite(k_pages)), as_jnp(finite(v_pages)), dense_k, dense_v)


def pages_from_dense(gen, k, v, *, num_pages, page_size):
    """Dense ``k, v [batch, kv_len, kv_heads, head_dim]`` (NumPy) -> shuffled page pools,
    their block tables (an out-of-range page past each sequence's pages) and NaN in the
    pages no sequence owns."""
    batch, kv_len, kv_heads, d = k.shape
    per_seq = -(-kv_len // page_size)
    order = gen.permutation(num_pages)
    tables = np.full((batch, per_seq + 1), 10**6, np.int32)
    pools = []
    for x in (k, v):
        pool = np.full((kv_heads, num_pages, page_size, d), np.nan, np.float32)
        for b in range(batch):
            for i in range(per_seq):
                page = int(order[b * per_seq + i])
                tables[b, i] = page
                rows = x[b, i * page_size:(i + 1) * page_size]
                pool[:, page, :rows.shape[0]] = np.transpose(rows, (1, 0, 2))
        pools.append(pool)
    return pools[0], pools[1], tables


# --- ragged steps: prefill and decode sequences in one call -------------------------------

# (q_heads, kv_heads); the last two are released models' (cases.shapes).
RAGGED_HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1), "smollm2": (9, 3),
                "llama3": (32, 8), "gptoss": (64, 8), "llama4": (40, 8)}

# make_step's sequences: new tokens and cache lengths per sequence, room for max_seqs
# sequences and total_tokens rows.
RAGGED_MIXES = {
    "decode": dict(q_lens=[1] * 5, kv_lens=[1, 17, 32, 9, 40], max_seqs=7, total_tokens=8),
    "prefill": dict(q_lens=[12, 5, 20], kv_lens=[12, 5, 20], max_seqs=4, total_tokens=40),
    "chunked_prefill": dict(q_lens=[7, 16], kv_lens=[23, 16], max_seqs=2, total_tokens=23),
    # Decode, chunked prefill and a sequence with no new token (q_len 0) together.
    "mixed": dict(q_lens=[1, 9, 0, 1, 6], kv_lens=[30, 17, 11, 1, 40], max_seqs=7,
                  total_tokens=21),
}


@dataclasses.dataclass
class Step:
    """One ragged step: the op's arguments (NumPy, so that editing them compiles nothing),
    and the float64 truth behind them."""

    q: np.ndarray
    k_pages: np.ndarray  # NaN wherever no query may look
    v_pages: np.ndarray
    k_clean: np.ndarray  # the same, but finite in the slots a sliding window hides
    v_clean: np.ndarray
    block_tables: np.ndarray
    kv_lengths: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: int
    dense_k: np.ndarray  # float64 [num_seqs, pages_per_seq * page_size, kv_heads, head_dim]
    dense_v: np.ndarray

    def args(self, clean=False):
        k, v = (self.k_clean, self.v_clean) if clean else (self.k_pages, self.v_pages)
        return (*map(jnp.asarray, (self.q, k, v, self.block_tables, self.kv_lengths,
                                   self.cu_q_lens)), np.int32(self.num_seqs))


def make_step(gen, q_lens, kv_lens, *, max_seqs, total_tokens, page_size, heads, head_dim,
              dtype, q_dtype=None, window=None, spare_pages=3, pages_per_seq=None,
              num_pages=None, attention_chunk_size=None) -> Step:
    """Random sequences on randomly permuted pages of a NaN-filled pool.

    Ignored sequences' block tables, lengths and ``cu_q_lens`` entries hold huge values of
    either sign; the padding rows of ``q`` hold NaN; ``heads`` names a ``RAGGED_HEADS``
    entry.
    """
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    n = len(q_lens)
    q_heads, kv_heads = RAGGED_HEADS[heads]
    used = [-(-int(x) // page_size) for x in kv_lens]
    pages_per_seq = pages_per_seq or max(used) + 1
    num_pages = num_pages or sum(used) + spare_pages
    capacity = pages_per_seq * page_size
    shape = (kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = np.full(shape, np.nan), np.full(shape, np.nan)
    k_clean, v_clean = np.full(shape, np.nan), np.full(shape, np.nan)
    tables = gen.integers(-2**30, 2**30, (max_seqs, pages_per_seq))
    kv = gen.integers(-2**30, 2**30, max_seqs)
    cu = gen.integers(-2**30, 2**30, max_seqs + 1)
    cu[0] = 0
    cu[1:n + 1] = np.cumsum(q_lens)
    kv[:n] = kv_lens
    dense_k = np.zeros((n, capacity, kv_heads, head_dim))
    dense_v = np.zeros_like(dense_k)
    order = iter(gen.permutation(num_pages))
    for i in range(n):
        tables[i, :used[i]] = [next(order) for _ in range(used[i])]
        first = kv_lens[i] - q_lens[i]  # the earliest new token's position
        for pos in range(kv_lens[i]):
            kv_val = gen.standard_normal((2, kv_heads, head_dim)).astype(np.dtype(dtype))
            dense_k[i, pos], dense_v[i, pos] = kv_val.astype(np.float64)
            page, off = tables[i, pos // page_size], pos % page_size
            k_clean[:, page, off], v_clean[:, page, off] = kv_val
            hidden = q_lens[i] == 0 or (window is not None and pos <= first - window) or (
                attention_chunk_size is not None
                and pos // attention_chunk_size < first // attention_chunk_size)
            if not hidden:
                k_pages[:, page, off], v_pages[:, page, off] = kv_val
    q = gen.standard_normal((total_tokens, q_heads, head_dim))
    q[cu[n]:] = np.nan  # padding rows
    pool = lambda x: x.astype(np.dtype(dtype))  # noqa: E731
    return Step(q.astype(np.dtype(q_dtype or dtype)), pool(k_pages), pool(v_pages),
                pool(k_clean), pool(v_clean), tables.astype(np.int32), kv.astype(np.int32),
                cu.astype(np.int32), n, dense_k, dense_v)


# --- shapes for supports() and the lowering ---------------------------------------------------


def paged_attention_specs(q_heads, kv_heads, head_dim, page_size, q_len, dtype, q_dtype=None,
                          batch=3):
    """``jax.ShapeDtypeStruct`` s of ``(q, k_pages, v_pages, block_tables, lengths)``: 40
    pages, 9 block-table entries per sequence; ``q_len`` None: a decode ``q``."""
    spec = jax.ShapeDtypeStruct
    q = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    pool = spec((kv_heads, 40, page_size, head_dim), dtype)
    return (spec(q, q_dtype or dtype), pool, pool, spec((batch, 9), jnp.int32),
            spec((batch,), jnp.int32))


def paged_attention_args(specs, **masking):
    """The bound arguments of ``fj.paged_attention`` (what ``supports()`` reads) for
    :func:`paged_attention_specs`, with ``masking`` keywords."""
    q, k, v, t, n = specs
    return dict(q=q, k_pages=k, v_pages=v, block_tables=t, lengths=n, scale=None,
                q_positions=None, sliding_window=None, logits_soft_cap=None) | masking


def lowered_paged_attention(kernel, case, masking, export) -> str:
    """The module text of ``kernel.paged_attention`` lowered by ``export``
    (``_compat.export_for_cuda`` or ``export_for_tpu``) at ``case`` (the arguments of
    :func:`paged_attention_specs`) with explicit positions and ``masking`` keywords, after
    asserting that ``kernel.supports`` accepts the case."""
    specs = paged_attention_specs(*case)
    assert kernel.supports(paged_attention_args(specs, **masking)) is None
    positions = jax.ShapeDtypeStruct((3, case[4] or 1), jnp.int32)
    exported = export(
        lambda q, k, v, t, n, p: kernel.paged_attention(q, k, v, t, n, q_positions=p,
                                                        **masking),
        *specs, positions)
    return exported.mlir_module()
