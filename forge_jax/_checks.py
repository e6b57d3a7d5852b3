"""Argument validation shared by the public ops.

Shape and dtype checks work on tracers and run before any work is traced. Value checks
(indices, lengths) run where the values are concrete (NumPy arrays, or JAX arrays outside
``jax.jit``): they read the values on the host, so they never add work to a traced call.
Traced values cannot be checked at trace time; inside :func:`debug_checks` the ops emit
the same checks as ``jax.experimental.checkify`` checks instead. Messages name the
argument and its value.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16),
                jnp.dtype(jnp.float64))


def array(name: str, x: Any, *, ndim: int | tuple[int, ...] | None = None,
          min_ndim: int | None = None, kind: str = "float") -> jax.Array:
    """Checks that ``x`` is an array of the given rank and dtype kind ("float", "int", "bool")."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}: {x!r:.80}")
    if isinstance(ndim, int):
        ndim = (ndim,)
    if ndim is not None and x.ndim not in ndim:
        want = " or ".join(str(n) for n in ndim)
        raise ValueError(f"{name} must have rank {want}, got {name}.shape={tuple(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have rank >= {min_ndim}, got {name}.shape={tuple(x.shape)}")
    dtype = jnp.dtype(x.dtype)
    if kind == "float" and dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16, got {name}.dtype={dtype.name}")
    if kind == "int" and not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {name}.dtype={dtype.name}")
    if kind == "bool" and dtype != jnp.bool_:
        raise TypeError(f"{name} must be a boolean array, got {name}.dtype={dtype.name}")
    return x


def same_dtype(first: tuple[str, Any], second: tuple[str, Any], hint: str = "") -> None:
    """The dtype rule of :mod:`forge_jax.ops`: two compute inputs of one op share a dtype.

    ``first`` and ``second`` are ``(name, array)``; a mismatch raises TypeError naming
    both dtypes, whatever ``jax_numpy_dtype_promotion`` says (ops never promote)."""
    (a_name, a), (b_name, b) = first, second
    a_dtype, b_dtype = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
    if a_dtype != b_dtype:
        raise TypeError(
            f"{a_name} and {b_name} must have the same dtype (forge_jax ops never promote: "
            f"cast one explicitly), got {a_name}.dtype={a_dtype.name}, "
            f"{b_name}.dtype={b_dtype.name}{hint}")


def positive_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def positive_float(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python number, got {name}={value!r}")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {name}={value!r}")
    return float(value)


def number(name: str, value: Any) -> Any:
    """A Python real or a scalar array (e.g. a traced scale)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {name}={value!r}")
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "shape") and tuple(value.shape) == ():
        return value
    raise TypeError(f"{name} must be a Python number or a scalar array, got {name}={value!r:.80}")


def product_output(out_dtype: Any, default: Any, c: Any, beta: Any,
                   out_shape: tuple[int, ...]) -> np.dtype:
    """The checks a product's output arguments share (``matmul``, ``quantized_matmul``):
    ``out_dtype`` (None: ``default``) a float dtype; ``c`` broadcasting to ``out_shape``
    and given exactly when ``beta`` is not 0. Returns the output dtype."""
    out_dtype = default if out_dtype is None else out_dtype
    try:
        out_dtype = jnp.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"out_dtype must be a float dtype, got {out_dtype=!r}") from None
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"out_dtype must be a float dtype, got out_dtype={out_dtype.name}")
    if c is not None:
        array("c", c)
        try:
            broadcast = np.broadcast_shapes(tuple(c.shape), out_shape)
        except ValueError:
            broadcast = None
        if broadcast != out_shape:
            raise ValueError(
                f"c must broadcast to the product's shape {out_shape}, got {c.shape=}")
        if isinstance(beta, float) and beta == 0.0:
            raise ValueError(
                "c was given with beta=0.0, so it would be ignored; pass beta=1.0 to add c")
    elif not (isinstance(beta, numbers.Real) and beta == 0.0):
        raise ValueError(f"beta={beta!r} needs c, but c is None")
    return out_dtype


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def concrete_ints(x: Any) -> np.ndarray | None:
    """``x`` as an int64 NumPy array where its values are known on the host (a NumPy array,
    a Python number, a fully addressable JAX array outside a trace), else ``None``."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    if not isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Integral)):
        return None  # e.g. a jax.ShapeDtypeStruct: a shape, not values
    return np.asarray(x).astype(np.int64)


# ---------------------------------------------------------------------------------------
# Debug checks of traced values

DEBUG_ENV_VAR = "FORGE_JAX_DEBUG_CHECKS"
_DEBUG = threading.local()


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Context manager: ops traced inside emit value checks for their traced arguments.

    Concrete arguments (NumPy arrays, JAX arrays outside ``jax.jit``) are always checked
    and raise ValueError. Traced ones (under ``jit``, ``vmap``, ``scan``, ...) cannot be
    read at trace time: by default an out-of-range traced index or length gets the
    defined, safe result each op documents (it reads nothing, or is clamped). Inside this
    block, the ops also emit the same checks as ``jax.experimental.checkify`` checks
    (``checkify.check(..., debug=True)``), which cost nothing unless the function is
    checkified::

        with fj.debug_checks():
            err, out = jax.jit(checkify.checkify(step))(cache, tokens)
        err.throw()  # ValueError-like JaxRuntimeError naming the argument and value

    Without ``checkify.checkify`` the emitted checks are dropped, so leaving debug checks
    on never breaks a jitted function. Like :func:`forge_jax.use_implementation`, the flag
    is read when an op is traced: it applies to functions traced inside the block (a
    function jitted and traced earlier keeps its compiled form). Setting the environment
    variable ``FORGE_JAX_DEBUG_CHECKS=1`` turns the checks on everywhere;
    ``debug_checks(False)`` turns them off inside a block.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"debug_checks takes a bool, got {enabled=!r}")
    stack = _DEBUG.__dict__.setdefault("stack", [])
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def debug_checks_enabled() -> bool:
    """Whether ops traced here emit checkify checks of their traced values."""
    stack = getattr(_DEBUG, "stack", None)
    if stack:
        return stack[-1]
    return os.environ.get(DEBUG_ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def traced_check(ok: Any, message: str, **values: Any) -> None:
    """Emits ``checkify.check(ok, message, **values, debug=True)`` when debug checks are on.

    ``message`` is a format string over ``values`` (traced scalars), e.g.
    ``"lengths[{b}]={n} must lie in [0, 32]"``.
    """
    if debug_checks_enabled():
        checkify.check(ok, message, debug=True, **values)


def first_bad(bad: Any) -> Any:
    """The flat index of the first true entry of the traced boolean ``bad`` (0 if none)."""
    return jnp.argmax(jnp.ravel(bad))
