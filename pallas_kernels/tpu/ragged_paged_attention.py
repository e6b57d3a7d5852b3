"""Pallas TPU (Mosaic) kernel: ragged paged attention, one launch for a mixed batch.

The grid runs over ``(kv_head, query block)``. A query block is ``block_q`` consecutive
rows of the packed queries, taken for the ``g = q_heads // kv_heads`` query heads of one
kv head at once (``g * block_q`` rows of one matmul). It visits the sequences whose rows
it holds (the first and last are found by XLA before the launch and scalar-prefetched,
with ``cu_q_lens``, ``kv_lengths`` and the block tables), and for each one only the kv
blocks (``pages_per_block`` pages) its rows can see, copied HBM -> VMEM with double-buffered
async copies, page ids clamped into the pool. The softmax is online, in float32; rows of
other sequences and padding rows are masked, so a row's state is touched only by its own
sequence and padding rows end at zero.

Values a row does not see never reach it: logits are masked by selection, and values are
used with their non-finite entries zeroed. A page id a sequence uses that names no page of
the pool (traced block tables cannot be checked) is read as page 0 and its slots are
masked like any hidden slot: it reads nothing (the index contract of
:mod:`forge_jax.ops.paged`); lengths past the block table are clamped to it before the
launch. Should a block hold a non-finite value some row
sees (rare: real caches hold finite data), a masked count of them makes exactly the rows and
columns that read it NaN, as the attention contract asks.

Folded pools (``fold > 1``, :mod:`forge_jax.ops.kv_fold`, what the cache stores on TPU for
head_dim 64) are read as stored, ``[page_size // fold, 128]`` rows of ``fold`` tokens, the
way :mod:`forge_jax.pallas_kernels.tpu.paged_attention` reads them (queries in ``fold`` row
blocks, one per lane group; outputs summed over the groups by the wrapper).

Op: :func:`forge_jax.ops.ragged.ragged_paged_attention`; reference: its XLA implementation
:func:`forge_jax.ops.ragged.ragged_paged_attention_xla`. Tests:
``tests/test_pallas_tpu_ragged.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}


# Mosaic tiles the last two dimensions of a VMEM array by (8, 128) 32-bit words, and packs
# two bfloat16 values per word along the second-last: (16, 128) for bfloat16.


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: packed query rows per grid step (the wrapper takes a power
    of two no larger than the rows need) and keys per kv step (rounded down to whole
    pages)."""

    block_q: int
    kv_block: int


# The defaults per TPU generation (:func:`_common.per_generation`; the interpreter's small
# blocks keep its per-step work, and the tests, short). Untuned, pending measurements on TPU
# hardware.
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_q=32, kv_block=256), v5p=dict(block_q=32, kv_block=512),
    v6e=dict(block_q=64, kv_block=512), interpret=dict(block_q=16, kv_block=32),
    default=dict(block_q=32, kv_block=256))


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tuned knobs on ``device_kind`` (the same for any arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def _kernel(
    # Scalar prefetch (SMEM).
    seq_range_ref,  # [2 * q_blocks]: first and last sequence of each query block
    cu_ref,  # [max_seqs + 1]
    kv_len_ref,  # [max_seqs]
    tables_ref,  # [max_seqs * pages_per_seq], flattened (SMEM pads 2-D arrays heavily)
    # Inputs.
    q_ref,  # [g, block_q, head_dim] (VMEM block)
    k_hbm,  # [kv_heads, num_pages, page_size, head_dim] (HBM)
    v_hbm,
    # Quantized pools only: ks_hbm, vs_hbm [kv_heads, num_pages, page_size, 1] f32 scales
    # (HBM), beside int8/fp8 k_hbm, v_hbm. Then the output, o_ref [g, block_q, head_dim].
    # Scratch: k_buf, v_buf [2, pages_per_block, page_size, head_dim]; quantized pools only:
    # ks_buf, vs_buf [2, pages_per_block, page_size, 1]; sems, DMA [pools, 2]: (k, v[, ks,
    # vs]) x buffer slot; m_ref, l_ref [g * block_q, 128] f32, the running max and sum
    # (lane-replicated); acc_ref [g * block_q, head_dim] f32; bad_ref [g * block_q,
    # head_dim] f32, non-finite values seen. With sinks, sink_ref [g, 128] f32 (after the
    # scales): the sink logit of each query head of the group, lane-replicated.
    *refs,
    scale,
    sliding_window,
    logits_soft_cap,
    pages_per_seq,
    num_pages,
    quantized,
    fold,
    attention_chunk_size=None,
    has_sinks=False,
):
    # Folded pools (fold > 1, forge_jax.ops.kv_fold): pages of [page_size // fold, 128] rows
    # of `fold` consecutive tokens, read as stored; q_ref is [fold * g, block_q, 128], its
    # row block r holding the queries in lane group r (zeros elsewhere), so that a product
    # with a folded row gives the logit of its token r; acc_ref, bad_ref and o_ref are
    # [.., 128]: lane group r collects the tokens r (the wrapper sums the groups).
    sink_ref = None
    if has_sinks:
        at = 2 if quantized else 0
        sink_ref, refs = refs[at], refs[:at] + refs[at + 1:]
    if quantized:
        (ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_ref, l_ref, acc_ref,
         bad_ref) = refs
        pools = ((k_hbm, k_buf), (v_hbm, v_buf), (ks_hbm, ks_buf), (vs_hbm, vs_buf))
    else:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref, bad_ref = refs
        pools = ((k_hbm, k_buf), (v_hbm, v_buf))
    h, qb = pl.program_id(0), pl.program_id(1)
    groups, block_q, lanes = o_ref.shape
    head_dim = lanes // fold
    rows = groups * block_q
    pages_per_block, page_size = k_buf.shape[1], k_buf.shape[2] * fold
    kv_block = pages_per_block * page_size
    kv_rows = kv_block // fold  # stored rows per kv block
    capacity = pages_per_seq * page_size
    r0 = qb * block_q

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    bad_ref[...] = jnp.zeros(bad_ref.shape, jnp.float32)

    q = q_ref[...].reshape(fold * rows, lanes)  # row = head_in_group * block_q + token
    # Quantized pools are dequantized to float32 in VMEM: float32 products then.
    f32 = q.dtype == jnp.float32 or k_buf.dtype == jnp.float32 or quantized
    if f32:
        q = q.astype(jnp.float32)
    precision = jax.lax.Precision.HIGHEST if f32 else None
    # Absolute packed row of each matmul row (a mask, not a vector remainder, for the
    # power-of-two blocks the wrapper picks).
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_rows), 0)
    row = r0 + (row & (block_q - 1) if block_q & (block_q - 1) == 0 else
                jax.lax.rem(row, block_q))
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_rows), 1) * fold
    # The key (in the block) of each stored element: row * fold + lane // head_dim.
    lane = jax.lax.broadcasted_iota(jnp.int32, (kv_rows, lanes), 1)
    key_col = jax.lax.broadcasted_iota(jnp.int32, (kv_rows, lanes), 0) * fold
    for r in range(1, fold):
        key_col = key_col + jnp.where(lane >= r * head_dim, 1, 0)
    if fold > 1:  # [fold * rows, lanes]: row block r is 1 in lane group r (like q)
        i = jax.lax.broadcasted_iota(jnp.int32, (fold * rows, lanes), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (fold * rows, lanes), 1)
        lane_groups = functools.reduce(operator.add, [
            jnp.where((i >= r * rows) & (i < (r + 1) * rows) & (j >= r * head_dim)
                      & (j < (r + 1) * head_dim), 1.0, 0.0) for r in range(fold)])
        out_lane = jax.lax.broadcasted_iota(jnp.int32, (rows, lanes), 1)

    def chunk_start(p):
        # The first key of position p's chunk (positions a row sees keys from are >= 0;
        # below 0 a row sees nothing whatever this gives).
        c = attention_chunk_size
        if c & (c - 1) == 0:
            return p & ~(c - 1)  # floor for either sign
        return p - jax.lax.rem(p, c)

    def in_group(r, x):  # x [rows, lanes] with the lanes of other tokens zeroed
        if fold == 1:
            return x
        return jnp.where((out_lane >= r * head_dim) & (out_lane < (r + 1) * head_dim), x, 0.0)

    def named(seq, kb, key):
        # Whether each key of kv block kb (its index in the block: `key`) lies on a page of
        # the pool: a page id outside it reads nothing. Comparisons against scalar bounds.
        mask = jnp.zeros(key.shape, jnp.bool_)
        for p in range(pages_per_block):
            t = jnp.minimum(kb * pages_per_block + p, pages_per_seq - 1)
            page = tables_ref[seq * pages_per_seq + t]
            start = jnp.where((page >= 0) & (page < num_pages), p * page_size, kv_block)
            mask |= (key >= start) & (key < (p + 1) * page_size)
        return mask

    def copies(seq, kb, slot):
        out = []
        for p in range(pages_per_block):
            # Entries past the table or the pool are clamped; their keys are masked (named).
            t = jnp.minimum(kb * pages_per_block + p, pages_per_seq - 1)
            page = jnp.clip(tables_ref[seq * pages_per_seq + t], 0, num_pages - 1)
            for i, (pool, buf) in enumerate(pools):
                out.append(pltpu.make_async_copy(pool.at[h, page], buf.at[slot, p],
                                                 sems.at[i, slot]))
        return out

    def attend_sequence(seq, _):
        start, end = cu_ref[seq], cu_ref[seq + 1]
        kv_len = kv_len_ref[seq]
        kv_end = jnp.minimum(kv_len, capacity)  # keys beyond the block table do not exist
        a, b = jnp.maximum(start, r0), jnp.minimum(end, r0 + block_q)  # its rows here
        first_pos, last_pos = kv_len - (end - a), kv_len - (end - (b - 1))
        lo = jnp.int32(0)
        if sliding_window is not None:
            lo = jnp.maximum(first_pos - sliding_window + 1, 0)
        if attention_chunk_size is not None:  # the first row's chunk starts the keys
            lo = jnp.maximum(lo, chunk_start(first_pos))
        hi = jnp.minimum(last_pos + 1, kv_end)
        kb0 = jax.lax.div(lo, kv_block)  # lo >= 0
        kb1 = jnp.where((b > a) & (hi > lo), jax.lax.div(hi + kv_block - 1, kv_block), kb0)

        pos = kv_len - (end - row)
        in_seq = (row >= a) & (row < b)
        if attention_chunk_size is not None:
            pos_chunk = chunk_start(pos)

        @pl.when(kb1 > kb0)
        def _():
            for c in copies(seq, kb0, 0):
                c.start()

        def kv_step(kb, _):
            slot = jax.lax.rem(kb - kb0, 2)
            for c in copies(seq, kb, slot):
                c.wait()

            @pl.when(kb + 1 < kb1)
            def _():
                for c in copies(seq, kb + 1, 1 - slot):
                    c.start()

            k = k_buf[slot].reshape(kv_rows, lanes)
            v = v_buf[slot].reshape(kv_rows, lanes)
            if quantized:  # a scale per key row; a hidden slot's (NaN) is masked below
                k = k.astype(jnp.float32) * ks_buf[slot].reshape(kv_block, 1)
                v = v.astype(jnp.float32) * vs_buf[slot].reshape(kv_block, 1)
            if fold > 1:
                # A row's zero query lanes times a neighbour token's NaN or inf would spoil
                # a finite token's logit: non-finite keys are zeroed for the product and
                # their tokens' logits made NaN by a second product (in float32: a bfloat16
                # select on this mask does not lower for v6e).
                k32 = k.astype(jnp.float32)
                bad_k = (jnp.abs(k32) == jnp.inf) | (k32 != k32)
                k = jnp.where(bad_k, 0.0, k32).astype(k.dtype)
            if f32:
                k = k.astype(jnp.float32)
            s_all = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                        preferred_element_type=jnp.float32)
            if fold > 1:
                s_all = jnp.where(jax.lax.dot_general(
                    lane_groups, jnp.where(bad_k, 1.0, 0.0), (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32) > 0, jnp.float32(jnp.nan), s_all)
            s_all = s_all * jnp.float32(scale)  # [fold * rows, kv_rows]
            if logits_soft_cap is not None:
                s_all = logits_soft_cap * jnp.tanh(s_all / logits_soft_cap)
            # A +inf logit is NaN data (the contract), not a winner.
            s_all = jnp.where(s_all == jnp.inf, jnp.float32(jnp.nan), s_all)
            logits, visibles = [], []
            for r in range(fold):  # the keys fold * t + r of the block's stored rows t
                s = s_all[r * rows:(r + 1) * rows] if fold > 1 else s_all
                key = kb * kv_block + col + r
                visible = (in_seq & (key <= pos) & (key < kv_end)
                           & named(seq, kb, col + r))
                if sliding_window is not None:
                    visible &= key > pos - sliding_window
                if attention_chunk_size is not None:
                    visible &= key >= pos_chunk
                logits.append(jnp.where(visible, s, -jnp.inf))
                visibles.append(visible)
            m_prev = m_ref[...]
            m_next = functools.reduce(jnp.maximum, [jnp.max(s, axis=1, keepdims=True)
                                                    for s in logits], m_prev)  # [rows, 128]
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)
            probs = [jnp.where(visible, jnp.exp(s - m_safe[:, :1]), 0.0)
                     for s, visible in zip(logits, visibles, strict=True)]
            l_ref[...] = alpha * l_ref[...] + functools.reduce(
                operator.add, [jnp.sum(p, axis=1, keepdims=True) for p in probs])
            m_ref[...] = m_next
            finite = jnp.isfinite(v.astype(jnp.float32))  # Mosaic tests finiteness in float32
            v = jnp.where(finite, v, jnp.zeros((), v.dtype))
            pv = functools.reduce(operator.add, [in_group(r, jax.lax.dot_general(
                p.astype(v.dtype) if not f32 else p, v.astype(jnp.float32) if f32 else v,
                (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32)) for r, p in enumerate(probs)])
            acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv
            # Slots no row of this sequence sees may hold anything; a non-finite value among
            # the others is real data that the rows seeing it must turn into NaN.
            seen_bad = jnp.where((key_col >= lo - kb * kv_block)
                                 & (key_col < hi - kb * kv_block) & ~finite
                                 & named(seq, kb, key_col), 1.0, 0.0)

            @pl.when(jnp.max(seen_bad) > 0)
            def _():
                bad_ref[...] += functools.reduce(operator.add, [in_group(
                    r, jax.lax.dot_general(visible.astype(jnp.float32), seen_bad,
                                           (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32))
                    for r, visible in enumerate(visibles)])

            return ()

        jax.lax.fori_loop(kb0, kb1, kv_step, ())
        return ()

    jax.lax.fori_loop(seq_range_ref[2 * qb], seq_range_ref[2 * qb + 1] + 1, attend_sequence, ())
    total = l_ref[...][:, :1]
    acc = acc_ref[...]
    if has_sinks:
        # Each row's head's sink joins the denominator and weighs no value.
        g_row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        sinks = sink_ref[...]  # [g, 128]
        sink = jnp.zeros((rows, 1), jnp.float32)
        for gi in range(groups):
            sink = jnp.where((g_row >= gi * block_q) & (g_row < (gi + 1) * block_q),
                             sinks[gi:gi + 1, :1], sink)
        m = m_ref[...][:, :1]
        m_next = jnp.maximum(m, sink)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m - m_safe)
        total = correction * total + jnp.exp(sink - m_safe)
        acc = correction * acc
    out = acc / jnp.where(total == 0, 1.0, total)  # a row that saw nothing has acc == 0
    out = jnp.where(bad_ref[...] > 0, jnp.float32(jnp.nan), out)
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def supports(args):
    """``None`` if the kernel lowers for these arguments, else why not (Mosaic constraints)."""
    q, k_pages = args["q"], args["k_pages"]
    pages_ok = _common.FLOAT_DTYPES
    if args.get("k_scales") is not None:  # quantized pools: int8/fp8 values and their scales
        pages_ok = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    for name, x, ok in (("q", q, _common.FLOAT_DTYPES), ("k_pages", k_pages, pages_ok)):
        if jnp.dtype(x.dtype) not in ok:
            return f"{name}.dtype={jnp.dtype(x.dtype).name}: the TPU kernel takes float32 or " \
                   f"bfloat16"
    page_size = k_pages.shape[2]  # a folded pool's stored rows per page (fold tokens each)
    fold = args.get("fold", 1)
    if fold > 1:
        # Folded pages of 8 rows compile for v5e and v6e in bfloat16 and float32 (SmolLM2's
        # heads, pages of 16 tokens; forge_jax.aot, libtpu 0.0.42.1, JAX 0.10.2, 2026-11-25).
        if page_size % 8:
            return (f"page_size={page_size * fold} folded is {page_size} rows of {fold} "
                    "tokens, not a multiple of 8: the pages of a kv block are joined along "
                    "8-row sublane tiles")
        return None
    # Any head_dim: 64, 80 and 192 (and 128) compile for v5e and v6e (forge_jax.aot, JAX
    # 0.10.2, 2026-11-25) and agree with XLA in the interpreter.
    sublanes = max(_common.sublane_tile(x.dtype) for x in (q, k_pages))
    if page_size % sublanes:
        return (f"page_size={page_size} is not a multiple of {sublanes}: the pages of a kv "
                f"block are joined along the {sublanes}-row sublane tiles of "
                f"{jnp.dtype(k_pages.dtype).name}")
    return None


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "block_q", "kv_block", "interpret", "fold",
    "attention_chunk_size"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens, num_seqs,
                           *, scale=None, sliding_window=None, logits_soft_cap=None,
                           block_q=None, kv_block=None, interpret=False, k_scales=None,
                           v_scales=None, fold=1, sinks=None, attention_chunk_size=None):
    """Ragged paged attention (see :func:`forge_jax.ragged_paged_attention`) on TPU.

    Args:
      q: ``[total_tokens, q_heads, head_dim]``.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``; int8/fp8 values of
        quantized pools (:mod:`forge_jax.ops.kv_quant`) with ``k_scales``/``v_scales``.
      block_tables: int ``[max_seqs, pages_per_seq]``.
      kv_lengths: int ``[max_seqs]``.
      cu_q_lens: int ``[max_seqs + 1]``.
      num_seqs: int scalar (may be traced).
      scale, sliding_window, logits_soft_cap, sinks, attention_chunk_size: as for the op.
      block_q: packed query rows per grid step (default: per TPU generation).
      kv_block: keys per kv step, rounded down to whole pages (default: per generation).
      interpret: run in the TPU interpreter (``True``: forge_jax's interpret params).
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]`` for quantized
        pools (copied with their pages, applied in VMEM), else None.
      fold: 1, or the tokens per stored row of folded pools (:mod:`forge_jax.ops.kv_fold`):
        then ``k_pages``, ``v_pages`` are ``[kv_heads, num_pages, page_size // fold, fold *
        head_dim]`` and are read folded, in place.

    Returns:
      ``[total_tokens, q_heads, head_dim]`` in ``q.dtype``.
    """
    total_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, lanes = k_pages.shape
    page_size *= fold  # the logical page
    max_seqs, pages_per_seq = block_tables.shape
    if total_tokens == 0 or max_seqs == 0 or num_pages == 0:
        return jnp.zeros(q.shape, q.dtype)  # no row can see a key
    groups = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    config = default_config({}, _common.device_kind(interpret))
    sublanes = max(_common.sublane_tile(x.dtype) for x in (q, k_pages))
    block_q = block_q or config.block_q
    # A power of two no larger than the rows need (at least one sublane tile).
    block_q = min(block_q, max(sublanes, 1 << (total_tokens - 1).bit_length()))
    pages_per_block = max(1, min((kv_block or config.kv_block) // page_size, pages_per_seq))
    q_blocks = -(-total_tokens // block_q)
    padded = q_blocks * block_q

    cu = cu_q_lens.astype(jnp.int32)
    # Keys beyond the block table do not exist: a longer (traced) length is clamped, and the
    # positions follow it (the index contract of forge_jax.ops.paged).
    kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, pages_per_seq * page_size)
    n = jnp.clip(jnp.asarray(num_seqs).astype(jnp.int32), 0, max_seqs)
    # Each query block's first and last sequence (sequences past num_seqs end "never").
    ends = jnp.where(jnp.arange(max_seqs) < n, cu[1:], jnp.iinfo(jnp.int32).max)
    block_start = jnp.arange(q_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(ends, block_start, side="right")
    last = jnp.minimum(jnp.searchsorted(ends, block_start + block_q - 1, side="right"), n - 1)
    seq_range = jnp.stack([first, last], axis=1).reshape(-1).astype(jnp.int32)

    # [kv_heads, g, padded, head_dim]: a kv head's query heads as one block of rows.
    qt = jnp.pad(q, ((0, padded - total_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(padded, kv_heads, groups, head_dim).transpose(1, 2, 0, 3)
    rows = groups * block_q
    out_shape = jax.ShapeDtypeStruct(qt.shape, q.dtype)
    block = pl.BlockSpec((None, groups, block_q, head_dim), lambda h, b, *_: (h, 0, b, 0))
    q_block = block
    if fold > 1:  # row block r: the queries in lane group r (see _kernel)
        qt = jnp.concatenate([jnp.pad(qt, ((0, 0),) * 3 + ((r * head_dim, lanes - (r + 1)
                                                            * head_dim),))
                              for r in range(fold)], axis=1)  # [kv_heads, fold * g, .., 128]
        q_block = pl.BlockSpec((None, fold * groups, block_q, lanes),
                               lambda h, b, *_: (h, 0, b, 0))
        block = pl.BlockSpec((None, groups, block_q, lanes), lambda h, b, *_: (h, 0, b, 0))
        out_shape = jax.ShapeDtypeStruct((kv_heads, groups, padded, lanes), jnp.float32)
    kernel = functools.partial(
        _kernel, scale=float(scale), sliding_window=sliding_window,
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        pages_per_seq=pages_per_seq, num_pages=num_pages, quantized=k_scales is not None,
        fold=fold, attention_chunk_size=attention_chunk_size, has_sinks=sinks is not None)
    sink_specs, sink_rows = [], []
    if sinks is not None:  # [kv_heads, g, 128]: the group's sinks, lane-replicated
        sink_specs = [pl.BlockSpec((None, groups, _common.LANES), lambda h, b, *_: (h, 0, 0))]
        sink_rows = [jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv_heads, groups, 1),
                                      (kv_heads, groups, _common.LANES))]
    buf, scales, scales_buf = _common.page_buffers(
        k_pages, k_scales, v_scales, pages=pages_per_block, page_size=page_size)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(kv_heads, q_blocks),
            in_specs=[q_block, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY),
                      *(pl.BlockSpec(memory_space=pl.ANY) for _ in scales), *sink_specs],
            out_specs=block,
            scratch_shapes=[
                buf, buf, *(scales_buf for _ in scales),
                pltpu.SemaphoreType.DMA((2 + len(scales), 2)),
                pltpu.VMEM((rows, _common.LANES), jnp.float32),
                pltpu.VMEM((rows, _common.LANES), jnp.float32),
                pltpu.VMEM((rows, lanes), jnp.float32),
                pltpu.VMEM((rows, lanes), jnp.float32),
            ]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_ragged_paged_attention",
        cost_estimate=_cost.attention(
            queries=total_tokens * q_heads, keys=pages_per_seq * page_size, head_dim=head_dim,
            io=(qt, qt, block_tables), kv_bytes=2 * max_seqs * kv_heads * pages_per_seq
            * page_size * (head_dim * k_pages.dtype.itemsize + 4 * bool(scales))),
    )(seq_range, cu, kv_lengths, block_tables.astype(jnp.int32).reshape(-1), qt, k_pages,
      v_pages, *scales, *sink_rows)
    if fold > 1:  # lane group r holds the tokens r of the rows: sum them (small)
        out = out.reshape(kv_heads, groups, padded, fold, head_dim).sum(3).astype(q.dtype)
    return out.transpose(2, 0, 1, 3).reshape(padded, q_heads, head_dim)[:total_tokens]


_registration.register(
    "ragged_paged_attention", ragged_paged_attention, backend="tpu", supports=supports,
    verified=VERIFIED, reads_folded=True, reads_sinks=True, reads_chunks=True,
    description="grid over (kv head, query block), sequences of a block from scalar-prefetched "
                "cu_q_lens, double-buffered page copies, online float32 softmax")
