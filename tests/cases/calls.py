"""How the tests call ops and name their cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj

# The attention ops under one jit each (compiled once per shape and masking): the masking
# arguments and the implementation are static.
PAGED_STATIC = ("scale", "sliding_window", "logits_soft_cap", "attention_chunk_size",
                "implementation")
jit_attention = jax.jit(fj.attention, static_argnames=("causal", *PAGED_STATIC))
jit_paged_attention = jax.jit(fj.paged_attention, static_argnames=PAGED_STATIC)
jit_ragged_paged_attention = jax.jit(fj.ragged_paged_attention, static_argnames=PAGED_STATIC)
jit_paged_gather = jax.jit(fj.paged_gather)


def jcall(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under ``jax.jit``: array keywords are traced, the rest static.

    One compilation per shape is much cheaper on CPU than eager op-by-op dispatch, which
    compiles every primitive separately; the eager path is covered by test_variants.py.
    """
    arrays = {n: a for n, a in kwargs.items() if isinstance(a, (jax.Array, np.ndarray))}
    static = {n: a for n, a in kwargs.items() if n not in arrays}
    return jax.jit(lambda args, arrays: fn(*args, **arrays, **static))(args, arrays)


def as_jnp(kwargs):
    """Keyword arguments with NumPy arrays (positions, lengths) as int32 JAX arrays."""
    return {n: jnp.asarray(a, jnp.int32) if isinstance(a, np.ndarray) else a
            for n, a in kwargs.items()}


def case_id(value) -> str:
    """Readable pytest ids: dtypes by name, everything else by ``str``."""
    if isinstance(value, type) and hasattr(value, "dtype"):
        return np.dtype(value.dtype).name
    if value is None:
        return "none"
    return str(getattr(value, "kind", value)).replace(" ", "")


def by_id(cases, ids=case_id) -> dict:
    """A case table ``{id: case}`` of a list of case tuples, each id its values' ``ids``
    joined by ``-`` (see :func:`cases.base.parametrize_from`)."""
    return {"-".join(map(ids, case)): case for case in cases}
