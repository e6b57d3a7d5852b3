"""Random inputs (never zeros) for the op tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed) or 0)


def normal(gen: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0):
    """Standard normal values times ``scale`` (never all zeros), as a JAX array of ``dtype``."""
    x = gen.standard_normal(shape) * scale
    return jnp.asarray(x.astype(np.dtype(dtype)))
