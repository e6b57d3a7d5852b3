"""Mosaic GPU kernel (Blackwell, sm_100a): flash attention forward with tcgen05 MMAs and
tensor-memory accumulators; backward by XLA.

The Hopper kernel of :mod:`forge_jax.pallas_kernels.gpu.mosaic_attention` (FA3: a producer
warpgroup, two WGMMA consumers) does not compile for sm_100a. This one is a first Blackwell
design, one warpgroup per program: a program takes 128 query rows of one kv head of one
sequence (the GQA group's heads query-major, so K/V are read once for the group and never
repeated), streams K/V tiles of ``block_kv`` keys in place from ``[batch, kv_len, kv_heads,
head_dim]`` by TMA through a ``stages``-deep shared-memory ring, and multiplies with tcgen05:
``S = Q K^T`` into a ``[128, block_kv]`` float32 tensor-memory (TMEM) tile read into registers
(one row per thread) for the masks and the online softmax, ``O += P V`` into a ``[128,
head_dim]`` TMEM accumulator rescaled in place 64 columns at a time. Not done (yet): FA4's
warp specialisation (a load warp, an MMA warp, softmax and correction warpgroups) and two
query tiles ping-ponging, which overlap the softmax with the MMAs.

The contract is :func:`forge_jax.attention`'s, as the Hopper kernel keeps it: the XLA
wrapper computes per program the keys some row sees ``[key_lo, key_hi)`` and the keys every
row sees ``[all_lo, all_hi)``; only the tiles of the first range are loaded and computed. A
hidden key is hidden from the logits by selection. A *boundary* tile (one holding a key some
row does not see, or the clamped last tile) has its non-finite values zeroed in shared memory
before ``P V`` (``0 * NaN`` is NaN) and a second MMA ``visible @ nonfinite`` accumulates, in
a TMEM tile of its own, how many non-finite values each row sees in each column; those
columns of those rows are NaN in the output. The last tile of a ``kv_len`` that is not a
multiple of ``block_kv`` is read from ``kv_len - block_kv`` (keys already seen hidden), so
K/V are padded only when ``kv_len < block_kv`` or ``kv_len % 8`` (TMA's row tiling).
Chunked attention and attention sinks as in the Hopper kernel: the ranges within the rows'
chunks, each row's own chunk hidden by selection, the sink joined after the last tile.

Constraints (:func:`reason`): bfloat16/float16, q, k and v of one dtype; head_dim 64 or 128
(three TMEM tiles: ``block_kv + 2 * head_dim`` of the 512 columns).

In the Mosaic GPU interpreter (``interpret=True``, JAX 0.12 or newer) the kernel is the same
program; register layouts are skipped.

Op: :func:`forge_jax.ops.attention.attention`, through the ``"mosaic_gpu"`` record of
:mod:`forge_jax.pallas_kernels.gpu.mosaic_attention` on compute capability 10.x. Tests:
``tests/test_pallas_mgpu_attention_sm100.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _cost
from forge_jax.pallas_kernels.gpu import _mosaic

pl = _compat.pallas()

ROWS = 128  # query rows per program: tcgen05's M
BLOCK_KV = 64
STAGES = 3
CHUNK = 64  # TMEM columns read into registers at a time
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
NAME = "forge_jax_mosaic_attention_sm100"


def reason(*, dtypes, head_dim: int) -> str | None:
    """Why the kernel cannot take these inputs, or None."""
    if len(set(dtypes)) != 1 or jnp.dtype(dtypes[0]) not in DTYPES:
        return (f"dtypes {[jnp.dtype(d).name for d in dtypes]}: the Blackwell kernel takes "
                "bfloat16 or float16, q, k and v alike")
    if head_dim not in HEAD_DIMS:
        return (f"head_dim={head_dim}: the Blackwell kernel takes {HEAD_DIMS} (its three TMEM "
                "tiles, S, O and the non-finite counts, share 512 columns; at 256 and 512 its "
                "shared memory tiles alone exceed the 227 KiB the b200 compile allows)")
    return None


def _ranges(row_pos, lengths, *, causal, sliding_window, block_kv, attention_chunk_size=None):
    """Per program (128 rows), int32 ``[batch, blocks, 8]``: first and last tile, the keys
    some row sees ``[key_lo, key_hi)`` and those every row sees ``[all_lo, all_hi)``."""
    batch, rows_pad = row_pos.shape
    blocks = row_pos.reshape(batch, rows_pad // ROWS, ROWS)
    lo_pos, hi_pos = blocks.min(axis=-1), blocks.max(axis=-1)
    t_lo, t_hi, key_lo, key_hi, all_lo, all_hi = _attention_common.key_spans(
        lo_pos, hi_pos, lengths, causal=causal, sliding_window=sliding_window,
        block_kv=block_kv, attention_chunk_size=attention_chunk_size)
    zero = jnp.zeros_like(key_hi)
    info = jnp.stack([t_lo, t_hi, key_lo, key_hi, all_lo, all_hi, zero, zero], axis=-1)
    return info.astype(jnp.int32)


def _kernel(q_ref, k_ref, v_ref, pos_ref, info_ref, *refs, scale, causal, sliding_window,
            logits_soft_cap, block_kv, stages, interpret, attention_chunk_size=None,
            has_sinks=False):
    # q_ref, o_ref [batch, kv_heads, rows_pad, head_dim]; k_ref, v_ref [batch, kv_len,
    # kv_heads, head_dim]; pos_ref [batch, rows_pad]; info_ref [batch, blocks, 8]; with
    # sinks, sink_ref [kv_heads, rows_pad] f32: each row's head's sink logit.
    sink_ref, o_ref = refs if has_sinks else (None, *refs)
    plgpu = _compat.pallas_mosaic_gpu()
    b, h, blk = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("rows")
    kv_len, head_dim = k_ref.shape[1], k_ref.shape[3]
    dtype = q_ref.dtype
    rows = pl.ds(blk * ROWS, ROWS)
    t_lo, t_hi = info_ref[b, blk, 0], info_ref[b, blk, 1]
    key_lo, key_hi = info_ref[b, blk, 2], info_ref[b, blk, 3]
    all_lo, all_hi = info_ref[b, blk, 4], info_ref[b, blk, 5]
    steps = t_hi - t_lo
    tmem_layout = plgpu.Layout.TCGEN05
    row_layout = tmem_layout.reduce(1)
    cast = functools.partial(_mosaic.layout_cast, interpret=interpret)

    load_tmem = functools.partial(_mosaic.load_tmem, interpret=interpret)

    def start_of(step):  # the last tile ends at kv_len
        return jnp.minimum((t_lo + step) * block_kv, kv_len - block_kv)

    def pipeline(q_smem, pos_smem, q_bar, s_tmem, o_tmem, hits_tmem, k_smem, v_smem,
                 p_smem, seen_smem, bad_smem, k_bar, v_bar, mma_bar):
        def fetch(step, slot):
            keys = (b, pl.ds(start_of(step), block_kv), h)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_bar.at[slot])

        for s in range(stages):
            pl.when(s < steps)(functools.partial(fetch, s, s))
        for c in range(0, head_dim, CHUNK):  # no non-finite value seen yet
            plgpu.async_store_tmem(hits_tmem.at[:, pl.ds(c, CHUNK)],
                                   cast(jnp.zeros((ROWS, CHUNK), jnp.float32), tmem_layout))
        plgpu.commit_tmem()
        plgpu.barrier_wait(q_bar.at[0])
        pos = cast(pos_smem[...], row_layout)
        if attention_chunk_size is not None:
            # The first key of each row's chunk, floor(pos / size) * size (rem truncates).
            rem = lax.rem(pos, attention_chunk_size)
            chunk_lo = pos - jnp.where(rem < 0, rem + attention_chunk_size, rem)

        def mma(acc, a, b_ref, accumulate):
            plgpu.tcgen05_mma(acc, a, b_ref, mma_bar.at[0], accumulate=accumulate)
            plgpu.barrier_wait(mma_bar.at[0])

        def step_fn(step, carry):
            m_prev, l_prev = carry
            slot = lax.rem(step, stages)
            tile = (t_lo + step) * block_kv
            start = start_of(step)
            plgpu.barrier_wait(k_bar.at[slot])
            mma(s_tmem, q_smem, _mosaic.transposed(k_smem.at[slot]), False)
            s = load_tmem(s_tmem) * scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
            key = start + _mosaic.iota(jnp.int32, (ROWS, block_kv), 1, tmem_layout,
                                       interpret=interpret)
            row = lax.broadcast_in_dim(pos, (ROWS, block_kv), [0])
            # Keys of the clamped last tile below `tile` were seen by the step before.
            visible = (key >= jnp.maximum(key_lo, tile)) & (key < key_hi)
            if causal:
                visible &= key <= row
            if sliding_window is not None:
                visible &= key > row - sliding_window
            if attention_chunk_size is not None:
                first = lax.broadcast_in_dim(chunk_lo, (ROWS, block_kv), [0])
                visible &= (key >= first) & (key - first < attention_chunk_size)
            s = jnp.where(visible, s, -jnp.inf)
            p, alpha, m_next, l_next = _mosaic.online_softmax(s, m_prev, l_prev)
            p_smem[...] = p.astype(dtype)
            full = (start == tile) & (start >= all_lo) & (start + block_kv <= all_hi)

            @pl.when(~full)
            def _():  # stored now: the mask would otherwise hold registers until P V
                seen_smem[...] = jnp.where(visible, jnp.ones((), dtype), jnp.zeros((), dtype))

            plgpu.barrier_wait(v_bar.at[slot])
            v_slot = v_smem.at[slot]

            @pl.when(~full)
            def _():  # x - x is NaN exactly for NaN and +-inf
                v = v_slot[...]
                diff = (v - v).astype(jnp.float32)
                v_slot[...] = jnp.where(diff == 0.0, v, jnp.zeros((), dtype))
                bad_smem[...] = jnp.where(diff != 0.0, jnp.ones((), dtype), jnp.zeros((), dtype))

            @pl.when(step > 0)
            def _():
                _mosaic.rescale_tmem(o_tmem, alpha, chunk=CHUNK, interpret=interpret)

            plgpu.commit_smem()
            mma(o_tmem, p_smem, v_slot, step > 0)

            @pl.when(~full)
            def _():
                mma(hits_tmem, seen_smem, bad_smem, True)

            _mosaic.refill(fetch, step, slot, stages=stages, steps=steps)

            return m_next, l_next

        return lax.fori_loop(0, steps, step_fn,
                             _mosaic.softmax_init(ROWS, row_layout, interpret=interpret))

    def program(q_smem, pos_smem, q_bar, s_tmem, o_tmem, hits_tmem, *sink_smem):
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar.at[0])
        plgpu.copy_gmem_to_smem(pos_ref.at[b, rows], pos_smem, q_bar.at[0])
        if has_sinks:
            plgpu.copy_gmem_to_smem(sink_ref.at[h, rows], sink_smem[0], q_bar.at[0])
        m, l_sum = pl.run_scoped(
            functools.partial(pipeline, q_smem, pos_smem, q_bar, s_tmem, o_tmem, hits_tmem),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), dtype),
            _mosaic.swizzled_smem((stages, block_kv, head_dim), dtype),
            _mosaic.swizzled_smem((ROWS, block_kv), dtype),
            _mosaic.swizzled_smem((ROWS, block_kv), dtype),
            _mosaic.swizzled_smem((block_kv, head_dim), dtype),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=1, orders_tensor_core=True))
        # A row that saw no key has l_sum == 0 and O == 0: zeros. NaN stays NaN.
        inv = jnp.where(l_sum > 0, 1.0 / jnp.where(l_sum > 0, l_sum, 1.0), 0.0)
        if has_sinks:
            # The sink joins the denominator and weighs no value (forge_jax.ops.attention):
            # one more key of logit `sink`; NaN or +inf in it gives NaN (exp(inf - inf)),
            # also in a row that saw no key.
            sink = cast(sink_smem[0][...], row_layout)
            m_next = jnp.maximum(m, sink)
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            correction = jnp.exp2((m - m_safe) * _mosaic.LOG2E)
            l_sum = l_sum * correction + jnp.exp2((sink - m_safe) * _mosaic.LOG2E)
            inv = correction / jnp.where(l_sum == 0, 1.0, l_sum)

        @pl.when(steps > 0)
        def _():
            for c in range(0, head_dim, CHUNK):
                o = load_tmem(o_tmem.at[:, pl.ds(c, CHUNK)])
                hits = load_tmem(hits_tmem.at[:, pl.ds(c, CHUNK)])
                o = jnp.where(hits > 0, jnp.float32(jnp.nan),
                              o * lax.broadcast_in_dim(inv, o.shape, [0]))
                q_smem[:, pl.ds(c, CHUNK)] = o.astype(dtype)

        @pl.when(steps == 0)
        def _():
            zeros = cast(jnp.zeros(q_smem.shape, jnp.float32), tmem_layout)
            if has_sinks:  # NaN where the sink is (inv - inv: 0, or NaN)
                zeros = zeros + lax.broadcast_in_dim(inv - inv, zeros.shape, [0])
            q_smem[...] = zeros.astype(dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(program, _mosaic.swizzled_smem((ROWS, q_ref.shape[-1]), dtype),
                  plgpu.SMEM((ROWS,), jnp.int32),
                  plgpu.Barrier(num_arrivals=2 + has_sinks, num_barriers=1),
                  plgpu.TMEM((ROWS, block_kv), jnp.float32),
                  plgpu.TMEM((ROWS, q_ref.shape[-1]), jnp.float32),
                  plgpu.TMEM((ROWS, q_ref.shape[-1]), jnp.float32),
                  *[plgpu.SMEM((ROWS,), jnp.float32)] * has_sinks)


def forward(q, k, v, positions, lengths, sinks=None, *, scale, causal, sliding_window,
            logits_soft_cap, block_kv=BLOCK_KV, stages=STAGES, interpret=False,
            attention_chunk_size=None):
    """The kernel on explicit ``positions [batch, q_len]`` and ``lengths [batch]``
    (:func:`forge_jax.pallas_kernels._attention_common.flash_attention_call` supplies them
    and the VJP): ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``."""
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows_pad = pl.cdiv(q_len * group, ROWS) * ROWS
    kv_pad = max(block_kv, -(-kv_len // 8) * 8)
    if kv_pad != kv_len:  # TMA tiles rows by 8; a tile needs block_kv keys (padding hidden)
        pad = ((0, 0), (0, kv_pad - kv_len), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    qg = _attention_common.group_queries(q, kv_heads, rows_pad=rows_pad)
    row_pos = jnp.repeat(positions, group, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_pad - q_len * group)), mode="edge")
    row_pos = row_pos.astype(jnp.int32)
    info = _ranges(row_pos, lengths, causal=causal, sliding_window=sliding_window,
                   block_kv=block_kv, attention_chunk_size=attention_chunk_size)
    extra = []
    if sinks is not None:  # [kv_heads, rows_pad]: row r of kv head h is head h * group + r % group
        row_sinks = jnp.tile(sinks.reshape(kv_heads, 1, group), (1, q_len, 1))
        extra.append(jnp.pad(row_sinks.reshape(kv_heads, q_len * group),
                             ((0, 0), (0, rows_pad - q_len * group))))
    body = functools.partial(
        _kernel, scale=float(scale), causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, block_kv=block_kv, stages=stages,
        interpret=interpret, attention_chunk_size=attention_chunk_size,
        has_sinks=sinks is not None)
    cost = _cost.attention(queries=batch * q_len * q_heads, keys=kv_len, head_dim=head_dim,
                           causal=causal and q_len == kv_len, io=(qg, k, v, qg))
    call = _mosaic.mesh_kernel(
        body, out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        grid=(batch, kv_heads, rows_pad // ROWS), grid_names=("batch", "heads", "rows"),
        cost_estimate=cost, name=NAME,
        compiler_params=_compat.pallas_mosaic_gpu().CompilerParams(approx_math=True),
        interpret=interpret)
    out = call(qg, k, v, row_pos, info, *extra)
    return _attention_common.ungroup_queries(out, q_len=q_len, q_heads=q_heads,
                                             head_dim=head_dim)
