"""Comparisons of an op's output with its float64 reference under the tolerance policy
(``forge_jax.tolerances``)."""

from __future__ import annotations

import numpy as np

from cases.references import f64
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
