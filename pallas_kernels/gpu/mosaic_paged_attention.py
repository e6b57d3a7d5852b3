"""Mosaic GPU kernel (Hopper; Blackwell decode): paged attention over the block tables, split
over the keys.

The launch is ``(items, kv_heads, splits)``. An *item* is one query block of one sequence
(in ``fj.paged_attention`` a sequence's ``q_len`` queries; in
``fj.ragged_paged_attention`` up to ``64 // group`` consecutive rows of one sequence, see
:mod:`forge_jax.pallas_kernels.gpu.mosaic_ragged_paged_attention`). One program takes the
query rows of one GQA group of one item (``q_len * group <= 64`` rows: one WGMMA tile,
query-major, zero-padded), so every key and value page is read once per group, and walks
its split's share of the item's key blocks (``block_kv`` keys, whole pages), each page
copied in place from the pool by its own TMA copy, ``stages`` blocks in flight through a
shared-memory ring. ``Q K^T`` and ``P V`` are WGMMAs with float32 accumulators; the online
softmax runs between them in float32 registers. Each split writes its unnormalised rows
with their running max and sum; an XLA epilogue merges the splits with logsumexp weights
(:func:`forge_jax.pallas_kernels._attention_common.merge_splits`).

Values a row does not see never reach it. Logits are hidden by selection. Values: a zero
probability does not hide NaN (``0 * NaN = NaN``), so
* an item whose rows all sit at one position (a decode token: every row sees exactly the
  keys ``[key_lo, key_hi)`` on named pages) zeroes, in shared memory, the value rows of a
  block outside that range (the first and last blocks, pages an entry does not name);
  interior blocks are used as copied;
* an item with several positions (chunked prefill, ragged prefill rows) may see a slot
  another of its rows does not: every block's non-finite values are zeroed, and a second
  product of the visibility with the non-finite flags makes exactly the rows and columns
  that see one NaN (the attention contract).

A block-table entry the item does not use, or one naming no page of the pool, is -1
(:func:`forge_jax.pallas_kernels._attention_common.paged_ranges`): page 0 is copied in its
place and its slots are hidden from every row, so it reads nothing (the index contract of
:mod:`forge_jax.ops.paged`).

Constraints (:func:`supports`, settled by the H100 lowering in
``tests/test_pallas_mgpu_paged.py``): compute capability 9.x (Hopper; on 10.x, Blackwell,
the record serves decode with the tcgen05 kernel of
:mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention_sm100`, ``mma="tcgen05"``);
bfloat16 or float16 queries and pages of one dtype (WGMMA takes float32 only as TF32, which
misses the float32 contract); ``q_len * group <= 64``; ``head_dim`` a multiple of 64 up to
256 (the 128-byte swizzle of the WGMMA operands; a TMA copy moves <= 256 elements along each
dimension), up to 128 with several query positions or one-byte pages (past it ptxas spills
registers); ``page_size`` a multiple of 8 up to 256 that divides 64 or is a multiple of 64
(whole pages per key block, 8-row tiles); a ring of two key blocks within the 227 KiB of
shared memory.

Quantized pools (int8 or fp8 e4m3 values, a float32 scale per slot,
:mod:`forge_jax.ops.kv_quant`): the values' pages go through the ring as they are stored
(one byte each) and their scales beside them, into a ring of their own on the same barriers:
a page's scales by their own TMA copy where they fill whole 128-byte copies (pages of 32
tokens or more), else each item's scales gathered through its table by XLA before the launch
and copied a block at a time. Each block is dequantized in registers (float32
``scale * value``, rounded to the queries' dtype, bfloat16 or float16) into one shared tile
the WGMMAs read: the keys first, then, once ``Q K^T`` has read them, the values, which then
take the masking above. A slot no row sees holds a NaN scale or any bytes: a NaN key is a
hidden logit, a NaN value is zeroed or marked as above.

In the Mosaic GPU interpreter (``interpret=True``) ``Q K^T`` is a ``dot_general`` of the
two shared-memory tiles: the interpreter's WGMMA takes no transposed operand. Everything
else (copies, barriers, the ring, masks, the ``P V`` WGMMA) is the compiled kernel's code.

Op: :func:`forge_jax.ops.paged.paged_attention`; reference: its XLA implementation
:func:`forge_jax.ops.paged.paged_attention_xla`. Launch knobs: :class:`Config`,
:data:`TUNED`, :func:`default_config`. Registered (bottom of this module) as
``"mosaic_gpu"`` on GPU, by name until :data:`VERIFIED` names a GPU, and
``"mosaic_gpu_interpret"``. Tests: ``tests/test_pallas_mgpu_paged.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _registration
from forge_jax.pallas_kernels.gpu import (
    _common,
    _mosaic,
    _mosaic_paged,
    mosaic_paged_attention_sm100,
    mosaic_paged_limits,
)
from forge_jax.pallas_kernels.gpu._mosaic_paged import Config
from forge_jax.pallas_kernels.gpu.mosaic_paged_limits import (  # noqa: F401 (callers' names)
    MAX_TMA,
    MIN_STAGES,
    ROWS,
    SMEM_LIMIT,
    block_keys,
    fitting_stages,
    register_reason,
    smem_bytes,
)

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked in
# the Mosaic GPU interpreter and compiled for H100 without a device; no GPU has run it).
VERIFIED: dict[str, str] = {}

# Bytes of one TMA copy into shared memory: a multiple of the warpgroup's 128 threads (Mosaic
# GPU's lowering splits the barrier's expected bytes among them).
SCALE_COPY_BYTES = 128


# Defaults per device kind (:func:`_common.kind_row`), by head dim, and the interpreter's
# (:data:`_mosaic_paged.TUNED`, where the figures behind them are).
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = _mosaic_paged.TUNED
INTERPRET = _mosaic_paged.INTERPRET

# Programs the split heuristic aims for: two per SM of an H100.
TARGET_PROGRAMS = 264


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch parameters for ``args["q"]`` (anything with a shape) on ``device_kind``
    (``"interpret"``: the interpreter's)."""
    return _mosaic_paged.config_for(TUNED, INTERPRET, args, device_kind)


def _kernel(q_ref, pos_ref, range_ref, tables_ref, k_ref, v_ref,  # inputs (GMEM)
            *refs, scale, sliding_window, logits_soft_cap, page_size, block_kv, stages,
            blocks_per_split, num_pages, out_rows, quantized, gathered_scales, interpret,
            single_position=False, attention_chunk_size=None):
    # q_ref [items, kv_heads, ROWS, head_dim]; pos_ref [items, ROWS] (-1: padding row);
    # range_ref [items, 4]: key_lo, key_hi (the keys some row sees lie in [lo, hi)) and
    # whether every row sits at one position; tables_ref [items, table_width], -1 where no
    # page is named; k_ref, v_ref [kv_heads, num_pages, page_size, head_dim] (the pool).
    # Quantized pools: then ks_ref, vs_ref, float32, a scale per slot: the pools' [kv_heads,
    # num_pages, page_size], or (gathered_scales) each item's table's [kv_heads, items,
    # table_width * page_size]. Outputs (GMEM): o_ref, m_ref, l_ref.
    ks_ref, vs_ref, o_ref, m_ref, l_ref = refs if quantized else (None, None, *refs)
    plgpu = _compat.pallas_mosaic_gpu()
    item, head, split, key_lo, key_hi, first, steps, entry = _mosaic_paged.key_blocks(
        range_ref, tables_ref, blocks_per_split=blocks_per_split, block_kv=block_kv,
        page_size=page_size)
    head_dim, dtype = q_ref.shape[-1], q_ref.dtype
    pages_per_block = block_kv // page_size
    # single_position (static: a decode launch, every item one position) compiles out the
    # per-value NaN bookkeeping of several positions and its accumulator's registers.
    one_position = True if single_position else range_ref[item, 2] > 0
    named_keys = functools.partial(_mosaic_paged.named_keys, page_size=page_size,
                                   block_kv=block_kv)
    masked_logits = functools.partial(
        _mosaic_paged.masked_logits, key_lo=key_lo, key_hi=key_hi, layout=plgpu.Layout.WGMMA,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, page_size=page_size,
        block_kv=block_kv, interpret=interpret,
        # One position: the chunk starts at key_lo (the ranges'), nothing to mask per row.
        attention_chunk_size=None if single_position else attention_chunk_size)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def dequantized(ref, scales_ref):
        # [block_kv, head_dim] stored values -> scale * values in the compute dtype, float32
        # in between (a NaN scale makes its row NaN: the masks below treat it as NaN data).
        x = ref[...]
        if x.dtype == jnp.float8_e4m3fn:  # Hopper converts e4m3 to f16 only (exactly)
            x = x.astype(jnp.float16)
        x = x.astype(jnp.float32)
        row_scale = _mosaic.layout_cast(scales_ref[...], row_layout, interpret=interpret)
        return (x * lax.broadcast_in_dim(row_scale, x.shape, [0])).astype(dtype)

    def pipeline(q_smem, pos_smem, q_bar, k_smem, v_smem, p_smem, seen_smem, bad_smem,
                 k_bar, v_bar, *quant_smem):
        # Quantized pools: the scales' ring beside the values' and one tile of dequantized
        # keys, then values (the Q K^T product has read the keys before the values land).
        ks_smem, vs_smem, deq_smem = quant_smem if quantized else (None, None, None)

        copies = [(k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)]
        if quantized and not gathered_scales:  # each page's scales beside it
            copies += [(ks_ref, ks_smem, k_bar), (vs_ref, vs_smem, v_bar)]

        def fetch(step, slot):
            block = first + step
            _mosaic_paged.fetch_pages(functools.partial(entry, block), copies,
                                      pages=pages_per_block, head=head, slot=slot,
                                      page_size=page_size)
            if gathered_scales:
                keys = pl.ds(block * block_kv, block_kv)
                plgpu.copy_gmem_to_smem(ks_ref.at[head, item, keys], ks_smem.at[slot],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[head, item, keys], vs_smem.at[slot],
                                        v_bar.at[slot])

        for s in range(stages):
            pl.when(s < steps)(functools.partial(fetch, s, s))

        plgpu.barrier_wait(q_bar.at[0])
        pos = _mosaic.layout_cast(pos_smem[...], row_layout, interpret=interpret)  # [ROWS]

        def step_fn(step, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(step, stages)
            block = first + step
            start = block * block_kv
            entries = [entry(block, p) for p in range(pages_per_block)]  # scalars, read once

            plgpu.barrier_wait(k_bar.at[slot])
            k_tile = k_smem.at[slot]
            if quantized:
                deq_smem[...] = dequantized(k_tile, ks_smem.at[slot])
                plgpu.commit_smem()
                k_tile = deq_smem

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, _mosaic.transposed(k_tile))
                return acc_ref[...]

            if interpret:  # the interpreter's WGMMA takes no transposed operand
                s = lax.dot_general(q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            else:
                s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_kv), jnp.float32))
            s, visible = masked_logits(s * scale, pos, start=start, entries=entries)

            @pl.when(False if single_position else ~one_position)
            def _():  # stored now: the mask would otherwise hold registers until P V
                seen_smem[...] = jnp.where(visible, jnp.ones((), dtype), jnp.zeros((), dtype))

            p_blk, alpha, m_next, l_next = _mosaic.online_softmax(s, m_prev, l_prev)
            p_smem[...] = p_blk.astype(dtype)

            plgpu.barrier_wait(v_bar.at[slot])
            # The values the product reads: the ring slot, or (quantized) the dequantized tile.
            v_slot = deq_smem if quantized else v_smem.at[slot]

            def v_block():
                if quantized:
                    return dequantized(v_smem.at[slot], vs_smem.at[slot])
                return v_slot[...]

            # Per key, broadcast where applied: a [block_kv, head_dim] iota costs registers.
            vkey = start + _mosaic.iota(jnp.int32, (block_kv,), 0, row_layout,
                                        interpret=interpret)
            in_range = named_keys(vkey, entries, start) & (vkey >= key_lo) & (vkey < key_hi)

            def rows_in_range(shape):
                return lax.broadcast_in_dim(jnp.where(in_range, 1.0, 0.0), shape, [0]) > 0.0

            boundary = (start < key_lo) | (start + block_kv > key_hi)
            for page in entries:
                boundary |= page < 0

            @pl.when(boundary if single_position else one_position & boundary)
            def _():
                v = v_block()
                v_slot[...] = jnp.where(rows_in_range(v.shape), v, jnp.zeros((), dtype))

            if quantized:
                @pl.when(~boundary if single_position else one_position & ~boundary)
                def _():
                    v_slot[...] = v_block()

            @pl.when(False if single_position else ~one_position)
            def _():
                v = v_block()
                # x - x is NaN exactly for NaN and +-inf. (No `~` of a boolean vector: JAX
                # 0.12's Mosaic GPU lowering cannot convert it.)
                diff = (v - v).astype(jnp.float32)
                v_slot[...] = jnp.where(diff == 0.0, v, jnp.zeros((), dtype))
                bad_smem[...] = jnp.where(rows_in_range(v.shape) & (diff != 0.0),
                                          jnp.ones((), dtype), jnp.zeros((), dtype))

            plgpu.commit_smem()

            acc = lax.broadcast_in_dim(alpha, acc.shape, [0]) * acc
            if interpret:  # the interpreter has no pl.run_state: a scoped accumulator
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_slot)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            else:  # accumulated in place: no second [ROWS, head_dim] accumulator's registers
                acc = pl.run_state(
                    lambda acc_ref: plgpu.wgmma(acc_ref, p_smem, v_slot))(plgpu.ACC.init(acc))

            def hits(acc_ref):
                plgpu.wgmma(acc_ref, seen_smem, bad_smem)
                return acc_ref[...]

            # Rows that see a non-finite value: NaN in exactly those columns.
            acc = acc if single_position else lax.cond(
                one_position, lambda acc: acc,
                lambda acc: jnp.where(pl.run_scoped(hits, plgpu.ACC((ROWS, head_dim),
                                                                    jnp.float32)) > 0,
                                      jnp.float32(jnp.nan), acc), acc)

            _mosaic.refill(fetch, step, slot, stages=stages, steps=steps)

            return acc, m_next, l_next

        cast = functools.partial(_mosaic.layout_cast, interpret=interpret)
        init = (cast(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout),
                cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout),
                cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
        return lax.fori_loop(0, steps, step_fn, init)

    def epilogue(acc, m, l_sum, o_smem, ml_smem):
        o_smem[...] = acc
        _mosaic_paged.write_split(m, l_sum, o_smem, ml_smem, (o_ref, m_ref, l_ref),
                                  at=(item, head, split), out_rows=out_rows)

    def program(q_smem, pos_smem, q_bar):
        plgpu.copy_gmem_to_smem(q_ref.at[item, head], q_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_ref.at[item], pos_smem, q_bar.at[0])
        copies = pages_per_block + (0 if not quantized else 1 if gathered_scales
                                    else pages_per_block)
        pages_barrier = plgpu.Barrier(num_arrivals=copies, num_barriers=stages)
        quant_scratch = () if not quantized else (
            plgpu.SMEM((stages, block_kv), jnp.float32),
            plgpu.SMEM((stages, block_kv), jnp.float32),
            _mosaic.swizzled_smem((block_kv, head_dim), dtype))
        # The ring and the output staging live one after the other in shared memory.
        acc, m, l_sum = pl.run_scoped(
            functools.partial(pipeline, q_smem, pos_smem, q_bar),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), k_ref.dtype),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), k_ref.dtype),
            _mosaic.swizzled_smem((ROWS, block_kv), dtype),
            _mosaic.swizzled_smem((ROWS, block_kv), dtype),
            _mosaic.swizzled_smem((block_kv, head_dim), dtype),
            pages_barrier, pages_barrier, *quant_scratch)
        pl.run_scoped(functools.partial(epilogue, acc, m, l_sum),
                      plgpu.SMEM((ROWS, head_dim), jnp.float32),
                      plgpu.SMEM((2, ROWS), jnp.float32))

    pl.run_scoped(program, _mosaic.swizzled_smem((ROWS, head_dim), dtype),
                  plgpu.SMEM((ROWS,), jnp.int32), plgpu.Barrier(num_arrivals=2, num_barriers=1))


def attend(qg, row_pos, ranges, tables, k_pages, v_pages, *, scale, sliding_window,
           logits_soft_cap, out_rows, block_kv=None, stages=None, num_splits=None,
           interpret=False, k_scales=None, v_scales=None, single_position=False, sinks=None,
           attention_chunk_size=None):
    """The kernel over ``items`` query blocks, splits merged: ``[items, kv_heads,
    out_rows, head_dim]`` float32, normalised (with ``sinks``, float32 ``[kv_heads, rows]``
    of each row's sink logit, joined in the merge).

    Args:
      qg: ``[items, kv_heads, ROWS, head_dim]``, each item's GQA rows (query-major).
      row_pos: int32 ``[items, ROWS]``, each row's position, -1 for padding rows.
      ranges: int32 ``[items, 4]``: ``key_lo``, ``key_hi`` (the keys some row of the item
        sees lie in ``[key_lo, key_hi)``), 1 if every row sits at one position, 0.
      tables: int32 ``[items, pages]``: each item's pages, -1 for an entry it must not read.
      k_pages, v_pages: the pools ``[kv_heads, num_pages, page_size, head_dim]``, ``qg``'s
        dtype, or int8/fp8 values with
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]``, a scale per slot.
      out_rows: rows written back per item (the used rows, rounded up to 8).
      attention_chunk_size: each row sees the keys of its own chunk only (``ranges`` start
        at the chunk of the item's first row).
    """
    items, kv_heads, _, head_dim = qg.shape
    _, num_pages, page_size, _ = k_pages.shape
    config = default_config({"q": qg}, "interpret" if interpret else _common.device_kind())
    block_kv = block_keys(block_kv or config.block_kv, page_size)
    quantized = k_scales is not None
    # One-byte pages: twice the blocks in flight for the bytes of a 16-bit ring (not in the
    # interpreter, whose small ring makes short tests wrap around it).
    stages = stages or fitting_stages(config.stages * (2 if quantized and not interpret else 1),
                                      head_dim=head_dim, block_kv=block_kv, quantized=quantized)
    max_pages = tables.shape[1]
    num_splits, blocks_per_split, tables = _mosaic_paged.split_launch(
        tables, items=items, kv_heads=kv_heads, page_size=page_size, block_kv=block_kv,
        max_splits=config.max_splits, target_programs=TARGET_PROGRAMS, num_splits=num_splits)
    width = tables.shape[1]
    f32 = jnp.float32
    kv_bytes = 2 * items * kv_heads * max_pages * page_size * (
        head_dim * k_pages.dtype.itemsize + (4 if quantized else 0))
    scales = () if not quantized else tuple(  # [kv_heads, num_pages, page_size]
        x.reshape(x.shape[:3]).astype(f32) for x in (k_scales, v_scales))
    # A TMA copy moves a multiple of 128 bytes: one page's scales do from 32 tokens a page.
    # Smaller pages: each item's scales gathered through its table before the launch,
    # [kv_heads, items, width * page_size] (4 bytes a slot read, written and read again),
    # copied a block at a time.
    gathered_scales = quantized and (page_size * 4) % SCALE_COPY_BYTES != 0
    if gathered_scales:
        scales = tuple(jnp.take(x, jnp.maximum(tables, 0), axis=1).reshape(
            kv_heads, items, width * page_size) for x in scales)
    kernel = functools.partial(
        _kernel, scale=float(scale), sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, page_size=page_size, block_kv=block_kv,
        stages=stages, blocks_per_split=blocks_per_split, num_pages=num_pages,
        out_rows=out_rows, quantized=quantized, gathered_scales=gathered_scales,
        interpret=interpret, single_position=single_position,
        attention_chunk_size=attention_chunk_size)
    return _mosaic_paged.launch(
        kernel, qg, row_pos, ranges, tables, k_pages, v_pages, *scales,
        name="forge_jax_mosaic_paged_attention", num_splits=num_splits, out_rows=out_rows,
        keys=max_pages * page_size, kv_bytes=kv_bytes, interpret=interpret, sinks=sinks)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "block_kv", "stages", "num_splits",
    "interpret", "mma", "attention_chunk_size"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                    q_positions=None, sliding_window=None, logits_soft_cap=None,
                    block_kv=None, stages=None, num_splits=None, interpret=False,
                    k_scales=None, v_scales=None, mma=None, sinks=None,
                    attention_chunk_size=None):
    """Paged attention (see :func:`forge_jax.paged_attention` for the contract).

    Args:
      q: ``[batch, q_heads, head_dim]`` or ``[batch, q_len, q_heads, head_dim]``.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, ``q``'s dtype; or
        the int8/fp8 values of quantized pools (:mod:`forge_jax.ops.kv_quant`) with
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]``, a scale per slot.
      block_tables: int ``[batch, max_pages]``; entries past a sequence's pages may hold
        anything.
      lengths: int ``[batch]``, tokens in the cache per sequence, new ones included.
      scale, q_positions, sliding_window, logits_soft_cap, sinks, attention_chunk_size: as
        in the op (the sinks join in the merge of the splits, outside the kernel; a decode
        query's chunk is the start of its key range).
      block_kv: keys per block (whole pages, rounded up to a multiple of 64).
      stages: key blocks in flight.
      num_splits: programs over one sequence's keys (default: enough programs for the GPU).
      interpret: run in the Mosaic GPU interpreter (any platform).
      mma: ``"wgmma"`` (Hopper) or ``"tcgen05"`` (Blackwell: decode only, the kernel of
        :mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention_sm100`); default: the
        GPU's (:func:`_mosaic.mma_kind`).

    Returns:
      The shape of ``q``, in ``q.dtype``.
    """
    mma = mma or _mosaic.mma_kind()
    if mma not in ("wgmma", "tcgen05"):
        raise ValueError(f"mma={mma!r}: 'wgmma' (Hopper) or 'tcgen05' (Blackwell)")
    decode = q.ndim == 3
    if decode:
        q = q[:, None]
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    group = q_heads // kv_heads
    rows = q_len * group
    tcgen05 = mma == "tcgen05"
    if tcgen05 and (why := mosaic_paged_attention_sm100.reason(
            q_len=q_len, group=group, quantized=k_scales is not None, head_dim=head_dim,
            page_size=page_size)):
        raise ValueError(why)
    rows_pad = mosaic_paged_attention_sm100.ROWS if tcgen05 else ROWS
    if rows > rows_pad:
        raise ValueError(f"q_len={q_len} * group={group} = {rows} query rows > {ROWS} (one "
                         "WGMMA tile per program)")
    if scale is None:
        scale = head_dim ** -0.5
    with jax.named_scope("paged_attention"):
        window, key_lo, key_hi, row_pos, tables = _attention_common.paged_ranges(
            q_positions, lengths, block_tables, q_len=q_len, group=group, rows_pad=rows_pad,
            page_size=page_size, num_pages=num_pages, sliding_window=sliding_window,
            table_width=block_tables.shape[1], attention_chunk_size=attention_chunk_size)
        one_position = jnp.full((batch,), 1 if q_len == 1 else 0, jnp.int32)
        ranges = jnp.stack([key_lo, key_hi, one_position, jnp.zeros_like(key_lo)], axis=1)
        compute = q.dtype if k_scales is not None else k_pages.dtype
        qg = _attention_common.group_queries(q.astype(compute), kv_heads, rows_pad=rows_pad)
        knobs = dict(scale=scale, sliding_window=window, logits_soft_cap=logits_soft_cap,
                     out_rows=-(-rows // 8) * 8, block_kv=block_kv, stages=stages,
                     num_splits=num_splits, interpret=interpret)
        if sinks is not None:  # [kv_heads, rows_pad]: row r reads head h * group + r % group
            knobs["sinks"] = jnp.pad(
                jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, 1, group),
                         (1, q_len, 1)).reshape(kv_heads, rows), ((0, 0), (0, rows_pad - rows)))
        if tcgen05:
            out = mosaic_paged_attention_sm100.attend_decode(
                qg, row_pos, ranges, tables, k_pages, v_pages, **knobs)
        else:
            out = attend(qg, row_pos, ranges, tables, k_pages, v_pages, k_scales=k_scales,
                         v_scales=v_scales, single_position=q_len == 1,
                         attention_chunk_size=attention_chunk_size, **knobs)
        out = _attention_common.ungroup_queries(out, q_len=q_len, q_heads=q_heads,
                                                head_dim=head_dim).astype(q.dtype)
    return out[:, 0] if decode else out


def layout_reason(*, q_dtype, kv_dtype, head_dim: int, page_size: int,
                  quantized: bool = False) -> str | None:
    """Why the kernel cannot take these dtypes and sizes at its tuned key blocks
    (:func:`mosaic_paged_limits.layout_reason`; shared with the ragged kernel)."""
    block_kv = block_keys(_common.tuned(TUNED, None, head_dim)["block_kv"], page_size)
    return mosaic_paged_limits.layout_reason(q_dtype=q_dtype, kv_dtype=kv_dtype,
                                             head_dim=head_dim, page_size=page_size,
                                             block_kv=block_kv, quantized=quantized)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel compiles for these arguments without register spills, else why
    not: on compute capability 9.x the WGMMA kernel here, on 10.x (Blackwell) the tcgen05
    decode kernel of :mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention_sm100`."""
    q, k_pages = args["q"], args["k_pages"]
    q_len = 1 if q.ndim == 3 else q.shape[1]
    group = q.shape[-2] // k_pages.shape[0]
    quantized = args.get("k_scales") is not None
    reason = layout_reason(q_dtype=q.dtype, kv_dtype=k_pages.dtype, head_dim=q.shape[-1],
                           page_size=k_pages.shape[2], quantized=quantized)
    if reason is not None:
        return reason
    if _mosaic.mma_kind() == "tcgen05":
        return mosaic_paged_attention_sm100.reason(
            q_len=q_len, group=group, quantized=quantized, head_dim=q.shape[-1],
            page_size=k_pages.shape[2])
    if q_len * group > ROWS:
        return (f"q_len={q_len} * group={group} = {q_len * group} query rows > {ROWS}: one "
                "program holds one WGMMA tile of a group's queries; longer chunks belong to "
                "ragged or dense attention")
    return register_reason(head_dim=q.shape[-1], quantized=quantized,
                           several_positions=q_len > 1)


_registration.register(
    "paged_attention", paged_attention, backend="mosaic_gpu", supports=supports,
    verified=VERIFIED, reads_sinks=True, reads_chunks=True,
    description="per-page TMA copies through the block tables into a WGMMA (Hopper) or "
                "tcgen05 (Blackwell, decode) pipeline, split over the keys")
