"""The behaviours of every kernel implementation of ``fj.paged_attention``
(:class:`PagedAttentionCases`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from cases.base import ImplementationCases, parametrize_from
from cases.calls import jit_paged_attention
from cases.checks import assert_close, assert_nonfinite_exactly
from cases.inputs import poison_per_query, rng
from cases.paged import default_positions, paged_cache
from cases.references import attention_mask_ref, attention_ref, f64


def nan_pools_under(tables, lengths, *, num_pages: int, page: int, max_pages: int, gen,
                    kv_heads: int = 2, head_dim: int = 64):
    """bfloat16 pools ``[kv_heads, num_pages, page, head_dim]``, NaN but in the slots a valid
    entry of ``tables`` names for the first ``lengths`` tokens (at most ``max_pages``
    pages) of each sequence: random there (from ``gen``). The index contract's cases: an
    entry outside the pool, or a token past the table, reads nothing."""
    k = np.full((kv_heads, num_pages, page, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for b, row in enumerate(tables):
        for pos in range(min(lengths[b], max_pages * page)):
            if 0 <= row[pos // page] < num_pages:
                k[:, row[pos // page], pos % page], v[:, row[pos // page], pos % page] = \
                    gen.standard_normal((2, kv_heads, head_dim))
    return jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One call of ``fj.paged_attention`` on a random paged cache
    (:func:`cases.paged.paged_cache`).

    Attributes:
      q_heads, kv_heads, head_dim, page_size: the shapes.
      q_len: new tokens per sequence; None: a decode query ``[batch, q_heads, head_dim]``.
      dtype, q_dtype: of the pages and of ``q`` (default ``dtype``).
      window, cap: ``sliding_window`` and ``logits_soft_cap``.
      explicit_positions: positions passed explicitly, earlier than each sequence's end,
        the last query of sequence 0 padding (position -1, it sees nothing).
      lengths: tokens per sequence.
      chunk: ``attention_chunk_size`` (slots outside every query's chunk poisoned too).
      sinks: pass attention sinks (random logits, one per query head).
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    q_len: int | None
    dtype: Any
    lengths: tuple[int, ...]
    q_dtype: Any = None
    window: int | None = None
    cap: float | None = None
    explicit_positions: bool = False
    chunk: int | None = None
    sinks: bool = False

    def extras(self):
        """The sinks and chunk keywords of the case."""
        kw = {}
        if self.chunk is not None:
            kw["attention_chunk_size"] = self.chunk
        if self.sinks:
            kw["sinks"] = jnp.asarray(rng(self.q_heads, 99).normal(1.0, 2.0, self.q_heads),
                                      jnp.float32)
        return kw


class PagedAttentionCases(ImplementationCases):
    """``fj.paged_attention`` through ``IMPLEMENTATION`` against the float64 reference and the
    XLA implementation. Every cache slot no query may see (the tail of each last page, slots
    before every query's window or after every query's position, spare pages) holds NaN or
    +-inf, and unused block-table entries hold huge integers of either sign.

    Case tables (``{id: PagedCase}``):
      CASES: shapes (real models' heads), decode and chunked prefill, dtypes, window, cap,
        explicit and padded positions.
      NONFINITE_CASES: chunked prefill (``q_len=3``, 4 query heads over 2 kv heads) with
        NaN / inf in slots that some queries of a sequence see and others do not.
    """

    CASES: dict[str, PagedCase]
    NONFINITE_CASES: dict[str, PagedCase]

    def paged_attention(self, q, k_pages, v_pages, tables, lengths, **kw):
        return jit_paged_attention(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                                   implementation=self.IMPLEMENTATION, **kw)

    @parametrize_from("CASES")
    def test_matches_xla_and_float64(self, case):
        gen = rng(case.q_heads, case.head_dim, case.page_size, case.q_len or 0)
        lengths = np.array(case.lengths)
        batch, t = len(lengths), case.q_len or 1
        positions = default_positions(lengths, t)
        if case.explicit_positions:  # earlier than the cache's end, and trailing padding
            positions = positions - 2
            positions[0, -1] = -1
        cache = paged_cache(gen, lengths, positions=positions, window=case.window,
                            page_size=case.page_size, kv_heads=case.kv_heads,
                            head_dim=case.head_dim, dtype=case.dtype,
                            attention_chunk_size=case.chunk)
        shape = (batch, t, case.q_heads, case.head_dim)
        q = jnp.asarray(gen.standard_normal(shape if case.q_len else (batch, *shape[2:]))
                        .astype(np.dtype(case.q_dtype or case.dtype)))
        kw = dict(sliding_window=case.window, logits_soft_cap=case.cap,
                  scale=0.8 / case.head_dim**0.5,
                  q_positions=jnp.asarray(positions) if case.explicit_positions else None,
                  **case.extras())
        out = self.paged_attention(q, cache.k_pages, cache.v_pages, cache.block_tables, lengths,
                                   **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = attention_ref(f64(q).reshape(shape), cache.dense_k, cache.dense_v,
                            q_positions=positions, kv_lengths=lengths,
                            sliding_window=case.window, logits_soft_cap=case.cap,
                            scale=kw["scale"], **case.extras()).reshape(q.shape)
        assert_close(out, ref, implementation=self.IMPLEMENTATION, err_msg="against float64")
        # The XLA implementation on the same visible data (finite garbage elsewhere).
        xla = jit_paged_attention(q, cache.finite_k, cache.finite_v, cache.block_tables,
                                  jnp.asarray(lengths, jnp.int32), implementation="xla", **kw)
        assert_close(out, f64(xla), implementation=self.IMPLEMENTATION, factor=2.0,
                     err_msg="against XLA")
        # A query that sees no key gives exact zeros (an empty sequence, padded positions).
        seen = attention_mask_ref(batch, t, cache.dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=case.window,
                                  attention_chunk_size=case.chunk).any(axis=-1)
        np.testing.assert_array_equal(f64(out).reshape(shape)[~seen], 0.0)

    @parametrize_from("NONFINITE_CASES")
    def test_nonfinite_reaches_only_the_queries_that_see_it(self, case):
        # Chunked prefill: the slots some queries of a sequence see and others do not hold
        # NaN/inf; each query's output is its float64 result on clean data, or NaN /
        # non-finite exactly where it sees a NaN / inf (or has a +inf logit).
        gen = rng(7, case.page_size)
        lengths = np.array(case.lengths)
        batch, t = len(lengths), case.q_len
        positions = default_positions(lengths, t)
        cache = paged_cache(gen, lengths, positions=positions, window=case.window,
                            page_size=case.page_size, kv_heads=case.kv_heads,
                            head_dim=case.head_dim, dtype=case.dtype,
                            attention_chunk_size=case.chunk)
        q = jnp.asarray(gen.standard_normal((batch, t, case.q_heads, case.head_dim)),
                        case.dtype)
        ref = attention_ref(f64(q), cache.dense_k, cache.dense_v, q_positions=positions,
                            kv_lengths=lengths, sliding_window=case.window, **case.extras())
        mask = attention_mask_ref(batch, t, cache.dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=case.window,
                                  attention_chunk_size=case.chunk)
        q, k_pages, v_pages, must_nan, must_inf = poison_per_query(
            q, cache.k_pages, cache.v_pages, mask, seed=7,
            block_tables=np.asarray(cache.block_tables))
        out = self.paged_attention(q, k_pages, v_pages, cache.block_tables, lengths,
                                   sliding_window=case.window, **case.extras())
        assert_nonfinite_exactly(out, ref, must_nan, must_inf, dtype=case.dtype,
                                 implementation=self.IMPLEMENTATION)
