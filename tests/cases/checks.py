"""Comparisons of an op's output with its float64 reference under the tolerance policy
(``forge_jax.tolerances``)."""

from __future__ import annotations

import numpy as np
import pytest

from cases.references import f64, rms_norm_ref, rope_angles_ref, rope_ref, round_to
from forge_jax import tolerances


def assert_close(out, ref, *, dtype=None, implementation: str = "xla", factor: float = 1.0,
                 allow_zero_ref: bool = False, err_msg: str = ""):
    """``out`` agrees with the float64 ``ref`` within the project tolerance for ``dtype``.

    The tolerance is that of ``dtype`` (default ``out.dtype``) for ``implementation``,
    widened by ``factor``. Also checks shape and finiteness, and that ``ref`` is not
    identically zero (a comparison against zeros cannot catch a kernel that writes
    nothing) unless ``allow_zero_ref``.
    """
    out64 = f64(out)
    ref = np.asarray(ref, np.float64)
    assert out64.shape == ref.shape, (out64.shape, ref.shape, err_msg)
    assert np.isfinite(out64).all(), f"non-finite output {err_msg}"
    if not allow_zero_ref:
        assert ref.size == 0 or np.abs(ref).max() > 0, f"reference is all zeros {err_msg}"
    tol = tolerances.tolerance(dtype if dtype is not None else out.dtype, implementation)
    tol = tolerances.scaled(tol, factor)
    np.testing.assert_allclose(out64, ref, err_msg=err_msg, **tol.as_kwargs())


def assert_rms_norm_close(out, xla, x, w, r, *, eps, implementation):
    """``out`` (``y`` or, with a residual ``r``, ``(y, h)``) of ``fj.rms_norm(x, w, eps=eps,
    residual=r)`` against the float64 reference and the XLA implementation's ``xla``: ``h``
    is one float32 add rounded to ``x.dtype`` in every implementation, so bitwise equal."""
    ref = rms_norm_ref(x, w, eps=eps, residual=r, h_dtype=x.dtype)
    if r is not None:
        (y, h), (xla_y, xla_h), (ref_y, ref_h) = out, xla, ref
        assert h.dtype == x.dtype
        np.testing.assert_array_equal(f64(h), f64(xla_h))
        np.testing.assert_array_equal(f64(h), round_to(ref_h, x.dtype))
    else:
        y, xla_y, ref_y = out, xla, ref
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref_y, implementation=implementation)
    assert_close(y, f64(xla_y), implementation=implementation)


def assert_close_nan(out, ref, *, dtype, implementation, err_msg=""):
    """Like :func:`assert_close`, for a reference with NaN: NaN exactly where ``ref`` is NaN."""
    out64, ref = f64(out), np.asarray(ref)
    np.testing.assert_array_equal(np.isnan(out64), np.isnan(ref), err_msg=err_msg)
    assert np.isnan(ref).any() and not np.isnan(ref).all(), err_msg
    tol = tolerances.tolerance(dtype, implementation)
    keep = ~np.isnan(ref)
    np.testing.assert_allclose(out64[keep], ref[keep], err_msg=err_msg, **tol.as_kwargs())


def assert_nonfinite_exactly(out, ref, must_nan, must_inf, *, dtype, implementation):
    """NaN where ``must_nan``, non-finite where ``must_inf``, elsewhere finite and close to
    the float64 ``ref`` (computed on clean data: what a query does not see is irrelevant).
    The masks come from :func:`cases.inputs.poison_per_query`."""
    out64 = f64(out)
    clean = ~(must_nan | must_inf)
    assert clean.any() and np.isnan(out64[must_nan]).all()
    assert not np.isfinite(out64[must_inf]).any()
    assert np.isfinite(out64[clean]).all(), (
        f"non-finite data reached {np.argwhere(~np.isfinite(out64) & clean)[:8]} "
        "[batch, query, head, column], whose query does not see it")
    tol = tolerances.tolerance(dtype, implementation)
    np.testing.assert_allclose(out64[clean], np.asarray(ref)[clean], **tol.as_kwargs())


# The inverse-frequency table is float32, as in Hugging Face; float32 `pow` and division
# leave it a few ulp from the correctly rounded table of the reference, and that error
# grows with the position: an angle p * f carries up to ~4 ulp of f times p. The rope
# checks allow exactly that on top of the dtype tolerance (it is below 2e-5 for p < ~80).
ANGLE_ULPS = 4 * 2.0**-24


def rope_angle_slack(positions, head_dim, *, theta, scaling):
    """Per-pair bound ``[..., head_dim // 2]`` on |angle error| from the float32 table."""
    return ANGLE_ULPS * np.abs(rope_angles_ref(positions, head_dim, theta=theta,
                                               scaling=scaling))


def assert_rope_close(out, x, positions, *, theta=10000.0, scaling=None, interleaved=False,
                      implementation="xla"):
    """``out`` agrees with the float64 RoPE of ``x [batch, seq, heads, head_dim]`` at
    ``positions [batch, seq]``, allowing, on top of the dtype tolerance, the angle error of
    the float32 frequency table (:func:`rope_angle_slack`) times the magnitude of the pair
    it rotates. Implementations that share the table are compared with each other at the
    plain tolerance (:func:`assert_close`)."""
    ref = rope_ref(x, positions, theta=theta, scaling=scaling, interleaved=interleaved)
    slack = rope_angle_slack(positions, x.shape[-1], theta=theta, scaling=scaling)
    x = f64(x)
    if interleaved:
        mag = np.repeat(np.abs(x[..., 0::2]) + np.abs(x[..., 1::2]), 2, axis=-1)
        slack = np.repeat(slack, 2, axis=-1)
    else:
        half = x.shape[-1] // 2
        mag = np.tile(np.abs(x[..., :half]) + np.abs(x[..., half:]), 2)
        slack = np.concatenate([slack, slack], axis=-1)
    out64 = f64(out)
    assert out64.shape == ref.shape, (out64.shape, ref.shape)
    assert np.isfinite(out64).all()
    tol = tolerances.tolerance(out.dtype, implementation)
    bound = tol.atol + tol.rtol * np.abs(ref) + mag * slack[:, :, None, :]
    excess = np.abs(out64 - ref) - bound
    assert (excess <= 0).all(), f"{np.sum(excess > 0)} elements off by up to {excess.max()}"


def assert_raises_as_listed(case) -> None:
    """``case`` is ``(call, error type, message pattern)``: ``call()`` raises that error, its
    message matching the pattern (the bad-input tables of the op tests)."""
    call, error, match = case
    with pytest.raises(error, match=match):
        call()


def assert_split_k_partials_written(kernel, a, q, *, rows: int, implementation: str) -> None:
    """A quantized matmul kernel's raw partial sums, in the interpreter (which fills what a
    kernel does not write with NaN): ``a`` (``[m, k]``, m < ``rows``) padded with zero rows to
    ``rows``, times the per-channel int8 ``q`` (``[n, k]``) transposed, in two K splits of
    tiles of 64. Every slot, padding columns and both splits included, is finite, the splits
    sum to the float64 product, and the padding rows are zero."""
    import jax.numpy as jnp

    from cases import quant as qref

    m, n = a.shape[0], q.shape[0]
    x = jnp.pad(a, ((0, rows - m), (0, 0)))
    part = kernel(x, q.values, q.scales.reshape(n), tile_k=64, max_concurrent_steps=2,
                  split_k=2, interpret=True)
    assert part.shape == (2, n, rows) and np.isfinite(np.asarray(part)).all()
    want = np.asarray(a.astype(jnp.float32), np.float64) @ qref.dequantize(q).T
    assert_close(part.sum(0).T[:m], want, implementation=implementation)
    assert np.abs(np.asarray(part[:, :, m:])).max() == 0  # zero rows of padding
