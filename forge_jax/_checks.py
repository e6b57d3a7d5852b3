"""Argument validation shared by the public ops.

Every check runs on shapes and dtypes only, so it works on tracers and runs
before any work is traced. Messages name the argument and its value.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)
