"""Pallas TPU kernel (Mosaic): paged attention for decode and short chunks of new tokens.

Grid ``(batch, kv_heads)``: each program takes the query rows of one GQA group of one
sequence (``q_len * group`` rows, query-major, padded to a sublane tile) and walks the
sequence's pages through its block table, ``pages_per_compute_block`` pages per compute
block, with an online softmax in float32. The block tables and the key range of each
sequence are scalar-prefetched into SMEM; the pools stay in HBM (``memory_space=ANY``)
and each block's pages are copied into VMEM with asynchronous copies, double-buffered:
block ``i + 1`` is in flight while block ``i`` is computed. Only the blocks that hold a
key some query of the sequence sees are copied (none past the length or the last query's
position, none before the first query's window).

Invisible keys never reach the output (the attention contract of
:mod:`forge_jax.ops.attention`): their logits are hidden by ``where`` and, since a zero
probability does not hide a NaN value (``0 * NaN = NaN``), their values are zeroed. In
decode every row sees exactly the copied range ``[lo, hi)``, so the values are zeroed
outside it. With several queries a slot inside the range may be hidden from some rows
(the causal mask of an earlier query, the window of a later one): non-finite values leave
the ``p @ v`` product there and a second product marks NaN the output columns of exactly
the rows that see one.

Mosaic constraints (checked by :func:`supports`): a block of pages is reshaped to
``[pages * page_size, head_dim]``, kept to ``page_size`` a multiple of the sublane tile (8
rows for float32, 16 for bfloat16; a rule not yet re-checked against libtpu's compiler,
which accepts bfloat16 pages of 8); TPUs have no float16 vector unit. Any ``head_dim``:
the head_dim % 128 rule this kernel once had was not libtpu's (64, 80 and 192 compile for
v5e and v6e through :func:`forge_jax.aot.compile`), and the pools are read in place, never
padded.

Folded pools (``fold > 1``, :mod:`forge_jax.ops.kv_fold`: what the cache stores on TPU for
head_dim 64, where XLA lays a 64-wide pool out pages-minor and a row-major read copied it
per step): a page is ``[page_size // fold, 128]``, ``fold`` consecutive tokens side by
side, and is read as stored, without lane slices. The queries come in ``fold`` row blocks,
block ``r`` holding them in lane group ``r``, so one product gives every token's logit;
the values' product is masked to each token's lane group and the wrapper sums the groups
(a ``[rows, 128]`` output per head). Non-finite keys are zeroed for the product (a zero
query lane times a neighbour's NaN would spoil a finite token) and their own logits set to
NaN by a second product.

A table entry of -1 (:func:`~forge_jax.pallas_kernels._attention_common.paged_ranges`
writes it for an entry past the sequence's pages or one that names no page of the pool)
copies nothing, and its slots are hidden from every row like the slots outside ``[lo,
hi)``: an out-of-range entry reads nothing (the index contract of
:mod:`forge_jax.ops.paged`).

Block tables are scalar-prefetched whole (``batch * max_pages`` int32 in SMEM), as in JAX's
own TPU paged attention: very large batches times table widths can exceed SMEM.

Op: :func:`forge_jax.ops.paged.paged_attention`; reference: its XLA implementation
:func:`forge_jax.ops.paged.paged_attention_xla`. Tests: ``tests/test_pallas_tpu_paged.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _cost, _registration
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}

MAX_Q_LEN = 16

@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch parameter: keys per compute block; the wrapper's
    ``pages_per_compute_block`` is ``block_k // page_size``, at least one page and at most
    the block table's width (:func:`default_pages_per_compute_block`)."""

    block_k: int


# The defaults per TPU generation (:func:`_common.per_generation`). Untuned, pending
# measurements on TPU hardware.
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_k=256), v5p=dict(block_k=512), v6e=dict(block_k=512),
    default=dict(block_k=256))


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tuned launch parameter on ``device_kind`` (the same for any arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def default_pages_per_compute_block(page_size: int, max_pages: int,
                                    device_kind: str | None = None) -> int:
    """Pages per compute block for pages of ``page_size`` and tables ``max_pages`` wide."""
    config = default_config({}, device_kind)
    return max(1, min(max_pages, config.block_k // page_size))


def _sum(xs):
    return functools.reduce(operator.add, xs)


def _kernel(tables_ref, lo_ref, hi_ref,  # scalar prefetch (SMEM)
            q_ref, pos_ref, k_hbm, v_hbm,  # inputs
            *refs,  # [ks_hbm, vs_hbm,] o_ref, k_buf, v_buf, [ks_buf, vs_buf,] sems
            pages_per_compute_block, max_pages, scale, sliding_window, logits_soft_cap,
            exact_range, quantized, fold, chunked=False, has_sinks=False):
    # tables_ref [batch * max_pages], -1 where no page is named; lo_ref, hi_ref [batch]: the
    # keys any row of sequence b sees lie in [lo, hi) (exactly the keys every row sees when
    # exact_range).
    # q_ref [rows, head_dim]; pos_ref [rows, 1]; k_hbm, v_hbm [kv_heads, num_pages, page_size,
    # head_dim] in HBM; o_ref [rows, head_dim]; k_buf, v_buf [2, pages, page_size, head_dim].
    # Quantized pools: k_hbm, v_hbm hold int8/fp8 values and ks_hbm, vs_hbm [kv_heads,
    # num_pages, page_size, 1] their float32 scales, copied page by page beside them into
    # ks_buf, vs_buf [2, pages, page_size, 1] and applied in VMEM (a scale per key row).
    # Folded pools (fold > 1, forge_jax.ops.kv_fold): the pages are [page_size // fold, 128]
    # rows holding `fold` consecutive tokens side by side, read as stored (no lane slice):
    # q_ref is [fold * rows, 128], row block r holding the queries in lanes [r * head_dim,
    # (r + 1) * head_dim) and zeros elsewhere, so its product with a folded row is the logit
    # of the row's token r; o_ref [rows, 128] collects in lane group r the values of the
    # tokens r of the rows (the wrapper sums the groups).
    # Chunked attention: chunk_ref [rows, 1], the first key of each row's chunk; sinks:
    # sink_ref [rows, 1], each row's head's sink logit (both after the pools' scales).
    at = 2 if quantized else 0
    chunk_ref = refs[at] if chunked else None
    sink_ref = refs[at + int(chunked)] if has_sinks else None
    refs = refs[:at] + refs[at + int(chunked) + int(has_sinks):]
    if quantized:
        ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems = refs
        pools = ((k_hbm, k_buf, 0), (v_hbm, v_buf, 1), (ks_hbm, ks_buf, 2), (vs_hbm, vs_buf, 3))
    else:
        o_ref, k_buf, v_buf, sems = refs
        pools = ((k_hbm, k_buf, 0), (v_hbm, v_buf, 1))
    b, h = pl.program_id(0), pl.program_id(1)
    rows, lanes = o_ref.shape
    head_dim = lanes // fold
    page_size = k_buf.shape[2] * fold
    block_k = pages_per_compute_block * page_size
    block_rows = block_k // fold  # stored rows per block
    lo, hi = lo_ref[b], hi_ref[b]
    # lax.div/rem, not // and %: both operands are non-negative, and the floor of a
    # possibly negative quotient lowers through sign, which Mosaic cannot lower everywhere.
    first = lax.div(lo, block_k)
    last = lax.div(hi + block_k - 1, block_k)

    def page_copy(block, slot, i, method):
        # Only the pages that hold a key in [lo, hi) are copied (the first and last blocks
        # may be partly outside); the slots of the others keep stale data, which the masks
        # keep out of the output like any other invisible slot.
        entry = block * pages_per_compute_block + i
        page = tables_ref[b * max_pages + entry]

        @pl.when((entry * page_size < hi) & ((entry + 1) * page_size > lo) & (page >= 0))
        def _():
            for pool, buf, sem in pools:
                copy = pltpu.make_async_copy(pool.at[h, page], buf.at[slot, i],
                                             sems.at[sem, slot])
                getattr(copy, method)()

    def each_copy(block, slot, method):
        for i in range(pages_per_compute_block):
            page_copy(block, slot, i, method)

    def named(block, key):
        # Whether each key of the block (its index in the block: `key`) lies on a page its
        # entry names: a -1 entry's slots are hidden, their buffer holds stale data.
        # Comparisons against scalar bounds, not a vector division by page_size.
        mask = jnp.zeros(key.shape, jnp.bool_)
        for i in range(pages_per_compute_block):
            page = tables_ref[b * max_pages + block * pages_per_compute_block + i]
            start = jnp.where(page >= 0, i * page_size, block_k)  # block_k: no key
            mask |= (key >= start) & (key < (i + 1) * page_size)
        return mask

    @pl.when(first < last)
    def _():
        each_copy(first, 0, "start")

    q = q_ref[...]
    pos = pos_ref[...]  # [rows, 1]
    # The token (of `fold`) each lane of a stored row holds: lane // head_dim, as compares.
    lane = lax.broadcasted_iota(jnp.int32, (block_rows, lanes), 1)
    lane_token = _sum([jnp.where(lane >= r * head_dim, 1, 0) for r in range(1, fold)]
                      ) if fold > 1 else None
    if fold > 1:  # [fold * rows, lanes]: row block r is 1 in lane group r (like q_ref)
        i = lax.broadcasted_iota(jnp.int32, (fold * rows, lanes), 0)
        l_ = lax.broadcasted_iota(jnp.int32, (fold * rows, lanes), 1)
        lane_groups = _sum([jnp.where((i >= r * rows) & (i < (r + 1) * rows)
                                      & (l_ >= r * head_dim) & (l_ < (r + 1) * head_dim),
                                      1.0, 0.0) for r in range(fold)])

    def body(block, carry):
        o, m, l_sum = carry
        slot = lax.rem(block - first, 2)

        @pl.when(block + 1 < last)
        def _():
            each_copy(block + 1, 1 - slot, "start")

        each_copy(block, slot, "wait")
        k = k_buf[slot].reshape(block_rows, lanes)
        if quantized:
            k = k.astype(jnp.float32) * ks_buf[slot].reshape(block_k, 1)
        if fold > 1:
            # A row's zero query lanes times a neighbour token's NaN or inf would spoil the
            # logits of a finite token: non-finite keys are zeroed for the product, and
            # their tokens' logits made NaN by a second product (as q . k would be).
            # (In float32: a bfloat16 select on this mask does not lower for v6e.)
            k32 = k.astype(jnp.float32)
            bad_k = (jnp.abs(k32) == jnp.inf) | (k32 != k32)
            k = jnp.where(bad_k, 0.0, k32).astype(k.dtype)
        qk = q
        if q.dtype != k.dtype:
            qk, k = q.astype(jnp.float32), k.astype(jnp.float32)
        s_all = lax.dot_general(qk, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
        if fold > 1:
            bad_s = lax.dot_general(lane_groups, jnp.where(bad_k, 1.0, 0.0),
                                    (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            s_all = jnp.where(bad_s > 0, jnp.nan, s_all)
        if logits_soft_cap is not None:
            s_all = logits_soft_cap * jnp.tanh(s_all / logits_soft_cap)
        # Per token r of a stored row: logits [rows, block_rows] of the keys fold * t + r.
        row = lax.broadcasted_iota(jnp.int32, (rows, block_rows), 1)
        logits, visibles = [], []
        for r in range(fold):
            s = s_all[r * rows:(r + 1) * rows] if fold > 1 else s_all
            key = row * fold + r if fold > 1 else row
            j = block * block_k + key
            visible = (j <= pos) & (j < hi) & named(block, key)
            if sliding_window is not None:
                visible &= j > pos - sliding_window
            if chunked:
                visible &= j >= chunk_ref[...]
            # where, not a bias: keys no row may see can hold NaN or inf.
            logits.append(jnp.where(visible, s, -jnp.inf))
            visibles.append(visible)
        m_next = functools.reduce(jnp.maximum, [s.max(axis=1, keepdims=True) for s in logits],
                                  m)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
        probs = [jnp.exp(s - m_safe) for s in logits]
        correction = jnp.exp(m - m_safe)
        l_sum = correction * l_sum + _sum([p.sum(axis=1, keepdims=True) for p in probs])
        v = v_buf[slot].reshape(block_rows, lanes).astype(jnp.float32)
        if quantized:
            v = v * vs_buf[slot].reshape(block_k, 1)
        v_key = lax.broadcasted_iota(jnp.int32, (block_rows, lanes), 0) * fold
        if fold > 1:
            v_key = v_key + lane_token
        jv = block * block_k + v_key
        named_v = named(block, v_key)
        if exact_range:  # every row sees exactly [lo, hi) on named pages: zero the rest
            v = jnp.where((jv >= lo) & (jv < hi) & named_v, v, 0.0)
        else:  # a slot in range may be hidden from some rows: non-finite values leave p @ v
            nonfinite = (jnp.abs(v) == jnp.inf) | (v != v)
            v = jnp.where(nonfinite, 0.0, v)
            flags = jnp.where(nonfinite & (jv >= lo) & (jv < hi) & named_v, 1.0, 0.0)
        pv_dtype = q_ref.dtype if q_ref.dtype == k_buf.dtype else jnp.float32
        out_lane = lax.broadcasted_iota(jnp.int32, (rows, lanes), 1)
        in_group = lambda r, x: x if fold == 1 else jnp.where(  # noqa: E731
            (out_lane >= r * head_dim) & (out_lane < (r + 1) * head_dim), x, 0.0)
        pv = _sum([in_group(r, lax.dot_general(p.astype(pv_dtype), v.astype(pv_dtype),
                                               (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32))
                   for r, p in enumerate(probs)])  # [rows, lanes]
        o = correction * o + pv
        if not exact_range:
            hits = _sum([in_group(r, lax.dot_general(jnp.where(visible, 1.0, 0.0), flags,
                                                     (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32))
                         for r, visible in enumerate(visibles)])
            o = jnp.where(hits > 0, jnp.nan, o)
        return o, m_next, l_sum

    init = (jnp.zeros((rows, lanes), jnp.float32),
            jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    o, m, l_sum = lax.fori_loop(first, last, body, init)
    if has_sinks:  # the sink joins the denominator and weighs no value
        sink = sink_ref[...]  # [rows, 1]
        m_next = jnp.maximum(m, sink)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m - m_safe)
        o, l_sum = correction * o, correction * l_sum + jnp.exp(sink - m_safe)
    o_ref[...] = jnp.where(l_sum == 0, 0.0, o / l_sum).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "pages_per_compute_block", "interpret",
    "fold", "attention_chunk_size"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                    q_positions=None, sliding_window=None, logits_soft_cap=None,
                    pages_per_compute_block=None, interpret=False, k_scales=None,
                    v_scales=None, fold=1, sinks=None, attention_chunk_size=None):
    """Paged attention (see :func:`forge_jax.paged_attention` for the contract).

    Args:
      q: ``[batch, q_heads, head_dim]`` or ``[batch, q_len, q_heads, head_dim]``,
        float32/bfloat16.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, float32/bfloat16;
        or int8/fp8 values of quantized pools (:mod:`forge_jax.ops.kv_quant`).
      fold: 1, or the tokens per stored row of folded pools (:mod:`forge_jax.ops.kv_fold`):
        then ``k_pages``, ``v_pages`` are ``[kv_heads, num_pages, page_size // fold, fold *
        head_dim]`` and are read folded, in place.
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]`` for quantized
        pools (copied with their pages, applied in VMEM), else None.
      block_tables: int ``[batch, max_pages]``; entries past a sequence's pages may hold
        anything.
      lengths: int ``[batch]``, tokens in the cache per sequence, new ones included.
      scale, q_positions, sliding_window, logits_soft_cap, sinks, attention_chunk_size: as
        in the op.
      pages_per_compute_block: pages per K/V block (default from :data:`TUNED`).
      interpret: run in the TPU interpreter (any platform).

    Returns:
      The shape of ``q``, in ``q.dtype``.
    """
    decode = q.ndim == 3
    if decode:
        q = q[:, None]
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, lanes = k_pages.shape
    page_size *= fold  # the logical page
    max_pages = block_tables.shape[1]
    group = q_heads // kv_heads
    if pages_per_compute_block is None:
        pages_per_compute_block = default_pages_per_compute_block(
            page_size, max_pages, _common.device_kind(interpret))
    if pages_per_compute_block < 1:
        raise ValueError(f"{pages_per_compute_block=} must be positive")
    num_blocks = -(-max_pages // pages_per_compute_block)
    table_width = num_blocks * pages_per_compute_block
    rows = q_len * group
    rows_pad = -(-rows // _common.sublane_tile(q.dtype)) * _common.sublane_tile(q.dtype)
    if scale is None:
        scale = head_dim ** -0.5

    with jax.named_scope("paged_attention"):
        # Small per-sequence bookkeeping in XLA; the pools are only read by the kernel.
        window, key_lo, key_hi, row_pos, tables = _attention_common.paged_ranges(
            q_positions, lengths, block_tables, q_len=q_len, group=group, rows_pad=rows_pad,
            page_size=page_size, num_pages=num_pages, sliding_window=sliding_window,
            table_width=table_width)
        extra_specs, extra = [], []
        if attention_chunk_size is not None:
            size = min(int(attention_chunk_size), _attention_common.POS_LIMIT)
            starts = jnp.floor_divide(row_pos, size) * size  # [batch, rows_pad]
            real = jnp.arange(rows_pad)[None, :] < rows
            key_lo = jnp.minimum(jnp.maximum(key_lo, jnp.where(
                real, starts, _attention_common.POS_LIMIT).min(axis=1)), key_hi)
            extra_specs.append(pl.BlockSpec((None, rows_pad, 1), lambda b, h, *_: (b, 0, 0)))
            extra.append(starts[..., None])
        if sinks is not None:  # [kv_heads, rows_pad, 1]: row r reads head h * group + r % group
            row_sinks = jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, 1, group),
                                 (1, q_len, 1)).reshape(kv_heads, rows)
            row_sinks = jnp.pad(row_sinks, ((0, 0), (0, rows_pad - rows)))
            extra_specs.append(pl.BlockSpec((None, rows_pad, 1), lambda b, h, *_: (h, 0, 0)))
            extra.append(row_sinks[..., None])
        row_pos = row_pos[..., None]  # [batch, rows_pad, 1]
        tables = tables.reshape(-1)
        qg = _attention_common.group_queries(q, kv_heads, rows_pad=rows_pad)
        if fold > 1:  # row block r: the queries in lane group r (see _kernel)
            qg = jnp.concatenate([jnp.pad(qg, ((0, 0),) * 3 + ((r * head_dim, lanes - (r + 1)
                                                                * head_dim),))
                                  for r in range(fold)], axis=2)

        kernel = functools.partial(
            _kernel, pages_per_compute_block=pages_per_compute_block, max_pages=table_width,
            scale=float(scale), sliding_window=window, logits_soft_cap=logits_soft_cap,
            exact_range=q_len == 1, quantized=k_scales is not None, fold=fold,
            chunked=attention_chunk_size is not None, has_sinks=sinks is not None)
        buf, scales, scales_buf = _common.page_buffers(
            k_pages, k_scales, v_scales, pages=pages_per_compute_block, page_size=page_size)
        out = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=(batch, kv_heads),
                in_specs=[
                    pl.BlockSpec((None, None, fold * rows_pad, lanes),
                                 lambda b, h, *_: (b, h, 0, 0)),
                    pl.BlockSpec((None, rows_pad, 1), lambda b, h, *_: (b, 0, 0)),
                    pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY),
                    *(pl.BlockSpec(memory_space=pl.ANY) for _ in scales),
                    *extra_specs,
                ],
                out_specs=pl.BlockSpec((None, None, rows_pad, lanes),
                                       lambda b, h, *_: (b, h, 0, 0)),
                scratch_shapes=[buf, buf, *(scales_buf for _ in scales),
                                pltpu.SemaphoreType.DMA((2 + len(scales), 2))],
            ),
            out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows_pad, lanes),
                                           q.dtype if fold == 1 else jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel")),
            interpret=_compat.tpu_interpret_params() if interpret else False,
            name="forge_jax_tpu_paged_attention",
            cost_estimate=_cost.attention(
                queries=batch * q_len * q_heads, keys=max_pages * page_size, head_dim=head_dim,
                io=(qg, qg, tables), kv_bytes=2 * batch * kv_heads * max_pages * page_size
                * (head_dim * k_pages.dtype.itemsize + 4 * len(scales) // 2)),
        )(tables, key_lo, key_hi, qg, row_pos, k_pages, v_pages, *scales, *extra)
        if fold > 1:  # lane group r holds the tokens r of the rows: sum them (tiny)
            out = out.reshape(batch, kv_heads, rows_pad, fold, head_dim).sum(3).astype(q.dtype)

        out = _attention_common.ungroup_queries(out, q_len=q_len, q_heads=q_heads,
                                                head_dim=head_dim)
    return out[:, 0] if decode else out


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these :func:`forge_jax.paged_attention` arguments,
    else why not."""
    q, k_pages = args["q"], args["k_pages"]
    q_len = 1 if q.ndim == 3 else q.shape[1]
    page_size = k_pages.shape[2]  # a folded pool's stored rows per page (fold tokens each)
    fold = args.get("fold", 1)
    pages_ok = _common.FLOAT_DTYPES
    if args.get("k_scales") is not None:  # quantized pools: int8/fp8 values and their scales
        pages_ok = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    for name, dtype, ok in (("q", q.dtype, _common.FLOAT_DTYPES),
                            ("k_pages", k_pages.dtype, pages_ok)):
        if jnp.dtype(dtype) not in ok:
            return (f"{name}.dtype={jnp.dtype(dtype).name}: the kernel reads float32/bfloat16 "
                    "(TPUs have no float16 vector unit)")
    if q_len > MAX_Q_LEN:
        return (f"q_len={q_len} > {MAX_Q_LEN}: the decode kernel holds all of a group's "
                "queries in one tile; long prefill chunks belong to dense attention")
    # Any head_dim: 64, 80 and 192 (and 128) compile for v5e and v6e (forge_jax.aot, JAX
    # 0.10.2, 2026-11-25; a head_dim % 128 rejection once kept SmolLM2, Llama-3.2-1B/3B and
    # Qwen2.5-0.5B off this kernel) and agree with XLA in the interpreter.
    tile = _common.sublane_tile(k_pages.dtype)
    if fold > 1:
        # Folded pages of 8 rows compile for v5e and v6e in bfloat16 and float32 alike
        # (SmolLM2's heads, pages of 16 tokens; forge_jax.aot, libtpu 0.0.42.1, JAX 0.10.2,
        # 2026-11-25); fewer rows are untried.
        if page_size % 8:
            return (f"page_size={page_size * fold} folded is {page_size} rows of {fold} "
                    "tokens, not a multiple of 8: the pages of a block are merged into one "
                    "[rows, 128] operand in VMEM")
        return None
    if page_size % tile:
        return (f"page_size={page_size} is not a multiple of {tile} (the sublane tile of "
                f"{jnp.dtype(k_pages.dtype).name}): the pages of a block are merged into one "
                "[keys, head_dim] operand in VMEM")
    return None


_registration.register(
    "paged_attention", paged_attention, backend="tpu", supports=supports, verified=VERIFIED,
    reads_folded=True, reads_sinks=True, reads_chunks=True,
    description="decode over the block tables, double-buffered page copies, online softmax")
