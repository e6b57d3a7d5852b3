"""How the tests call ops and name their cases."""

from __future__ import annotations

import jax
import numpy as np


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
