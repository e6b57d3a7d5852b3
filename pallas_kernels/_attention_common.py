"""XLA-side bookkeeping shared by the GPU and TPU attention kernels (no kernel code here).

The kernels of both backends implement one contract (the docstring of
:mod:`forge_jax.ops.attention`); what they compute around the ``pallas_call`` is the same
and lives here once: the paged kernels' per-sequence key ranges and sanitised block
tables, and the flash kernels' backward pass (the XLA reference's VJP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from forge_jax.ops.attention import attention_reference

# Positions are assumed to lie in [-2**30, 2**30): clamping positions and windows to this
# keeps `p - window + 1` and `p + 1` inside int32.
POS_LIMIT = 2**30


def paged_ranges(q_positions, lengths, block_tables, *, q_len, group, rows_pad, page_size,
                 num_pages, sliding_window):
    """The bookkeeping of a paged attention kernel, for ``batch`` sequences.

    Returns ``(window, key_lo, key_hi, row_pos, tables)``:
      window: ``sliding_window`` clamped (or None);
      key_lo, key_hi: int32 ``[batch]``, the keys some query of the sequence may see lie in
        ``[key_lo, key_hi)`` (empty when ``key_lo == key_hi``);
      row_pos: int32 ``[batch, rows_pad]``, the position of each query row (row ``r`` is
        query ``r // group``, query-major); padding rows get -1 and see no key;
      tables: int32 ``[batch, max_pages]``; entries past a sequence's pages (which may hold
        garbage) read page 0, and no entry leaves the pool.
    """
    batch, max_pages = block_tables.shape
    capacity = max_pages * page_size
    lengths = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, capacity)
    if q_positions is None:
        q_positions = lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)
    pos = jnp.clip(jnp.asarray(q_positions).astype(jnp.int32).reshape(batch, q_len),
                   -POS_LIMIT, POS_LIMIT)
    window = None if sliding_window is None else min(int(sliding_window), POS_LIMIT)
    key_hi = jnp.clip(jnp.minimum(lengths, pos.max(axis=1) + 1), 0, capacity)
    key_lo = (jnp.zeros_like(key_hi) if window is None
              else jnp.clip(pos.min(axis=1) - window + 1, 0, capacity))
    key_lo = jnp.minimum(key_lo, key_hi)
    row_pos = jnp.pad(jnp.repeat(pos, group, axis=1), ((0, 0), (0, rows_pad - q_len * group)),
                      constant_values=-1)
    used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size < lengths[:, None]
    tables = jnp.where(used, jnp.clip(jnp.asarray(block_tables).astype(jnp.int32), 0,
                                      num_pages - 1), 0)
    return window, key_lo, key_hi, row_pos, tables


def reference_vjp(st, residuals, g):
    """The backward pass of the flash kernels: the VJP of the XLA reference, which keeps
    hidden NaN/inf K/V slots out of every gradient itself. ``st`` carries ``scale``,
    ``causal``, ``sliding_window`` and ``logits_soft_cap``; ``residuals`` are
    ``(q, k, v, positions, lengths)`` with explicit positions and lengths."""
    q, k, v, positions, lengths = residuals

    def reference(q, k, v):
        return attention_reference(
            q, k, v, scale=st.scale, causal=st.causal, q_positions=positions,
            kv_lengths=lengths, sliding_window=st.sliding_window,
            logits_soft_cap=st.logits_soft_cap)

    _, vjp = jax.vjp(reference, q, k, v)
    return (*vjp(g), None, None)
