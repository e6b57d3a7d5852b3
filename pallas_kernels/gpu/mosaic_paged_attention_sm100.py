"""Mosaic GPU kernel (Blackwell, sm_100a): paged decode attention with tcgen05 MMAs and
tensor-memory accumulators.

The Hopper kernel of :mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention` multiplies
with WGMMA, which Blackwell's sm_100a compile refuses. This is its decode path (one query
position per sequence) for compute capability 10.x, the same launch ``(items, kv_heads,
splits)`` and the same pipeline: one program takes one GQA group's query rows of one
sequence and walks its split's key blocks (``block_kv`` keys, whole pages), each page copied
in place from the pool by its own TMA copy, ``stages`` blocks in flight through a
shared-memory ring; the splits are merged by XLA with logsumexp weights.

What changes is the matrix unit. ``Q K^T`` is a tcgen05 MMA into a ``[128, block_kv]``
float32 tensor-memory (TMEM) tile, read into registers for the online softmax (one TMEM lane,
one register row, per query row: the row max and sum stay in each thread); ``P V``
accumulates in a ``[128, head_dim]`` TMEM tile across the blocks, rescaled in place by the
softmax's correction (read, scaled and stored back 64 columns at a time, so the output never
holds registers across the loop: head_dim 256 fits). The query tile is tcgen05's ``M = 128``
rows; a decode group uses ``group <= 128`` of them.

Why a matrix unit at all for decode: a key costs ``4 * head_dim`` bytes of K and V (16-bit)
and ``4 * group * head_dim`` flops, ``group`` flops a byte. The B200's 8 TB/s against its
~80 TFLOP/s of float32 FMA on CUDA cores puts the CUDA-core ridge near 10 flops a byte: at
GQA groups of 8 a CUDA-core kernel would be compute-bound, before the bf16 conversions and
shared-memory reads its FMAs need. tcgen05 (2.25 PFLOP/s dense bf16, ridge ~280) keeps even
the 128-row padded tile (16x the flops of a group of 8: 128 flops a byte) memory-bound.

Values a row does not see never reach it: logits are hidden by selection; the value rows of
a boundary block (outside the sequence's keys, on a page an entry does not name) are zeroed
in shared memory before ``P V`` (``0 * NaN`` would be NaN), as in the Hopper decode path.
A block-table entry of -1 (unused, or naming no page of the pool) reads page 0, hidden.

Constraints (:func:`supports` of the paged record on 10.x): one query position per sequence;
bfloat16/float16 queries and pages of one dtype; ``head_dim`` a multiple of 64 up to 256;
``page_size`` as the Hopper kernel's, up to 128 (:data:`MAX_BLOCK_KV`); ``group <= 128``.
Chunked prefill, ragged steps and int8/fp8 pages stay on Hopper (their NaN bookkeeping and
dequantized tiles are WGMMA code).

In the Mosaic GPU interpreter (``interpret=True``, JAX 0.12 or newer: 0.10's interpreter has
no tensor memory) everything is the compiled kernel's code; register layouts, which the
interpreter has no rules for, are skipped.

Op: :func:`forge_jax.ops.paged.paged_attention` (served by the ``"mosaic_gpu"`` paged record
on 10.x devices); reference: :func:`forge_jax.ops.paged.paged_attention_xla`. Tests:
``tests/test_pallas_mgpu_paged_sm100.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _common, _mosaic, _mosaic_paged
from forge_jax.pallas_kernels.gpu._mosaic_paged import Config
from forge_jax.pallas_kernels.gpu.mosaic_paged_limits import (
    MIN_STAGES,
    SMEM_LIMIT,
    block_keys,
)

pl = _compat.pallas()

ROWS = 128  # query rows per program: tcgen05's M (one TMEM lane each)
CHUNK = 64  # TMEM columns read into registers at a time when the output is rescaled
# Keys per block whose [ROWS, block_kv] float32 logits (a row per thread: block_kv registers)
# compile without spills: 256 (pages of 256) spilled ~1 KB at head_dim 64 (b200, JAX 0.10.2).
MAX_BLOCK_KV = 128


# Not measured (no Blackwell has run the kernel): the Hopper kernel's ring, whose ~128 KiB in
# flight per SM covers HBM latency at the B200's ~54 GB/s per SM as well; head_dim 256
# fits two stages beside its 64 KiB query tile.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = _mosaic_paged.TUNED
INTERPRET = _mosaic_paged.INTERPRET
TARGET_PROGRAMS = 296  # two per SM of a B200


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch parameters for ``args["q"]`` on ``device_kind`` (``"interpret"``: the
    interpreter's)."""
    return _mosaic_paged.config_for(TUNED, INTERPRET, args, device_kind)


def smem_bytes(*, head_dim: int, block_kv: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory before Mosaic's alignment: the query tile and positions, then the
    larger of the key/value ring with the probability tile, or the float32 output staging."""
    ring = (2 * stages * block_kv * head_dim + ROWS * block_kv) * itemsize + 3 * stages * 8
    staging = ROWS * head_dim * 4 + 2 * ROWS * 4
    return ROWS * head_dim * itemsize + ROWS * 4 + 8 + max(ring, staging)


def fitting_stages(stages: int, *, head_dim: int, block_kv: int) -> int:
    """The most stages up to ``stages`` within :data:`SMEM_LIMIT` (at least two)."""
    while stages > MIN_STAGES and smem_bytes(head_dim=head_dim, block_kv=block_kv,
                                             stages=stages) > SMEM_LIMIT:
        stages -= 1
    return stages


def _kernel(q_ref, pos_ref, range_ref, tables_ref, k_ref, v_ref,  # inputs (GMEM)
            o_ref, m_ref, l_ref,  # outputs (GMEM)
            *, scale, sliding_window, logits_soft_cap, page_size, block_kv, stages,
            blocks_per_split, out_rows, interpret):
    # q_ref [items, kv_heads, ROWS, head_dim]; pos_ref [items, ROWS] (-1: padding row);
    # range_ref [items, 4]: key_lo, key_hi; tables_ref [items, width], -1: no page;
    # k_ref, v_ref [kv_heads, num_pages, page_size, head_dim].
    plgpu = _compat.pallas_mosaic_gpu()
    item, head, split, key_lo, key_hi, first, steps, entry = _mosaic_paged.key_blocks(
        range_ref, tables_ref, blocks_per_split=blocks_per_split, block_kv=block_kv,
        page_size=page_size)
    head_dim, dtype = q_ref.shape[-1], q_ref.dtype
    pages_per_block = block_kv // page_size
    tmem_layout = plgpu.Layout.TCGEN05
    row_layout = tmem_layout.reduce(1)
    # The value tile's zeroing reads it in the layout shared-memory loads take by default.
    v_row_layout = plgpu.Layout.WGMMA.reduce(1)
    cast = functools.partial(_mosaic.layout_cast, interpret=interpret)
    load_tmem = functools.partial(_mosaic.load_tmem, interpret=interpret)
    named_keys = functools.partial(_mosaic_paged.named_keys, page_size=page_size,
                                   block_kv=block_kv)

    def pipeline(q_smem, pos_smem, q_bar, s_tmem, o_tmem, k_smem, v_smem, p_smem, k_bar,
                 v_bar, mma_bar):
        def fetch(step, slot):
            _mosaic_paged.fetch_pages(
                functools.partial(entry, first + step),
                [(k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar)], pages=pages_per_block,
                head=head, slot=slot, page_size=page_size)

        for s in range(stages):
            pl.when(s < steps)(functools.partial(fetch, s, s))

        plgpu.barrier_wait(q_bar.at[0])
        pos = cast(pos_smem[...], row_layout)  # [ROWS]

        def step_fn(step, carry):
            m_prev, l_prev = carry
            slot = lax.rem(step, stages)
            block = first + step
            start = block * block_kv
            entries = [entry(block, p) for p in range(pages_per_block)]

            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.tcgen05_mma(s_tmem, q_smem, _mosaic.transposed(k_smem.at[slot]),
                              mma_bar.at[0], accumulate=False)
            plgpu.barrier_wait(mma_bar.at[0])
            s, _ = _mosaic_paged.masked_logits(  # [ROWS, block_kv] float32
                load_tmem(s_tmem) * scale, pos, start=start, key_lo=key_lo, key_hi=key_hi,
                entries=entries, layout=tmem_layout, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap, page_size=page_size, block_kv=block_kv,
                interpret=interpret)

            p_blk, alpha, m_next, l_next = _mosaic.online_softmax(s, m_prev, l_prev)
            p_smem[...] = p_blk.astype(dtype)

            plgpu.barrier_wait(v_bar.at[slot])
            v_slot = v_smem.at[slot]
            boundary = (start < key_lo) | (start + block_kv > key_hi)
            for page in entries:
                boundary |= page < 0

            @pl.when(boundary)
            def _():  # the block's values no row sees: zeroed (0 * NaN is NaN)
                vkey = start + _mosaic.iota(jnp.int32, (block_kv,), 0, v_row_layout,
                                            interpret=interpret)
                in_range = named_keys(vkey, entries, start) & (vkey >= key_lo) & (vkey < key_hi)
                v = v_slot[...]
                keep = lax.broadcast_in_dim(jnp.where(in_range, 1.0, 0.0), v.shape, [0]) > 0.0
                v_slot[...] = jnp.where(keep, v, jnp.zeros((), dtype))

            @pl.when(step > 0)
            def _():  # the output so far, rescaled in TMEM by the softmax's correction
                _mosaic.rescale_tmem(o_tmem, alpha, chunk=CHUNK, interpret=interpret)

            # P, the zeroed values and the rescaled output visible to the MMA; every thread
            # past its reads of S (the next Q K^T overwrites it).
            plgpu.commit_smem()
            plgpu.tcgen05_mma(o_tmem, p_smem, v_slot, mma_bar.at[0], accumulate=step > 0)
            plgpu.barrier_wait(mma_bar.at[0])

            _mosaic.refill(fetch, step, slot, stages=stages, steps=steps)

            return m_next, l_next

        return lax.fori_loop(0, steps, step_fn,
                             _mosaic.softmax_init(ROWS, row_layout, interpret=interpret))

    def epilogue(m, l_sum, o_tmem, o_smem, ml_smem):
        @pl.when(steps > 0)
        def _():
            for c in range(0, head_dim, CHUNK):
                o_smem[:, pl.ds(c, CHUNK)] = load_tmem(o_tmem.at[:, pl.ds(c, CHUNK)])

        @pl.when(steps == 0)
        def _():  # the TMEM tile was never written (any bits); the rows saw nothing
            o_smem[...] = jnp.zeros(o_smem.shape, jnp.float32)

        _mosaic_paged.write_split(m, l_sum, o_smem, ml_smem, (o_ref, m_ref, l_ref),
                                  at=(item, head, split), out_rows=out_rows)

    def program(q_smem, pos_smem, q_bar, s_tmem, o_tmem):
        plgpu.copy_gmem_to_smem(q_ref.at[item, head], q_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_ref.at[item], pos_smem, q_bar.at[0])
        pages_barrier = plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages)
        m, l_sum = pl.run_scoped(
            functools.partial(pipeline, q_smem, pos_smem, q_bar, s_tmem, o_tmem),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), dtype),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), dtype),
            _mosaic.swizzled_smem((ROWS, block_kv), dtype),
            pages_barrier, pages_barrier,
            plgpu.Barrier(num_arrivals=1, num_barriers=1, orders_tensor_core=True))
        pl.run_scoped(functools.partial(epilogue, m, l_sum, o_tmem),
                      plgpu.SMEM((ROWS, head_dim), jnp.float32),
                      plgpu.SMEM((2, ROWS), jnp.float32))

    pl.run_scoped(program, _mosaic.swizzled_smem((ROWS, head_dim), dtype),
                  plgpu.SMEM((ROWS,), jnp.int32), plgpu.Barrier(num_arrivals=2, num_barriers=1),
                  plgpu.TMEM((ROWS, block_kv), jnp.float32),
                  plgpu.TMEM((ROWS, head_dim), jnp.float32))


def attend_decode(qg, row_pos, ranges, tables, k_pages, v_pages, *, scale, sliding_window,
                  logits_soft_cap, out_rows, block_kv=None, stages=None, num_splits=None,
                  interpret=False, sinks=None):
    """The kernel over ``items`` decode queries' GQA groups, splits merged: ``[items,
    kv_heads, out_rows, head_dim]`` float32, normalised (the arguments of
    :func:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention.attend`, ``qg`` padded to
    :data:`ROWS` rows, every row of an item at one position)."""
    items, kv_heads, _, head_dim = qg.shape
    page_size = k_pages.shape[2]
    config = default_config({"q": qg}, "interpret" if interpret else _common.device_kind())
    block_kv = block_keys(block_kv or config.block_kv, page_size)
    stages = stages or fitting_stages(config.stages, head_dim=head_dim, block_kv=block_kv)
    max_pages = tables.shape[1]
    num_splits, blocks_per_split, tables = _mosaic_paged.split_launch(
        tables, items=items, kv_heads=kv_heads, page_size=page_size, block_kv=block_kv,
        max_splits=config.max_splits, target_programs=TARGET_PROGRAMS, num_splits=num_splits)
    kv_bytes = 2 * items * kv_heads * max_pages * page_size * head_dim * k_pages.dtype.itemsize
    kernel = functools.partial(
        _kernel, scale=float(scale), sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, page_size=page_size, block_kv=block_kv,
        stages=stages, blocks_per_split=blocks_per_split, out_rows=out_rows,
        interpret=interpret)
    return _mosaic_paged.launch(
        kernel, qg, row_pos, ranges, tables, k_pages, v_pages,
        name="forge_jax_mosaic_paged_attention_sm100", num_splits=num_splits,
        out_rows=out_rows, keys=max_pages * page_size, kv_bytes=kv_bytes, interpret=interpret,
        sinks=sinks)


def reason(*, q_len: int, group: int, quantized: bool, head_dim: int,
           page_size: int) -> str | None:
    """Why a paged call cannot take this kernel, beyond the layout limits it shares with the
    Hopper kernel (:func:`forge_jax.pallas_kernels.gpu.mosaic_paged_limits.layout_reason`)."""
    if q_len != 1:
        return (f"q_len={q_len}: on Blackwell (tcgen05) the Mosaic GPU paged kernel serves "
                "decode (one query position); several positions are WGMMA code, which "
                "sm_100a refuses")
    if quantized:
        return ("int8/fp8 pages: on Blackwell (tcgen05) the Mosaic GPU paged kernel takes "
                "16-bit pages; the dequantizing path is WGMMA code, which sm_100a refuses")
    if group > ROWS:
        return f"q_heads // kv_heads = {group} > {ROWS} query rows (tcgen05's M)"
    block_kv = block_keys(_common.tuned(TUNED, None, head_dim)["block_kv"], page_size)
    if block_kv > MAX_BLOCK_KV:
        return (f"page_size={page_size}: blocks of {block_kv} keys hold {block_kv} float32 "
                f"logits per thread, and the b200 compile spills registers past "
                f"{MAX_BLOCK_KV}")
    if smem_bytes(head_dim=head_dim, block_kv=block_kv, stages=MIN_STAGES) > SMEM_LIMIT:
        return (f"head_dim={head_dim} with page_size={page_size} (blocks of {block_kv} keys): "
                f"the {ROWS}-row query tile and {MIN_STAGES} key/value blocks in flight "
                f"exceed the {SMEM_LIMIT // 1024} KiB of shared memory")
    return None
