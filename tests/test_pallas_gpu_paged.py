"""The Pallas GPU paged-attention kernel (flash-decoding) against the XLA paged attention
and a float64 reference.

JAX's tests/pallas pattern: :class:`PagedAttentionTest` runs the kernel compiled on a GPU
(``"pallas"``, skipped without one); :class:`PagedAttentionInterpretTest` runs the same
cases in Pallas' interpreter on any machine. Every cache slot that no query may see (the
tail of each last page, slots before every query's window or after every query's position,
spare pages) holds NaN or +-inf, and unused block-table entries hold huge integers of
either sign; the per-query tests also poison slots that some queries of a chunk see and
others do not (the causal mask or the window hides them from the rest). The interpreter
allocates kernel outputs filled with NaN, so an output the kernel never writes fails the
finiteness checks. Lowering tests run the real Pallas ->
Triton lowering for CUDA on this machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (bfloat16 in NumPy)
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from cases.calls import case_id
from cases.checks import assert_close
from cases.references import attention_mask_ref, attention_ref, f64

import forge_jax as fj
from forge_jax import _compat, tolerances
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import paged_attention as kernel

GARBAGE = 3e3
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def make_cache(rng, lengths, positions, *, page_size, kv_heads, head_dim, dtype, window=None,
               spare_pages=2, spare_entries=1):
    """Random sequences on randomly permuted pages of a pool poisoned with NaN and +-inf.

    Returns ``(k_pages, v_pages, tables, finite_k, finite_v, dense_k, dense_v)``:
    ``finite_*`` is the same pool with large finite garbage instead of NaN/inf (for
    implementations that need not tolerate NaN), ``dense_*`` the float64
    ``[batch, max_pages * page_size, kv_heads, head_dim]`` keys and values any query
    sees (zero elsewhere), as rounded to ``dtype``.
    """
    lengths = np.asarray(lengths)
    batch = len(lengths)
    pages_per_seq = [-(-int(n) // page_size) for n in lengths]
    max_pages = max(pages_per_seq) + spare_entries
    num_pages = sum(pages_per_seq) + spare_pages
    seq = max_pages * page_size
    seen = attention_mask_ref(batch, positions.shape[1], seq, q_positions=positions,
                              kv_lengths=lengths, sliding_window=window).any(axis=1)
    shape = (kv_heads, num_pages, page_size, head_dim)
    poison = lambda: rng.choice(np.array([np.nan, np.inf, -np.inf]), shape)
    k_pages, v_pages = poison(), poison()
    tables = rng.integers(-2**30, 2**30, (batch, max_pages))
    dense_k = np.zeros((batch, seq, kv_heads, head_dim))
    dense_v = np.zeros_like(dense_k)
    for b, order in enumerate(np.split(rng.permutation(num_pages)[:sum(pages_per_seq)],
                                       np.cumsum(pages_per_seq)[:-1])):
        tables[b, :pages_per_seq[b]] = order
        for pos in np.flatnonzero(seen[b]):
            kv = rng.standard_normal((2, kv_heads, head_dim)).astype(np.dtype(dtype))
            dense_k[b, pos], dense_v[b, pos] = kv.astype(np.float64)
            page, off = tables[b, pos // page_size], pos % page_size
            k_pages[:, page, off], v_pages[:, page, off] = kv
    finite = lambda x: np.where(np.isfinite(x), x, rng.uniform(GARBAGE, 2 * GARBAGE, shape))
    as_jnp = lambda x: jnp.asarray(x.astype(np.dtype(dtype)))
    return (as_jnp(k_pages), as_jnp(v_pages), jnp.asarray(tables, jnp.int32),
            as_jnp(finite(k_pages)), as_jnp(finite(v_pages)), dense_k, dense_v)


def poison_per_query(q, k_pages, v_pages, tables, mask, *, seed):
    """Non-finite data hidden from some queries of a sequence and seen by others.

    Every slot of ``mask`` ``[b, t, s]`` that some but not all queries of its sequence see
    (the causal mask hides it from earlier queries, the window from later ones) gets one
    entry in the pool, cycling over a NaN key element, a NaN value and a +-inf value (random
    kv head and column); one query element of a query that sees keys is set to +inf where
    a key it sees is positive (a +inf logit). Returns the poisoned ``(q, k_pages, v_pages)``
    and two boolean ``[b, t, q_heads, head_dim]`` masks: the outputs that must be NaN (their
    query sees a NaN or has a +inf logit) and those that must be non-finite (they read an
    inf value).
    """
    gen = np.random.default_rng(seed)
    q, k_pages, v_pages = np.array(q), np.array(k_pages), np.array(v_pages)  # writable
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    must_nan = np.zeros(q.shape, bool)
    must_inf = np.zeros(q.shape, bool)
    kinds = ("k_nan", "v_nan", "v_inf", "v_-inf")
    for b in range(batch):
        partial = np.flatnonzero(mask[b].any(0) & ~mask[b].all(0))
        for i, j in enumerate(partial):
            kind = kinds[(b + i) % len(kinds)]
            kh, col = gen.integers(kv_heads), gen.integers(head_dim)
            slot = (kh, int(tables[b, j // page_size]), j % page_size, col)
            heads, seers = slice(kh * group, (kh + 1) * group), mask[b, :, j]
            if kind == "k_nan":
                k_pages[slot] = np.nan
                must_nan[b, seers, heads] = True
            else:
                v_pages[slot] = {"v_nan": np.nan, "v_inf": np.inf, "v_-inf": -np.inf}[kind]
                (must_nan if kind == "v_nan" else must_inf)[b, seers, heads, col] = True
    assert must_nan.any() and must_inf.any(), "nothing poisoned"
    b, t = np.argwhere(mask.any(-1))[-1]
    h = gen.integers(q_heads)
    seen = np.flatnonzero(mask[b, t])
    seen_k = np.stack([k_pages[h // group, tables[b, j // page_size], j % page_size]
                       for j in seen]).astype(np.float64)
    col = int(np.nanargmax(np.nanmax(seen_k, axis=0)))
    assert np.nanmax(seen_k[:, col]) > 0
    q[b, t, h, col] = np.inf
    must_nan[b, t, h] = True
    return jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), must_nan, must_inf


def default_positions(lengths, q_len):
    return (np.asarray(lengths)[:, None] - q_len + np.arange(q_len)[None, :]).astype(np.int32)


_paged = jax.jit(fj.paged_attention, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "implementation"))

# (q_heads, kv_heads, head_dim, page_size, q_len (None: 3-D decode q), cache dtype, q dtype,
#  sliding_window, logits_soft_cap, explicit positions, lengths)
CASES = [
    # Llama-3-8B heads, bfloat16 decode; long enough for several splits.
    (32, 8, 128, 16, None, BF16, BF16, None, None, False, [0, 1, 37, 150]),
    # SmolLM-style 9/3 heads, float16 chunked prefill with a window.
    (9, 3, 64, 8, 4, F16, F16, 6, None, False, [1, 13, 40, 3]),
    # 9/3 heads at head_dim 80 (padded to 128): soft cap, explicit positions with padding.
    (9, 3, 80, 16, 3, F32, F32, None, 20.0, True, [20, 5, 64]),
    # A bfloat16 cache with float32 queries, window and cap together.
    (32, 8, 64, 8, 2, BF16, F32, 9, 5.0, False, [70, 2, 17]),
    # MQA, 16 new tokens: 8 * 16 rows in two row blocks.
    (8, 1, 64, 8, 16, F32, F32, None, None, False, [16, 33, 90]),
]


class PagedAttentionTest(parameterized.TestCase):
    """The kernel compiled for the GPU (skipped without one)."""

    IMPLEMENTATION = "pallas"
    INTERPRET = False

    def setUp(self):
        super().setUp()
        if not self.INTERPRET and (reason := _common.gpu_reason(jax.default_backend())):
            self.skipTest(f"compiled Pallas GPU kernel: {reason}")

    def attend(self, q, k_pages, v_pages, tables, lengths, **kw):
        return _paged(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                      implementation=self.IMPLEMENTATION, **kw)

    @parameterized.parameters(*CASES)
    def test_matches_xla_and_float64(self, q_heads, kv_heads, head_dim, page_size, q_len,
                                     dtype, q_dtype, window, cap, explicit, lengths):
        rng = np.random.default_rng([q_heads, head_dim, page_size, q_len or 0])
        lengths = np.array(lengths)
        batch, t = len(lengths), q_len or 1
        positions = default_positions(lengths, t)
        if explicit:  # earlier than the cache's end, and trailing padding that sees nothing
            positions = positions - 2
            positions[0, -1] = -1
        k_pages, v_pages, tables, k_fin, v_fin, dense_k, dense_v = make_cache(
            rng, lengths, positions, page_size=page_size, kv_heads=kv_heads,
            head_dim=head_dim, dtype=dtype, window=window)
        q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, t, q_heads, head_dim)
        q = jnp.asarray(rng.standard_normal(q_shape).astype(np.dtype(q_dtype)))
        kw = dict(sliding_window=window, logits_soft_cap=cap, scale=0.8 / head_dim**0.5,
                  q_positions=jnp.asarray(positions) if explicit else None)
        out = self.attend(q, k_pages, v_pages, tables, lengths, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = attention_ref(f64(q).reshape(batch, t, q_heads, head_dim), dense_k, dense_v,
                            q_positions=positions, kv_lengths=lengths, sliding_window=window,
                            logits_soft_cap=cap, scale=kw["scale"]).reshape(q.shape)
        assert_close(out, ref, implementation=self.IMPLEMENTATION, err_msg="vs float64")
        # The XLA implementation on the same visible data (finite garbage elsewhere).
        xla = _paged(q, k_fin, v_fin, tables, jnp.asarray(lengths, jnp.int32),
                     implementation="xla", **kw)
        tol = tolerances.tolerance(q_dtype, self.IMPLEMENTATION)
        np.testing.assert_allclose(f64(out), f64(xla), atol=2 * tol.atol, rtol=2 * tol.rtol)
        # A query that sees no key gives exact zeros (an empty sequence, padded positions).
        seen = attention_mask_ref(batch, t, dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=window).any(axis=-1)
        blind = f64(out).reshape(batch, t, q_heads, head_dim)[~seen]
        np.testing.assert_array_equal(blind, 0.0)

    @parameterized.parameters(
        # Three queries over two splits of four 16-slot pages, float32.
        (None, 16, F32, [70, 21, 3]),
        # The window hides early keys from later queries; a bfloat16 cache.
        (5, 8, BF16, [30, 9, 2]),
    )
    def test_nonfinite_reaches_only_the_queries_that_see_it(self, window, page_size, dtype,
                                                             lengths):
        # Chunked prefill: the slots some queries of a sequence see and others do not hold
        # NaN/inf; each query's output is its float64 result on clean data, or NaN /
        # non-finite exactly where it sees a NaN / inf (or has a +inf logit).
        rng = np.random.default_rng([7, page_size])
        lengths = np.array(lengths)
        positions = default_positions(lengths, 3)
        k_pages, v_pages, tables, _, _, dense_k, dense_v = make_cache(
            rng, lengths, positions, page_size=page_size, kv_heads=2, head_dim=64,
            dtype=dtype, window=window)
        q = jnp.asarray(rng.standard_normal((3, 3, 4, 64)), dtype)
        ref = attention_ref(f64(q), dense_k, dense_v, q_positions=positions,
                            kv_lengths=lengths, sliding_window=window)
        mask = attention_mask_ref(3, 3, dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=window)
        q, k_pages, v_pages, must_nan, must_inf = poison_per_query(
            q, k_pages, v_pages, np.asarray(tables), mask, seed=7)
        out = f64(self.attend(q, k_pages, v_pages, tables, lengths, sliding_window=window))
        clean = ~(must_nan | must_inf)
        assert clean.any() and np.isnan(out[must_nan]).all()
        assert not np.isfinite(out[must_inf]).any()
        assert np.isfinite(out[clean]).all(), (
            f"non-finite data reached {np.argwhere(~np.isfinite(out) & clean)[:8]} "
            "[batch, query, head, column], whose query does not see it")
        tol = tolerances.tolerance(dtype, self.IMPLEMENTATION)
        np.testing.assert_allclose(out[clean], ref[clean], **tol.as_kwargs())


class PagedAttentionInterpretTest(PagedAttentionTest):
    """The same kernel in Pallas' interpreter, on any machine."""

    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


# --- the wrapper's knobs --------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_knobs_splits_and_small_blocks(num_splits):
    """Two pages per block: one split of 7 blocks (the online softmax alone), 3 splits of
    several blocks, and one block per split (the logsumexp merge alone)."""
    rng = np.random.default_rng(9)
    lengths = np.array([105, 4, 50])
    positions = default_positions(lengths, 3)
    k_pages, v_pages, tables, _, _, dense_k, dense_v = make_cache(
        rng, lengths, positions, page_size=8, kv_heads=2, head_dim=96, dtype=F32, window=40)
    q = jnp.asarray(rng.standard_normal((3, 3, 4, 96)), F32)
    run = jax.jit(lambda *a: kernel.paged_attention(
        *a, sliding_window=40, pages_per_compute_block=2, num_splits=num_splits, num_warps=2,
        num_stages=1, interpret=True))
    out = run(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32))
    ref = attention_ref(f64(q), dense_k, dense_v, q_positions=positions, kv_lengths=lengths,
                        sliding_window=40)
    assert_close(out, ref, implementation="pallas_gpu_interpret")


def test_knobs_that_cannot_lower_are_refused():
    q = jnp.ones((1, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    args = (q, pool, pool, jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"pages_per_compute_block=1 \* page_size=8 >= 16"):
        kernel.paged_attention(*args, pages_per_compute_block=1, interpret=True)
    with pytest.raises(ValueError, match="pages_per_compute_block=3 must be a power of two"):
        kernel.paged_attention(*args, pages_per_compute_block=3, interpret=True)
    with pytest.raises(ValueError, match="block_rows=24"):
        kernel.paged_attention(*args, block_rows=24, interpret=True)


# --- lowering for CUDA and supports() ------------------------------------------------------

S = jax.ShapeDtypeStruct


def _shapes(q_heads, kv_heads, head_dim, page_size, q_len, dtype, q_dtype=None, batch=3):
    q = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    pool = S((kv_heads, 40, page_size, head_dim), dtype)
    return (S(q, q_dtype or dtype), pool, pool, S((batch, 9), jnp.int32), S((batch,), jnp.int32))


def _args(shapes, **kw):
    q, k, v, t, n = shapes
    return dict(q=q, k_pages=k, v_pages=v, block_tables=t, lengths=n, scale=None,
                q_positions=None, sliding_window=None, logits_soft_cap=None) | kw


LOWERED = [  # (q_heads, kv_heads, head_dim, page_size, q_len, dtype, q_dtype)
    (32, 8, 128, 16, None, BF16, None), (32, 8, 128, 16, 16, BF16, None),
    (9, 3, 64, 8, 4, F16, None), (9, 3, 80, 32, None, F32, None), (8, 2, 96, 64, 2, BF16, F32),
    (16, 16, 256, 16, None, BF16, None), (32, 1, 128, 1, 16, F32, None),
    (4, 2, 8, 4, 1, F32, None), (8, 8, 64, 128, 5, F16, F16),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: "-".join(map(case_id, c)))
@pytest.mark.parametrize("masking", [{}, dict(sliding_window=7, logits_soft_cap=30.0)],
                         ids=["plain", "window_cap"])
def test_accepted_cases_lower_for_cuda(case, masking):
    shapes = _shapes(*case)
    assert kernel.supports(_args(shapes, **masking)) is None
    positions = S((3, case[4] or 1), jnp.int32)
    exported = _compat.export_for_cuda(
        lambda q, k, v, t, n, p: kernel.paged_attention(q, k, v, t, n, q_positions=p,
                                                        **masking),
        *shapes, positions)
    text = exported.mlir_module()
    assert "forge_jax_paged_attention" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("page_size", [12, 24])
def test_page_size_not_power_of_two_is_rejected_and_fails_lowering(page_size):
    shapes = _shapes(8, 2, 64, page_size, None, BF16)
    assert "page_size" in kernel.supports(_args(shapes))
    with pytest.raises(ValueError, match="power of 2"):
        _compat.export_for_cuda(kernel.paged_attention, *shapes)


@pytest.mark.parametrize("shapes,match", [
    (_shapes(8, 2, 64, 16, 17, BF16), "q_len=17 > 16"),
    (_shapes(8, 2, 512, 16, None, BF16), "head_dim=512 > 256"),
    (_shapes(8, 2, 64, 16, None, jnp.float64, BF16), "k_pages.dtype=float64"),
    (_shapes(8, 2, 64, 16, None, BF16, jnp.float64), "q.dtype=float64"),
], ids=["q_len", "head_dim", "pages_f64", "q_f64"])
def test_supports_rejects_with_reason(shapes, match):
    assert match in (kernel.supports(_args(shapes)) or "")


def test_dispatch_names_the_rejection():
    q = jnp.ones((1, 17, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    with pytest.raises(fj.ImplementationError, match="q_len=17"):
        fj.paged_attention(q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                           jnp.ones((1,), jnp.int32), implementation="pallas_gpu_interpret")


def test_registered_but_not_auto_selected_until_verified():
    assert kernel.VERIFIED == {}
    impls = fj.dispatch.implementations("paged_attention")
    assert "pallas_gpu_interpret" in impls
    assert "pallas" in fj.dispatch.implementations("paged_attention", "gpu")
    q = jnp.ones((1, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    chosen = fj.explain("paged_attention", q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                        jnp.ones((1,), jnp.int32))
    assert chosen.implementation == "xla"


if __name__ == "__main__":
    absltest.main()
