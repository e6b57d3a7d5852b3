"""The Pallas TPU (Mosaic) paged-attention kernel against the XLA paged attention and a
float64 reference.

JAX's tests/pallas pattern: :class:`PagedAttentionTest` runs the kernel compiled on a TPU
(``"pallas"``, skipped without one); :class:`PagedAttentionInterpretTest` runs the same
cases in the TPU interpreter on any machine (race detection, NaN-poisoned uninitialised
memory, so an output the kernel never writes fails the finiteness checks). Every cache slot
no query may see (the tail of each last page, slots before the window, spare pages) holds
NaN or +-inf, and unused block-table entries hold huge integers of either sign. Lowering
tests run the real Pallas -> Mosaic lowering for TPU on this machine.
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
from test_pallas_gpu_paged import default_positions, make_cache, poison_per_query

import forge_jax as fj
from forge_jax import _compat, tolerances
from forge_jax.pallas_kernels.tpu import _common as tpu_common
from forge_jax.pallas_kernels.tpu import paged_attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

_paged = jax.jit(fj.paged_attention, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "implementation"))

# (q_heads, kv_heads, page_size, q_len (None: 3-D decode q), cache dtype, q dtype,
#  sliding_window, logits_soft_cap, lengths); head_dim 128 throughout.
CASES = [
    # Llama-3-8B heads, bfloat16 decode; lengths 0 and 1, one ending inside a page.
    (32, 8, 16, None, BF16, BF16, None, None, [0, 1, 37, 64]),
    # 8/2 heads, float32 decode with a window and a soft cap.
    (8, 2, 16, None, F32, F32, 20, 5.0, [50, 3, 17]),
    # A bfloat16 cache with float32 queries, three new tokens, a window.
    (8, 2, 16, 3, BF16, F32, 9, None, [33, 2, 20]),
]


class PagedAttentionTest(parameterized.TestCase):
    """The kernel compiled for the TPU (skipped without one)."""

    IMPLEMENTATION = "pallas"
    INTERPRET = False

    def setUp(self):
        super().setUp()
        if not self.INTERPRET and jax.default_backend() != "tpu":
            self.skipTest(f"compiled Mosaic TPU kernel: backend is {jax.default_backend()}")

    def tearDown(self):
        if self.INTERPRET:
            _compat.reset_tpu_interpreter()
        super().tearDown()

    def attend(self, q, k_pages, v_pages, tables, lengths, **kw):
        return _paged(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                      implementation=self.IMPLEMENTATION, **kw)

    @parameterized.parameters(*CASES)
    def test_matches_xla_and_float64(self, q_heads, kv_heads, page_size, q_len, dtype,
                                     q_dtype, window, cap, lengths):
        head_dim = 128
        rng = np.random.default_rng([q_heads, page_size, q_len or 0])
        lengths = np.array(lengths)
        batch, t = len(lengths), q_len or 1
        positions = default_positions(lengths, t)
        k_pages, v_pages, tables, k_fin, v_fin, dense_k, dense_v = make_cache(
            rng, lengths, positions, page_size=page_size, kv_heads=kv_heads,
            head_dim=head_dim, dtype=dtype, window=window)
        q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, t, q_heads, head_dim)
        q = jnp.asarray(rng.standard_normal(q_shape).astype(np.dtype(q_dtype)))
        kw = dict(sliding_window=window, logits_soft_cap=cap, scale=0.8 / head_dim**0.5)
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
        # A query that sees no key gives exact zeros (an empty sequence).
        seen = attention_mask_ref(batch, t, dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=window).any(axis=-1)
        np.testing.assert_array_equal(
            f64(out).reshape(batch, t, q_heads, head_dim)[~seen], 0.0)

    def test_nonfinite_reaches_only_the_queries_that_see_it(self):
        # Three new tokens with a window: the slots some queries of a sequence see and
        # others do not hold NaN/inf; each query's output is its float64 result on clean
        # data, or NaN / non-finite exactly where it sees a NaN / inf (or a +inf logit).
        rng = np.random.default_rng(7)
        lengths, window = np.array([30, 9, 2]), 5
        positions = default_positions(lengths, 3)
        k_pages, v_pages, tables, _, _, dense_k, dense_v = make_cache(
            rng, lengths, positions, page_size=16, kv_heads=2, head_dim=128, dtype=F32,
            window=window)
        q = jnp.asarray(rng.standard_normal((3, 3, 4, 128)), F32)
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
        np.testing.assert_allclose(out[clean], ref[clean],
                                   **tolerances.tolerance(F32, self.IMPLEMENTATION).as_kwargs())


class PagedAttentionInterpretTest(PagedAttentionTest):
    """The same kernel in the TPU interpreter, on any machine."""

    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def test_small_blocks_double_buffer_over_many_blocks():
    """One page per compute block: the double-buffered copies alternate over up to seven
    blocks, the first ones skipped by the window; explicit positions, one seeing nothing."""
    rng = np.random.default_rng(9)
    lengths = np.array([100, 4, 50])
    positions = default_positions(lengths, 1) - np.array([[0], [0], [60]])
    k_pages, v_pages, tables, _, _, dense_k, dense_v = make_cache(
        rng, lengths, positions, page_size=16, kv_heads=2, head_dim=128, dtype=F32,
        window=40)
    q = jnp.asarray(rng.standard_normal((3, 8, 128)), F32)
    run = jax.jit(lambda *a, p: kernel.paged_attention(
        *a, q_positions=p, sliding_window=40, pages_per_compute_block=1, interpret=True))
    out = run(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
              p=jnp.asarray(positions[:, 0]))
    ref = attention_ref(f64(q)[:, None], dense_k, dense_v, q_positions=positions,
                        kv_lengths=lengths, sliding_window=40)[:, 0]
    assert_close(out, ref, implementation="pallas_tpu_interpret")
    np.testing.assert_array_equal(f64(out)[2], 0.0)  # position -10 sees nothing


# --- lowering for TPU and supports() -------------------------------------------------------

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
    (32, 8, 128, 16, None, BF16, None), (8, 2, 128, 16, 16, BF16, None),
    (8, 2, 128, 8, None, F32, None), (8, 2, 256, 32, 3, F32, BF16),
    (8, 1, 128, 16, None, BF16, F32), (16, 16, 128, 64, 2, F32, None),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: "-".join(map(case_id, c)))
@pytest.mark.parametrize("masking", [{}, dict(sliding_window=7, logits_soft_cap=30.0)],
                         ids=["plain", "window_cap"])
def test_accepted_cases_lower_for_tpu(case, masking):
    shapes = _shapes(*case)
    assert kernel.supports(_args(shapes, **masking)) is None
    positions = S((3, case[4] or 1), jnp.int32)
    exported = _compat.export_for_tpu(
        lambda q, k, v, t, n, p: kernel.paged_attention(q, k, v, t, n, q_positions=p,
                                                        **masking),
        *shapes, positions)
    text = exported.mlir_module()
    assert "forge_jax_tpu_paged_attention" in text and "tpu_custom_call" in text


@pytest.mark.parametrize("shapes,match", [
    (_shapes(8, 2, 128, 16, 17, BF16), "q_len=17 > 16"),
    (_shapes(8, 2, 64, 16, None, BF16), "head_dim=64 is not a multiple of 128"),
    (_shapes(8, 2, 128, 8, None, BF16), "page_size=8 is not a multiple of 16"),
    (_shapes(8, 2, 128, 12, None, F32), "page_size=12 is not a multiple of 8"),
    (_shapes(8, 2, 128, 16, None, F16, F32), "k_pages.dtype=float16"),
    (_shapes(8, 2, 128, 16, None, F32, F16), "q.dtype=float16"),
], ids=["q_len", "head_dim", "page_bf16", "page_f32", "pages_f16", "q_f16"])
def test_supports_rejects_with_reason(shapes, match):
    # The head_dim and page_size rejections follow Mosaic's (8, 128) layout rules, enforced by
    # libtpu's compiler; the CPU-side lowering of export_for_tpu accepts those shapes, so
    # these rejections cannot be shown failing here (see the kernel's module docstring).
    assert match in (kernel.supports(_args(shapes)) or "")


def test_dispatch_names_the_rejection():
    q = jnp.ones((1, 4, 64), F32)
    pool = jnp.ones((2, 4, 16, 64), F32)
    with pytest.raises(fj.ImplementationError, match="head_dim=64"):
        fj.paged_attention(q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                           jnp.ones((1,), jnp.int32), implementation="pallas_tpu_interpret")


def test_tuning_table():
    assert set(tpu_common.TUNING) >= {"TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "default"}
    assert kernel.default_pages_per_compute_block(16, 64, "TPU v6 lite") == 32
    assert kernel.default_pages_per_compute_block(16, 4, None) == 4  # at most the table width
    assert kernel.default_pages_per_compute_block(1024, 4, "unknown") == 1


if __name__ == "__main__":
    absltest.main()
