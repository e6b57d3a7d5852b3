"""Token embedding lookup."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks, dispatch


def _wide_ids(ids):
    """``ids`` as a signed integer type wide enough to hold both them and any vocabulary size.

    Compared in their own dtype, uint8 ids would meet a vocabulary of 300 as ``300 % 256``
    and int16 ids one of 128256 as a negative number, making valid ids look out of range.
    Unsigned ids too large for the wide type wrap to negative values, which are out of range
    as they should be.
    """
    wide = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    return ids.astype(wide)


def _embedding_args(table, ids):
    _checks.array("table", table, ndim=2)
    _checks.array("ids", ids, kind="int")
    if _checks.is_concrete(ids) and ids.size:
        # Python ints: no overflow in the comparison, whatever the ids' dtype.
        host = np.asarray(ids)
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= table.shape[0]:
            raise ValueError(
                f"ids must lie in [0, {table.shape[0]}) for {table.shape=}, got min {lo}, max {hi}")
    return dict(table=table, ids=ids)


def embedding(table, ids, *, implementation=None):
    """Looks up rows of an embedding table: ``out[..., :] = table[ids[...], :]``.

    Args:
      table: ``[vocab, dim]`` float array.
      ids: int array of any shape and any integer dtype (compared with ``vocab`` in a
        dtype wide enough for both) with values in ``[0, vocab)``. Concrete ids out of
        range raise ValueError; traced ones (under ``jit``) cannot be checked and
        give rows of NaN, so the error is visible instead of silently clamped.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[*ids.shape, dim]`` in ``table.dtype``.
    """
    return dispatch.call("embedding", _embedding_args(table, ids), implementation)


dispatch.define("embedding", _embedding_args)


@dispatch.register("embedding", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp.take")
def embedding_xla(table, ids):
    with jax.named_scope("embedding"):
        vocab = table.shape[0]
        ids = _wide_ids(ids)
        valid = (ids >= 0) & (ids < vocab)
        rows = jnp.take(table, jnp.clip(ids, 0, vocab - 1), axis=0)
        return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, table.dtype))
