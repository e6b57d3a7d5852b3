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

# Large finite values that a result must never contain a trace of.
GARBAGE = 3e3


def garbage(gen: np.random.Generator, shape, dtype=jnp.float32):
    """Large random values of either sign (``GARBAGE`` times a standard normal)."""
    return jnp.asarray(gen.standard_normal(shape) * GARBAGE, dtype)


def random_qkv(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
    """``q [batch, q_len, q_heads, head_dim]`` and ``k, v [batch, kv_len, kv_heads,
    head_dim]`` of standard normal values in ``dtype``."""
    gen = rng(*np.atleast_1d(seed))
    return (normal(gen, (batch, q_len, q_heads, head_dim), dtype),
            normal(gen, (batch, kv_len, kv_heads, head_dim), dtype),
            normal(gen, (batch, kv_len, kv_heads, head_dim), dtype))


def rms_norm_inputs(shape, dtype, w_dtype, residual, seed=0):
    """``x`` (three times a standard normal), a weight near one, a residual or None."""
    gen = rng(seed, shape[-1])
    x = normal(gen, shape, dtype, scale=3.0)
    w = jnp.asarray((1.0 + 0.2 * gen.standard_normal(shape[-1])).astype(np.dtype(w_dtype)))
    return x, w, (normal(gen, shape, dtype) if residual else None)


def silu_mul_inputs(shape, dtype, seed=0):
    """``gate`` four times a standard normal (the sigmoid's tails, not only its middle),
    ``up`` a standard normal."""
    gen = rng(seed, len(shape))
    return normal(gen, shape, dtype, scale=4.0), normal(gen, shape, dtype)


def rope_inputs(shape, dtype, start, seed=0):
    """``x [batch, seq, heads, head_dim]`` and int32 ``positions [batch, seq]`` increasing
    from ``start``, a different offset per sequence (left padding)."""
    x = normal(rng(seed, shape[-1]), shape, dtype)
    positions = start + np.arange(shape[1])[None, :] + 11 * np.arange(shape[0])[:, None]
    return x, jnp.asarray(positions, jnp.int32)


# --- poisoning: non-finite data where a query must not look ---------------------------------


def poison_unseen(k, v, mask, *, gen=None):
    """NaN in every key slot and +inf in every value slot that no query of its sequence sees
    (``mask [batch, q_len, kv_len]``); with ``gen``, each value slot holds NaN or +inf at
    random. ``k, v``: dense ``[batch, kv_len, kv_heads, head_dim]``."""
    unseen = ~np.asarray(mask).any(axis=1)[:, :, None, None]
    assert unseen.any(), "nothing to poison"
    v_poison = np.inf if gen is None else np.where(gen.random(v.shape) < 0.5, np.nan, np.inf)
    return (jnp.where(unseen, jnp.asarray(np.nan, k.dtype), k),
            jnp.where(unseen, jnp.asarray(v_poison, v.dtype), v))


def poison_per_query(q, k, v, mask, *, seed, block_tables=None):
    """Non-finite data hidden from some queries of a sequence and seen by others.

    Every slot of ``mask`` ``[b, t, s]`` that some but not all queries of its sequence see
    (the causal mask hides it from earlier queries, the window from later ones) gets one
    entry, cycling over a NaN key element, a NaN value and a +-inf value (random kv head
    and column); one query element of a query that sees keys is set to +inf where a key it
    sees is positive (a +inf logit).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: dense ``[batch, kv_len, kv_heads, head_dim]``, or, with ``block_tables``, page
        pools ``[kv_heads, num_pages, page_size, head_dim]`` whose slot ``s`` of sequence
        ``b`` is page ``block_tables[b, s // page_size]``, offset ``s % page_size``.

    Returns:
      The poisoned ``(q, k, v)`` and two boolean ``[b, t, q_heads, head_dim]`` masks: the
      outputs that must be NaN (their query sees a NaN or has a +inf logit) and those that
      must be non-finite (they read an inf value).
    """
    gen = rng(seed)
    q, k, v = np.array(q), np.array(k), np.array(v)  # writable copies, same dtype
    batch, q_len, q_heads, head_dim = q.shape
    if block_tables is None:
        kv_heads = k.shape[2]
        slot = lambda b, j, kh: (b, j, kh)  # noqa: E731
    else:
        kv_heads, page_size = k.shape[0], k.shape[2]
        slot = lambda b, j, kh: (kh, int(block_tables[b, j // page_size]), j % page_size)  # noqa: E731
    group = q_heads // kv_heads
    must_nan = np.zeros(q.shape, bool)
    must_inf = np.zeros(q.shape, bool)
    kinds = ("k_nan", "v_nan", "v_inf", "v_-inf")
    for b in range(batch):
        partial = np.flatnonzero(mask[b].any(0) & ~mask[b].all(0))
        for i, j in enumerate(partial):
            kind = kinds[(b + i) % len(kinds)]
            kh, col = gen.integers(kv_heads), gen.integers(head_dim)
            heads, seers = slice(kh * group, (kh + 1) * group), mask[b, :, j]
            if kind == "k_nan":
                k[(*slot(b, j, kh), col)] = np.nan
                must_nan[b, seers, heads] = True
            else:
                v[(*slot(b, j, kh), col)] = {"v_nan": np.nan, "v_inf": np.inf,
                                             "v_-inf": -np.inf}[kind]
                (must_nan if kind == "v_nan" else must_inf)[b, seers, heads, col] = True
    assert must_nan.any() and must_inf.any(), "nothing poisoned"
    b, t = np.argwhere(mask.any(-1))[-1]
    h = gen.integers(q_heads)
    seen_k = np.stack([k[slot(b, j, h // group)] for j in np.flatnonzero(mask[b, t])])
    seen_k = seen_k.astype(np.float64)
    col = int(np.nanargmax(np.nanmax(seen_k, axis=0)))
    assert np.nanmax(seen_k[:, col]) > 0
    q[b, t, h, col] = np.inf
    must_nan[b, t, h] = True
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), must_nan, must_inf


def random_llama(config, seed=0):
    """A ``llama.Llama`` with fresh random weights, large enough that the logits are far from
    uniform: greedy argmaxes have no near-ties, so two paths equal up to rounding agree on
    their tokens."""
    from flax import nnx

    from forge_jax.models import llama

    model = llama.Llama(config, rngs=nnx.Rngs(seed))
    gen = np.random.default_rng(seed)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            shape = param[...].shape
            if len(path) > 1 and str(path[-2]).endswith("norm"):
                value = gen.uniform(0.5, 1.5, shape)
            else:
                value = gen.normal(0.0, 0.25 if len(shape) > 1 else 0.1, shape)
            param.set_value(jnp.asarray(value, jnp.float32))
    return model
