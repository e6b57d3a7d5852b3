"""Pallas GPU kernel (Triton lowering): paged attention, split over the keys (flash-decoding).

Grid ``(batch, kv_heads * row_blocks, splits)``: each program takes the query rows of one
GQA group of one sequence (``q_len * group`` rows, query-major, padded to a power of two),
walks its share of the sequence's pages through the block table, ``pages_per_compute_block``
pages at a time, straight from the pool (no gathered copy), and keeps an online softmax.
It writes the unnormalised float32 output with the running max and sum; an XLA epilogue
merges the splits with logsumexp weights. Pages past a sequence's length, before every
query's sliding window, or after every query's position are never visited.

A slot inside the visited range may still be hidden from some rows (chunked prefill: the
causal mask or the window of an earlier query hides a key a later query sees). Its logit
is hidden by ``where``, but a zero probability does not hide a NaN/inf value
(``0 * NaN = NaN``): non-finite values leave the ``p @ v`` product, and a block that holds
any (rare: a ``lax.cond``) marks NaN the output columns of exactly the rows that see one.
In decode (``q_len == 1``) every row sees exactly the visited range, so the values are
only zeroed outside it and the guard is not emitted.

A table entry of -1 (:func:`~forge_jax.pallas_kernels._attention_common.paged_ranges`
writes it for an entry past the sequence's pages or one that names no page of the pool)
reads page 0 in place of a page, and its slots are hidden from every row like the slots
outside the visited range: an out-of-range entry reads nothing (the index contract of
:mod:`forge_jax.ops.paged`).

The attention contract is that of :func:`forge_jax.paged_attention` (its XLA implementation
is the reference).

Op: :func:`forge_jax.ops.paged.paged_attention`; reference: its XLA implementation
:func:`forge_jax.ops.paged.paged_attention_xla`. Tests: ``tests/test_pallas_gpu_paged.py``,
``tests/test_gpu_tuning.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _cost, _registration
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

MAX_Q_LEN = 16  # decode and short chunks; longer prefill belongs to the dense kernel
MAX_HEAD_DIM = 512  # Gemma 4's full layers (and its KV cache's width)


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch parameters.

    ``block_k``: keys per compute block (the wrapper's ``pages_per_compute_block = block_k
    // page_size``, at least one page); ``max_splits``: the most programs one sequence's
    keys are split over (the wrapper's ``num_splits``, fewer when it has fewer compute
    blocks); ``block_rows``: query rows per program; Triton's warps and stages.
    """

    block_k: int
    max_splits: int
    block_rows: int
    num_warps: int
    num_stages: int


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind,
# A100 included, and the interpreter), by padded head dim (:func:`_common.dot_size`;
# the smallest bucket >= it). Not measured yet (no GPU has run the kernel): the per-kind rows
# size the blocks to each device's shared memory and the splits to its SMs (see
# :data:`_common.DEVICE_KINDS`).
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        64: dict(block_k=64, max_splits=16, block_rows=64, num_warps=4, num_stages=2),
        128: dict(block_k=64, max_splits=16, block_rows=64, num_warps=4, num_stages=2),
        256: dict(block_k=32, max_splits=16, block_rows=32, num_warps=8, num_stages=2),
        512: dict(block_k=16, max_splits=16, block_rows=16, num_warps=8, num_stages=1),
    },
    "H100": {
        64: dict(block_k=64, max_splits=32, block_rows=64, num_warps=4, num_stages=3),
        128: dict(block_k=64, max_splits=32, block_rows=64, num_warps=4, num_stages=3),
        256: dict(block_k=32, max_splits=32, block_rows=32, num_warps=8, num_stages=2),
        # head_dim 512 (Gemma 4): float32 decode 101 registers, 16 query positions 223, no
        # spill; the 256 row spills 5056 bytes in float32 and its 16 positions need 266376
        # bytes of shared memory; with two stages float32 spills 8 KiB (forge_jax.aot, JAX
        # 0.10.2, 2026-11-28).
        512: dict(block_k=16, max_splits=32, block_rows=16, num_warps=8, num_stages=1),
    },
    "L4": {
        64: dict(block_k=64, max_splits=8, block_rows=64, num_warps=4, num_stages=2),
        128: dict(block_k=32, max_splits=8, block_rows=32, num_warps=4, num_stages=2),
        256: dict(block_k=16, max_splits=8, block_rows=16, num_warps=4, num_stages=1),
        512: dict(block_k=16, max_splits=8, block_rows=16, num_warps=8, num_stages=1),
    },
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch parameters for ``args["q"]`` (``[batch, (q_len,) q_heads, head_dim]``,
    anything with a shape) on ``device_kind``, from :data:`TUNED`."""
    return Config(**_common.tuned(TUNED, device_kind,
                                  _common.dot_size(args["q"].shape[-1])))


def _kernel(q_ref, pos_ref, lo_ref, hi_ref, tables_ref, k_ref, v_ref, *refs,
            head_dim, page_size, pages_per_compute_block, blocks_per_split, scale,
            sliding_window, logits_soft_cap, pv_dtype, exact_range, quantized, chunked=False):
    # q_ref [rows, head_dim_pad]; pos_ref [rows]; lo_ref, hi_ref [1]: the keys any row of
    # this sequence sees lie in [lo, hi) (exactly the keys every row sees when exact_range);
    # tables_ref [pages], -1 where no page is named; k_ref, v_ref [num_pages, page_size,
    # head_dim_pad] (one kv head, the whole pool, read in place). Quantized pools: then
    # ks_ref, vs_ref [num_pages, page_size], a float32 scale per slot, read beside the
    # int8/fp8 values and applied in registers. Outputs: o_ref, m_ref, l_ref.
    # Chunked attention: chunk_ref [rows] (after the scales), the first key of each row's
    # chunk.
    if chunked:
        at = 2 if quantized else 0
        chunk_ref, refs = refs[at], refs[:at] + refs[at + 1:]
    ks_ref, vs_ref, o_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    rows, head_dim_pad = q_ref.shape
    block_k = pages_per_compute_block * page_size
    split = pl.program_id(2)
    q = q_ref[...]
    pos = pos_ref[...]
    chunk_start = chunk_ref[...] if chunked else None
    key_lo, key_hi = lo_ref[0], hi_ref[0]
    # The pool's head dim is not padded: padded columns are masked loads (zeros).
    kv_mask = jnp.broadcast_to((jnp.arange(head_dim_pad) < head_dim)[None, None, :],
                               (pages_per_compute_block, page_size, head_dim_pad))

    offsets = jnp.arange(page_size, dtype=jnp.int32)[None, :, None]
    dims = jnp.arange(head_dim_pad, dtype=jnp.int32)[None, None, :]

    def load(ref, scales_ref, pages):
        # All three indices as arrays: a gather of whole page rows, masked past head_dim.
        # fp8 values: the fill value as a float (the Triton lowering casts no int to fp8).
        fill = 0.0 if ref.dtype == jnp.float8_e4m3fn else 0
        x = _compat.triton_load(ref, (pages[:, None, None], offsets, dims), mask=kv_mask,
                                other=fill)
        x = x.reshape(block_k, head_dim_pad)
        if scales_ref is None:
            return x
        scales = _compat.triton_load(scales_ref, (pages[:, None], offsets[:, :, 0]))
        return x.astype(jnp.float32) * scales.reshape(block_k, 1)

    def body(block, carry):
        o, m, l_sum = carry
        entries = tables_ref[pl.ds(block * pages_per_compute_block, pages_per_compute_block)]
        pages = jnp.maximum(entries, 0)
        # [block_k]: whether each key's entry names a page (a -1 entry's slots are hidden).
        named = jnp.broadcast_to(jnp.where(entries >= 0, 1, 0)[:, None],
                                 (pages_per_compute_block, page_size)).reshape(block_k) > 0
        k = load(k_ref, ks_ref, pages)
        qk = q
        if q.dtype != k.dtype:
            qk, k = q.astype(jnp.float32), k.astype(jnp.float32)
        # HIGHEST: float32 operands as IEEE products (Triton's default is TF32).
        s = lax.dot_general(qk, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)  # [rows, block_k]
        s = s * scale
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        j = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        visible = (j[None, :] <= pos[:, None]) & (j[None, :] < key_hi) & named[None, :]
        if sliding_window is not None:
            visible &= j[None, :] > pos[:, None] - sliding_window
        if chunked:
            visible &= j[None, :] >= chunk_start[:, None]
        # where, not a bias: keys no row may see can hold NaN or inf.
        s = jnp.where(visible, s, -jnp.inf)
        p, correction, m_next, l_sum = _common.online_softmax_step(s, m, l_sum)
        # Zero probabilities do not hide NaN values (0 * NaN = NaN).
        v = load(v_ref, vs_ref, pages)
        in_range = ((j >= key_lo) & (j < key_hi) & named)[:, None]
        if exact_range:  # every row sees exactly [key_lo, key_hi): zero the rest
            v = jnp.where(in_range, v, jnp.zeros((), v.dtype))
        else:  # a slot in range may be hidden from some rows: non-finite values leave p @ v
            finite = jnp.isfinite(v)
            v = jnp.where(finite, v, jnp.zeros((), v.dtype))
        pv = lax.dot_general(p.astype(pv_dtype), v.astype(pv_dtype), (((1,), (0,)), ((), ())),
                             precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
        o = correction[:, None] * o + pv
        if not exact_range:
            def mark_nonfinite(o):
                # visible lies inside [key_lo, key_hi): garbage outside it marks nothing.
                hits = lax.dot_general(visible.astype(pv_dtype), (~finite).astype(pv_dtype),
                                       (((1,), (0,)), ((), ())),
                                       precision=lax.Precision.HIGHEST,
                                       preferred_element_type=jnp.float32)  # [rows, head_dim]
                return jnp.where(hits > 0, jnp.nan, o)

            any_nonfinite = jnp.max(jnp.where(in_range & ~finite, 1.0, 0.0)) > 0
            o = lax.cond(any_nonfinite, mark_nonfinite, lambda o: o, o)
        return o, m_next, l_sum

    first = jnp.maximum(split * blocks_per_split, key_lo // block_k)
    last = jnp.minimum((split + 1) * blocks_per_split, pl.cdiv(key_hi, block_k))
    init = (jnp.zeros((rows, head_dim_pad), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    o, m, l_sum = lax.fori_loop(first, last, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l_sum


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "pages_per_compute_block", "num_splits",
    "block_rows", "num_warps", "num_stages", "interpret", "attention_chunk_size"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                    q_positions=None, sliding_window=None, logits_soft_cap=None,
                    pages_per_compute_block=None, num_splits=None, block_rows=None,
                    num_warps=None, num_stages=None, interpret=False, k_scales=None,
                    v_scales=None, sinks=None, attention_chunk_size=None):
    """Paged attention (see :func:`forge_jax.paged_attention` for the contract).

    Args:
      q: ``[batch, q_heads, head_dim]`` or ``[batch, q_len, q_heads, head_dim]``.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``; int8 or fp8 values
        of quantized pools (:mod:`forge_jax.ops.kv_quant`) with ``k_scales``/``v_scales``.
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]`` for quantized
        pools (dequantized in registers as the kernel loads a block), else None.
      block_tables: int ``[batch, max_pages]``; entries past a sequence's pages may hold
        anything.
      lengths: int ``[batch]``, tokens in the cache per sequence, new ones included.
      scale, q_positions, sliding_window, logits_soft_cap: as in the op.
      sinks, attention_chunk_size: as in the op; the sinks join in the merge of the splits,
        the chunk masks in the kernel (its first key also bounds the blocks visited).
      pages_per_compute_block: pages per K/V block, a power of two with
        ``pages_per_compute_block * page_size >= 16`` (default from the tuning table:
        ``block_k // page_size``, at least 1). A page size that is not a power of two
        cannot lower (the block's rows must be a power of two).
      num_splits: programs over one sequence's keys (default: the tuning table's
        ``max_splits``, at most one per compute block).
      block_rows: query rows per program (a power of two >= 16).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).

    Returns:
      The shape of ``q``, in ``q.dtype``.
    """
    _compat.filter_triton_deprecation()
    decode = q.ndim == 3
    if decode:
        q = q[:, None]
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    group = q_heads // kv_heads
    config = default_config({"q": q}, _common.device_kind(interpret))
    head_dim_pad = _common.dot_size(head_dim)
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, config.block_k // _common.next_pow2(page_size))
    block_k = pages_per_compute_block * page_size
    if pages_per_compute_block & (pages_per_compute_block - 1) or block_k < _common.MIN_DOT:
        raise ValueError(f"{pages_per_compute_block=} must be a power of two and "
                         f"{pages_per_compute_block=} * {page_size=} >= {_common.MIN_DOT} "
                         "(a K/V block is one Triton dot operand)")
    num_blocks = -(-max_pages // pages_per_compute_block)
    num_splits = min(num_splits or config.max_splits, num_blocks)
    blocks_per_split = -(-num_blocks // num_splits)
    rows = q_len * group
    block_rows = block_rows or min(config.block_rows, _common.dot_size(rows))
    if block_rows < _common.MIN_DOT or block_rows & (block_rows - 1):
        raise ValueError(f"{block_rows=} must be a power of two >= {_common.MIN_DOT}")
    row_blocks = -(-rows // block_rows)
    rows_pad = row_blocks * block_rows
    if scale is None:
        scale = head_dim ** -0.5

    with jax.named_scope("paged_attention"):
        # Small per-sequence bookkeeping in XLA; the pool itself is only read by the kernel.
        window, key_lo, key_hi, row_pos, tables = _attention_common.paged_ranges(
            q_positions, lengths, block_tables, q_len=q_len, group=group, rows_pad=rows_pad,
            page_size=page_size, num_pages=num_pages, sliding_window=sliding_window,
            table_width=num_splits * blocks_per_split * pages_per_compute_block)
        qg = _attention_common.group_queries(q, kv_heads, rows_pad=rows_pad,
                                             head_dim_pad=head_dim_pad)
        extra_specs, extra = [], []
        if attention_chunk_size is not None:
            size = min(int(attention_chunk_size), _attention_common.POS_LIMIT)
            starts = jnp.floor_divide(row_pos, size) * size  # [batch, rows_pad]
            real = jnp.arange(rows_pad)[None, :] < rows
            key_lo = jnp.minimum(jnp.maximum(key_lo, jnp.where(
                real, starts, _attention_common.POS_LIMIT).min(axis=1)), key_hi)
            extra_specs.append(pl.BlockSpec((None, block_rows),
                                            lambda b, i, s: (b, i % row_blocks)))
            extra.append(starts)
        # Probabilities meet the values in the values' dtype when the queries share it
        # (flash-attention practice); float32 queries over a narrow cache stay float32.
        pv_dtype = k_pages.dtype if q.dtype == k_pages.dtype else jnp.float32
        quantized = k_scales is not None

        kernel = functools.partial(
            _kernel, head_dim=head_dim, page_size=page_size,
            pages_per_compute_block=pages_per_compute_block, blocks_per_split=blocks_per_split,
            scale=float(scale), sliding_window=window, logits_soft_cap=logits_soft_cap,
            pv_dtype=pv_dtype, exact_range=q_len == 1, quantized=quantized,
            chunked=attention_chunk_size is not None)
        pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim_pad),
                                lambda b, i, s: (i // row_blocks, 0, 0, 0))
        scales_spec = pl.BlockSpec((None, num_pages, page_size),
                                   lambda b, i, s: (i // row_blocks, 0, 0))
        scales = () if not quantized else tuple(  # [kv_heads, num_pages, page_size]
            x.reshape(kv_heads, num_pages, page_size).astype(jnp.float32)
            for x in (k_scales, v_scales))
        o, m, l_sum = pl.pallas_call(
            kernel,
            grid=(batch, kv_heads * row_blocks, num_splits),
            in_specs=[
                pl.BlockSpec((None, None, block_rows, head_dim_pad),
                            lambda b, i, s: (b, i // row_blocks, i % row_blocks, 0)),
                pl.BlockSpec((None, block_rows), lambda b, i, s: (b, i % row_blocks)),
                pl.BlockSpec((1,), lambda b, i, s: (b,)),
                pl.BlockSpec((1,), lambda b, i, s: (b,)),
                pl.BlockSpec((None, tables.shape[1]), lambda b, i, s: (b, 0)),
                pool_spec,
                pool_spec,
                *(scales_spec for _ in scales),
                *extra_specs,
            ],
            out_specs=[
                pl.BlockSpec((None, None, None, block_rows, head_dim_pad),
                            lambda b, i, s: (b, i // row_blocks, s, i % row_blocks, 0)),
                pl.BlockSpec((None, None, None, block_rows),
                            lambda b, i, s: (b, i // row_blocks, s, i % row_blocks)),
                pl.BlockSpec((None, None, None, block_rows),
                            lambda b, i, s: (b, i // row_blocks, s, i % row_blocks)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows_pad, head_dim_pad),
                                     jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows_pad), jnp.float32),
                jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows_pad), jnp.float32),
            ],
            compiler_params=_compat.triton_compiler_params(
                num_warps=num_warps or config.num_warps,
                num_stages=num_stages or config.num_stages),
            interpret=interpret,
            name="forge_jax_paged_attention",
            cost_estimate=_cost.attention(
                queries=batch * q_len * q_heads, keys=max_pages * page_size, head_dim=head_dim,
                io=(qg, tables), kv_bytes=2 * batch * kv_heads * max_pages * page_size
                * (head_dim * k_pages.dtype.itemsize + 4 * quantized)
                + 4 * batch * q_heads * q_len * num_splits * (head_dim_pad + 2)),
        )(qg, row_pos, key_lo, key_hi, tables, k_pages, v_pages, *scales, *extra)

        row_sinks = None
        if sinks is not None:  # [kv_heads, rows_pad]: row r reads head h * group + r % group
            row_sinks = jnp.pad(jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, 1, group),
                                         (1, q_len, 1)).reshape(kv_heads, rows),
                                ((0, 0), (0, rows_pad - rows)))[None]
        merged = _attention_common.merge_splits(o, m, l_sum, row_sinks)
        out = _attention_common.ungroup_queries(merged, q_len=q_len, q_heads=q_heads,
                                                head_dim=head_dim)
        out = out.astype(q.dtype)
    return out[:, 0] if decode else out


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these arguments, else why not."""
    q, k_pages = args["q"], args["k_pages"]
    q_len = 1 if q.ndim == 3 else q.shape[1]
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    pages_ok = _common.FLOAT_DTYPES
    if args.get("k_scales") is not None:  # quantized pools: int8 or fp8 values, loaded as is
        pages_ok = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
    for name, dtype, ok in (("q", q.dtype, _common.FLOAT_DTYPES),
                            ("k_pages", k_pages.dtype, pages_ok)):
        if jnp.dtype(dtype) not in ok:
            return f"{name}.dtype={jnp.dtype(dtype).name}: Triton dots take float32/16 and bfloat16"
    if q_len > MAX_Q_LEN:
        return (f"q_len={q_len} > {MAX_Q_LEN}: the split-K decode kernel holds all of a group's "
                "queries in one tile; long prefill chunks belong to dense attention")
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim={head_dim} > {MAX_HEAD_DIM} does not fit this kernel's register tiles"
    if page_size & (page_size - 1):
        return (f"page_size={page_size} is not a power of two: a K/V block of whole pages "
                "must have a power-of-two number of rows for the Triton lowering")
    return None


_registration.register(
    "paged_attention", paged_attention, backend="gpu", supports=supports, verified=VERIFIED,
    reads_sinks=True, reads_chunks=True,
    description="flash-decoding over the block tables, split over the keys")
