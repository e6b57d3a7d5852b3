"""XLA-side bookkeeping shared by the GPU and TPU attention kernels (no kernel code here).

The kernels of both backends implement one contract (the docstring of
:mod:`forge_jax.ops.attention`); what they compute around the ``pallas_call`` is the same
and lives here once: the GQA query layout, the flash kernels' explicit positions and
lengths and their backward pass (the XLA reference's VJP), and the paged kernels'
per-sequence key ranges and sanitised block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax.ops.attention import attention_reference
from forge_jax.pallas_kernels._vjp import with_reference_vjp

# Positions are assumed to lie in [-2**30, 2**30): clamping positions and windows to this
# keeps `p - window + 1` and `p + 1` inside int32.
POS_LIMIT = 2**30


def paged_ranges(q_positions, lengths, block_tables, *, q_len, group, rows_pad, page_size,
                 num_pages, sliding_window, table_width, attention_chunk_size=None):
    """The bookkeeping of a paged attention kernel, for ``batch`` sequences.

    Returns ``(window, key_lo, key_hi, row_pos, tables)``:
      window: ``sliding_window`` clamped (or None);
      key_lo, key_hi: int32 ``[batch]``, the keys some query of the sequence may see lie in
        ``[key_lo, key_hi)`` (empty when ``key_lo == key_hi``);
      row_pos: int32 ``[batch, rows_pad]``, the position of each query row (row ``r`` is
        query ``r // group``, query-major); padding rows get -1 and see no key;
      tables: int32 ``[batch, table_width]`` (``table_width >= max_pages``: whole compute
        blocks of pages): the page of each entry a sequence uses, and -1 for every other
        entry (past its pages, where garbage may be, and the padding) and for a used entry
        that names no page of the pool (traced tables cannot be checked). A kernel reads
        no page for a -1 entry and hides its slots from every query (the index contract of
        :mod:`forge_jax.ops.paged`).
    Lengths outside ``[0, max_pages * page_size]`` are clamped into it, default positions
    included. With ``attention_chunk_size``, ``key_lo`` is at least the start of the chunk
    of the sequence's first query (the rows' own chunks are the kernel's to mask).
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
    if attention_chunk_size is not None:
        first_chunk = chunk_bounds(pos.min(axis=1), min(int(attention_chunk_size), POS_LIMIT))[0]
        key_lo = jnp.maximum(key_lo, jnp.clip(first_chunk, 0, capacity))
    key_lo = jnp.minimum(key_lo, key_hi)
    row_pos = jnp.pad(jnp.repeat(pos, group, axis=1), ((0, 0), (0, rows_pad - q_len * group)),
                      constant_values=-1)
    used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size < lengths[:, None]
    tables = jnp.asarray(block_tables).astype(jnp.int32)
    tables = jnp.where(used & (tables >= 0) & (tables < num_pages), tables, -1)
    tables = jnp.pad(tables, ((0, 0), (0, table_width - max_pages)), constant_values=-1)
    return window, key_lo, key_hi, row_pos, tables


def chunk_bounds(pos, size: int):
    """The chunk of the queries at ``pos`` (int32, any shape; chunked attention): its first
    key ``floor(pos / size) * size`` and its end, clamped to :data:`POS_LIMIT` (int32)."""
    lo = jnp.floor_divide(pos, size) * size
    return lo, jnp.where(lo > POS_LIMIT - size, POS_LIMIT, lo + size)


def key_spans(lo_pos, hi_pos, lengths, *, causal: bool, sliding_window: int | None,
              block_kv: int, attention_chunk_size: int | None = None):
    """The keys of a block of query rows (XLA, before a launch), from its rows' lowest and
    highest positions ``lo_pos, hi_pos [batch, blocks]`` and ``lengths [batch]``:
    ``(t_lo, t_hi, key_lo, key_hi, all_lo, all_hi)``, its tiles of ``block_kv`` keys
    ``[t_lo, t_hi)``, the keys some row sees ``[key_lo, key_hi)`` and those every row sees
    ``[all_lo, all_hi)`` (empty when ``lo >= hi``); with ``attention_chunk_size`` (at most
    :data:`POS_LIMIT`), within the rows' chunks."""
    length = jnp.broadcast_to(lengths[:, None], lo_pos.shape)
    key_hi = jnp.minimum(length, hi_pos + 1) if causal else length
    all_hi = jnp.minimum(length, lo_pos + 1) if causal else length
    zero = jnp.zeros_like(key_hi)
    key_lo = zero if sliding_window is None else jnp.maximum(0, lo_pos - sliding_window + 1)
    all_lo = zero if sliding_window is None else jnp.maximum(0, hi_pos - sliding_window + 1)
    if attention_chunk_size is not None:
        (first_lo, first_hi), (last_lo, last_hi) = (chunk_bounds(p, attention_chunk_size)
                                                    for p in (lo_pos, hi_pos))
        key_lo, key_hi = jnp.maximum(key_lo, first_lo), jnp.minimum(key_hi, last_hi)
        all_lo, all_hi = jnp.maximum(all_lo, last_lo), jnp.minimum(all_hi, first_hi)
    key_hi = jnp.maximum(key_hi, 0)
    key_lo = jnp.minimum(key_lo, key_hi)
    t_lo = key_lo // block_kv
    t_hi = jnp.where(key_hi > key_lo, (key_hi + block_kv - 1) // block_kv, t_lo)
    return t_lo, t_hi, key_lo, key_hi, all_lo, all_hi


def group_queries(q, kv_heads: int, *, rows_pad: int | None = None,
                  head_dim_pad: int | None = None):
    """``q [batch, q_len, q_heads, head_dim]`` as ``[batch, kv_heads, rows, head_dim]``: the
    ``rows = q_len * group`` query rows of each kv head's GQA group, query-major (row ``r``
    is query ``r // group``, head ``r % group`` of the group), zero-padded to ``rows_pad``
    rows and ``head_dim_pad`` columns when given."""
    batch, q_len, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    rows = q_len * group
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(batch, kv_heads, rows, head_dim)
    pad_rows, pad_cols = (rows_pad or rows) - rows, (head_dim_pad or head_dim) - head_dim
    if pad_rows or pad_cols:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, pad_rows), (0, pad_cols)))
    return qg


def ungroup_queries(out, *, q_len: int, q_heads: int, head_dim: int):
    """The inverse of :func:`group_queries`: ``out [batch, kv_heads, >= rows, >= head_dim]``
    (padding rows and columns dropped) as ``[batch, q_len, q_heads, head_dim]``."""
    batch, kv_heads, rows_pad, head_dim_pad = out.shape
    group = q_heads // kv_heads
    if rows_pad > q_len * group or head_dim_pad > head_dim:
        out = out[:, :, :q_len * group, :head_dim]
    out = out.reshape(batch, kv_heads, q_len, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, q_len, q_heads, head_dim)


def explicit_positions(q_positions, kv_lengths, *, batch, q_len, kv_len):
    """The flash kernels' ``(positions, lengths)``: int32 ``[batch, q_len]`` and ``[batch]``.

    ``lengths`` are ``kv_lengths`` clamped to ``[0, kv_len]`` (how traced lengths outside
    it act, by the attention contract), else ``kv_len``; ``positions`` are
    ``q_positions``, else bottom-right per sequence at the clamped lengths (the last query
    sits at the last valid key: ``lengths[b] - q_len + t``), clamped to
    ``[-POS_LIMIT, POS_LIMIT]``.
    """
    if kv_lengths is None:
        lengths = jnp.full((batch,), kv_len, jnp.int32)
    else:
        lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, kv_len)
    if q_positions is None:
        positions = lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)
    else:
        positions = jnp.clip(q_positions.astype(jnp.int32), -POS_LIMIT, POS_LIMIT)
    return positions, lengths


def explicit_reference(q, k, v, positions, lengths, sinks=None, *, scale, causal,
                       sliding_window, logits_soft_cap, attention_chunk_size=None):
    """:func:`forge_jax.ops.attention.attention_reference` with explicit positions and
    lengths (and the sinks, when given), the operands of the flash kernels' forward
    functions."""
    return attention_reference(q, k, v, scale=scale, causal=causal, q_positions=positions,
                               kv_lengths=lengths, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, sinks=sinks,
                               attention_chunk_size=attention_chunk_size)


def flash_attention_call(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A flash kernel's entry point, from its forward function ``forward(q, k, v,
    positions, lengths, *, scale, causal, sliding_window, logits_soft_cap, **knobs)``.

    Returns ``fn(q, k, v, *, scale, causal, q_positions, kv_lengths, sliding_window,
    logits_soft_cap, sinks=None, attention_chunk_size=None, **knobs)`` (the op's arguments,
    the kernel's launch knobs; ``forward`` takes float32 ``sinks`` as a sixth operand and
    ``attention_chunk_size=`` only when they are given): the call
    with the contract's explicit positions and lengths (:func:`explicit_positions`), the
    window clamped to :data:`POS_LIMIT` and the default scale, differentiable in q, k, v
    through the XLA reference's VJP (:func:`explicit_reference`, which materialises the
    ``[batch, heads, q_len, kv_len]`` probabilities and keeps hidden NaN/inf K/V slots out of
    every gradient itself).
    """
    differentiable = with_reference_vjp(forward, explicit_reference, static=(
        "scale", "causal", "sliding_window", "logits_soft_cap", "attention_chunk_size"))

    def call(q, k, v, *, scale, causal, q_positions, kv_lengths, sliding_window,
             logits_soft_cap, sinks=None, attention_chunk_size=None, **knobs):
        batch, q_len, _, head_dim = q.shape
        window = None if sliding_window is None else min(int(sliding_window), POS_LIMIT)
        # Sinks (float32, an operand: differentiated) and the chunk size reach the forward
        # function only when given, so that kernels that read neither keep their signature.
        extra = () if sinks is None else (jnp.asarray(sinks).astype(jnp.float32),)
        if attention_chunk_size is not None:
            knobs["attention_chunk_size"] = min(int(attention_chunk_size), POS_LIMIT)
        with jax.named_scope("flash_attention"):
            positions, lengths = explicit_positions(q_positions, kv_lengths, batch=batch,
                                                    q_len=q_len, kv_len=k.shape[1])
            return differentiable(
                q, k, v, positions, lengths, *extra,
                scale=float(head_dim ** -0.5 if scale is None else scale), causal=causal,
                sliding_window=window, logits_soft_cap=logits_soft_cap, **knobs)

    return call


def merge_splits(o, m, l_sum, sinks=None):
    """Combines a split-K kernel's partial results ``o [..., splits, rows, head_dim]`` and
    ``m, l_sum [..., splits, rows]`` (unnormalised float32 output, running max and sum of
    each split) with logsumexp weights: ``[..., rows, head_dim]``, normalised. A row that
    saw no key gets zeros; NaN propagates.

    ``sinks`` (float32 ``[..., rows]``, each row's head's sink logit) join as one more
    split that saw a single key of logit ``sink`` and value zero: they weigh in the sum
    only (the attention sinks of :mod:`forge_jax.ops.attention`)."""
    if sinks is not None:
        sink = jnp.where(jnp.isposinf(sinks), jnp.nan, sinks)[..., None, :]
        o = jnp.concatenate([o, jnp.zeros(o.shape[:-3] + (1,) + o.shape[-2:], o.dtype)], -3)
        m = jnp.concatenate([m, jnp.broadcast_to(sink, m.shape[:-2] + (1, m.shape[-1]))], -2)
        # A row that saw no key keeps zeros (its sink's weight meets an empty sum).
        seen = jnp.any(l_sum > 0, axis=-2, keepdims=True) | jnp.any(m != m, axis=-2,
                                                                     keepdims=True)
        l_sum = jnp.concatenate([l_sum, jnp.where(seen, 1.0, 0.0)], -2)
    m_max = m.max(axis=-2)
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - jnp.expand_dims(m_safe, -2))  # [..., splits, rows]
    total = (w * l_sum).sum(axis=-2)
    out = (w[..., None] * o).sum(axis=-3)
    return jnp.where(total[..., None] == 0, 0.0, out / total[..., None])
