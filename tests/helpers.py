"""Shared test helpers: random inputs (never zeros) and the tolerance-policy comparison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from reference import f64

from forge_jax import tolerances

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed) or 0)


def normal(gen: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0):
    """Standard normal values times ``scale`` (never all zeros), as a JAX array of ``dtype``."""
    x = gen.standard_normal(shape) * scale
    return jnp.asarray(x.astype(np.dtype(dtype)))


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


def jcall(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``jax.jit``: array keywords are traced, the rest static.

    One compilation per shape is much cheaper on CPU than eager op-by-op dispatch, which
    compiles every primitive separately; the eager path is covered by test_variants.py.
    """
    arrays = {n: a for n, a in kwargs.items() if isinstance(a, (jax.Array, np.ndarray))}
    static = {n: a for n, a in kwargs.items() if n not in arrays}
    return jax.jit(lambda args, arrays: fn(*args, **arrays, **static))(args, arrays)


def case_id(value) -> str:
    """Readable pytest ids: dtypes by name, everything else by ``str``."""
    if isinstance(value, type) and hasattr(value, "dtype"):
        return np.dtype(value.dtype).name
    if value is None:
        return "none"
    return str(getattr(value, "kind", value)).replace(" ", "")
