"""Mosaic GPU kernel (Hopper): flash attention forward in the FA3 design; backward by XLA.
(On Blackwell, compute capability 10.x, the record runs the tcgen05 kernel of
:mod:`forge_jax.pallas_kernels.gpu.mosaic_attention_sm100` instead: ``mma="tcgen05"``.)

One CTA serves ``2 * block_q`` query rows of one kv head of one sequence with three
warpgroups. The queries of a GQA group are laid out query-major as ``q_len * group`` rows
(:func:`~forge_jax.pallas_kernels._attention_common.group_queries`; row ``r`` is query
``r // group``, head ``r % group``), so every K/V tile is read once for all the group's
heads and K/V are never repeated. Warpgroup 2 (the producer) streams K and V tiles of
``block_kv`` keys with TMA into a ``stages``-deep shared-memory ring; warpgroups 0 and 1
(the consumers) each own ``block_q`` rows: ``S = Q K^T`` by WGMMA from shared memory, the
masks and the online softmax (float32, base 2) in registers, then ``O += P V`` by WGMMA
with ``P`` from registers. Barriers: "tile landed" (TMA transaction counts) from producer
to consumers, "tile consumed" (two arrivals) back, and FA3's ping-pong schedule between
the consumers (``Config.ping_pong``; on up to head_dim 128): they meet twice a step,
warpgroup 1 half a step behind 0, once after issuing ``Q K^T`` and once after the softmax,
so that one's softmax runs while the other's WGMMAs do. The consumers hold 240 registers
a thread and the producer 32 (``setmaxnreg``: the whole register file, FA3's split).

At head_dim 256 a consumer's ``[64, 256]`` float32 accumulator alone would take 128 of its
registers and the boundary copies below spill (ptxas), so V's columns are split: the CTAs
of one query block (grid axis ``cols``) each compute ``S = Q K^T`` over the whole head_dim
and ``O = P V`` for ``block_d = 128`` of V's columns (1.5 times the minimal flops, K read
twice; 192 KiB of shared memory).

The contract is that of :func:`forge_jax.attention`, with the explicit positions and
lengths of :func:`~forge_jax.pallas_kernels._attention_common.explicit_positions`. The
XLA wrapper computes, per warpgroup's rows, the key range ``[key_lo, key_hi)`` some row
sees (causal bound, ``kv_lengths``, sliding window) and the range every row sees; the CTA
loads only the K/V tiles from the first to the last tile of its two warpgroups' ranges
(tiles no row of the CTA sees are neither loaded nor computed), and each consumer computes
only the tiles of its own range (it waits on and releases the others). Inside a tile a key
hidden from a row is hidden by ``where`` on the logits (which takes NaN in hidden K out).
A tile that holds a key some row does not see (the edges of the ranges) is a *boundary*
tile: a consumer copies its V tile with non-finite values zeroed (``0 * NaN`` is NaN: a
zero probability does not hide a NaN value) and a 0/1 tile of where they were, and a second
WGMMA ``visible @ nonfinite`` marks NaN exactly the output columns of the rows that see
one. So NaN/inf a row may not see never reaches it, NaN it sees propagates; interior tiles
(every key visible to every row) take the fast path. Chunks narrow the ranges to the rows'
chunks and hide, per row, the keys outside its own; a sink (a float32 per row, its head's,
copied with the positions) joins each row's softmax after the last tile as a key of value 0.

K/V are read in place (``[batch, kv_len, kv_heads, head_dim]``, one strided TMA per tile);
the last tile of a ``kv_len`` that is not a multiple of ``block_kv`` is read from
``kv_len - block_kv`` and its keys already seen are masked, so nothing is padded unless
``kv_len < block_kv`` or ``kv_len`` is not a multiple of 8 (TMA's row tiling): then K/V
are copied zero-padded. Not done (yet): FA3's intra-warpgroup overlap (the next tile's
``Q K^T`` issued before this tile's softmax); the ping-pong at head_dim 256 (it spilled 20
bytes with a window and soft cap); head_dim 256 without recomputing ``S`` per column half
(JAX 0.10's Mosaic GPU lowering cannot concatenate register arrays, so the accumulator
cannot be cleaned a column block at a time, and ptxas spilled every single-CTA layout
tried); fp8 inputs (:func:`forge_jax.attention` defines no fp8 representation of q, k, v:
fp8 exists only for quantized KV pages, ``forge_jax.ops.kv_quant``). :func:`supports`
rejects head dims other than 64, 128 and 256 (at 512 the tiles exceed an H100's 227 KiB of
shared memory: the compiler's reason).

In the Mosaic GPU interpreter (``interpret=True``) the kernel is the same program (warp
specialisation, TMA copies, barriers, shared memory, masks, boundary copies) except where
JAX 0.10's interpreter has no rule: the three products are ``lax.dot_general`` on the same
shared-memory tiles instead of WGMMA (it runs WGMMA only on untransposed shared-memory
operands), and layout casts and ``plgpu.load`` are plain reads.

Backward: :func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`, the VJP of the XLA
reference (:func:`forge_jax.ops.attention.attention_reference`, which materialises the
``[batch, heads, q_len, kv_len]`` probabilities), as for the Triton kernel: no Mosaic
backward kernel has been written and checked.

Op: :func:`forge_jax.ops.attention.attention`; reference: its XLA implementation.
Registered (bottom of this module) as ``"mosaic_gpu"`` (compute capability >= 9.0; by name
until :data:`VERIFIED` names a GPU) and ``"mosaic_gpu_interpret"`` (the Mosaic GPU
interpreter, any platform). Tests: ``tests/test_pallas_mgpu_attention.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _cost, _registration
from forge_jax.pallas_kernels._attention_common import POS_LIMIT
from forge_jax.pallas_kernels.gpu import _mosaic, mosaic_attention_sm100

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (compiled
# deviceless for an H100 and run in the Mosaic GPU interpreter only).
VERIFIED: dict[str, str] = {}

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # WGMMA operands from registers
HEAD_DIMS = (64, 128, 256)
# Shared memory of an H100 (sm_90) block: 227 KiB.
SHARED_MEMORY = 227 * 1024
_LOG2E = math.log2(math.e)
NAME = "forge_jax_mosaic_flash_attention"  # the kernel's name in profiles and compile reports
_CONSUMERS = 2  # warpgroups computing; warpgroup _CONSUMERS is the producer
# Registers a thread of each warpgroup holds after setmaxnreg: the consumers take all the
# producer does not need (2 * 240 + 32 = 512, the register file over 128 threads), as FA3
# does; at 232 / 40 head_dim 256 with a window and soft cap spilled 32 bytes.
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 240, 32
# int32 words of per-warpgroup bookkeeping (see _ranges; 8 used): a copy moves a multiple of
# 128 bytes (the warpgroup size) from global to shared memory.
_INFO = 32


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch knobs: ``block_q`` rows per consumer warpgroup (one WGMMA M tile: 64),
    ``block_kv`` keys per tile (a multiple of 64: the 128-byte swizzle of 16-bit tiles),
    ``stages`` K/V tiles in flight, ``block_d`` the output (V) columns one CTA computes (a
    multiple of 64 dividing head_dim; None: all). Below head_dim, the CTAs of one query
    block split V's columns and each computes ``S = Q K^T`` over the whole head_dim: at
    head_dim 256 a consumer's ``[64, 256]`` float32 accumulator would take 128 of its
    registers, and the boundary tiles' copies then spill (ptxas, BENCHMARKS.md); two CTAs of
    128 columns do 1.5 times the minimal flops without spilling."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2
    block_d: int | None = None
    ping_pong: bool = True


def _block_d(head_dim: int, config: Config) -> int:
    return head_dim if config.block_d is None else config.block_d


# Not measured (no GPU has run the kernel): sizes checked only to compile for an H100 without
# spills (tests/test_pallas_mgpu_attention.py, BENCHMARKS.md).
TUNED: Mapping[int, Config] = {
    64: Config(block_q=64, block_kv=128, stages=2),
    128: Config(block_q=64, block_kv=64, stages=2),
    # The ping-pong spilled 20 bytes with a window and soft cap at head_dim 256.
    256: Config(block_q=64, block_kv=64, stages=2, block_d=128, ping_pong=False),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs for ``args["q"]`` (``[batch, q_len, q_heads, head_dim]``)."""
    del device_kind  # one table until a GPU measures them
    return TUNED.get(args["q"].shape[-1], Config())


def shared_memory_bytes(head_dim: int, dtype: Any, config: Config) -> int:
    """The shared memory a CTA allocates: Q/O tiles of both consumers, the K/V ring, each
    consumer's boundary tile, row positions and bookkeeping (barriers not counted)."""
    item = jnp.dtype(dtype).itemsize
    block_d = _block_d(head_dim, config)
    tiles = ((_CONSUMERS * config.block_q + config.stages * config.block_kv) * head_dim
             + (config.stages + _CONSUMERS) * config.block_kv * block_d) * item
    return tiles + 4 * (_CONSUMERS * config.block_q + (_CONSUMERS + 1) * _INFO)


def _ranges(positions, lengths, *, rows_pad, group, block_q, block_kv, causal,
            sliding_window, attention_chunk_size=None):
    """Per warpgroup's rows, int32 ``[batch, rows_pad // (2 block_q), 2, 32]``:
    ``(cta_lo, cta_hi, own_lo, own_hi, key_lo, key_hi, all_lo, all_hi)``: the tile steps
    of the CTA (the union of its two warpgroups'), those of this warpgroup, the keys some
    row of it sees and the keys every row of it sees (empty when ``lo >= hi``). Also the
    position of every row, int32 ``[batch, rows_pad]`` (padding rows repeat the last)."""
    batch, q_len = positions.shape
    row_pos = jnp.repeat(positions, group, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows_pad - q_len * group)), mode="edge")
    blocks = row_pos.reshape(batch, rows_pad // block_q, block_q)
    lo_pos, hi_pos = blocks.min(axis=-1), blocks.max(axis=-1)
    own_lo, own_hi, key_lo, key_hi, all_lo, all_hi = _attention_common.key_spans(
        lo_pos, hi_pos, lengths, causal=causal, sliding_window=sliding_window,
        block_kv=block_kv, attention_chunk_size=attention_chunk_size)
    pairs = lambda x: x.reshape(batch, -1, _CONSUMERS)  # noqa: E731
    own_lo, own_hi = pairs(own_lo), pairs(own_hi)
    empty = own_hi <= own_lo
    cta_lo = jnp.where(empty, POS_LIMIT, own_lo).min(axis=-1, keepdims=True)
    cta_hi = jnp.where(empty, -1, own_hi).max(axis=-1, keepdims=True)
    cta_lo = jnp.where(cta_hi < 0, 0, cta_lo)
    cta_hi = jnp.maximum(cta_hi, cta_lo)
    # A warpgroup with no keys walks none of its own (and waits on the CTA's tiles only).
    own_lo = jnp.where(empty, cta_lo, own_lo)
    own_hi = jnp.where(empty, cta_lo, own_hi)
    info = jnp.stack([jnp.broadcast_to(cta_lo, own_lo.shape),
                      jnp.broadcast_to(cta_hi, own_lo.shape), own_lo, own_hi,
                      pairs(key_lo), pairs(key_hi), pairs(all_lo), pairs(all_hi)], axis=-1)
    info = jnp.pad(info, ((0, 0), (0, 0), (0, 0), (0, _INFO - info.shape[-1])))
    return info.astype(jnp.int32), row_pos.astype(jnp.int32)


def _kernel(q_ref, k_ref, v_ref, pos_ref, info_ref, *refs, scale, causal, sliding_window,
            logits_soft_cap, block_q, block_kv, stages, block_d, ping_pong, interpret,
            attention_chunk_size=None, has_sinks=False):
    # q_ref, o_ref [batch, kv_heads, rows_pad, head_dim]; k_ref, v_ref [batch, kv_len,
    # kv_heads, head_dim]; pos_ref [batch, rows_pad]; info_ref [batch, pairs, 2, _INFO]
    # (see _ranges); with sinks, sink_ref [kv_heads, rows_pad] f32, each row's head's sink
    # logit times log2(e), and its scratch sink_smem. Warpgroups 0 and 1
    # compute, warpgroup 2 loads K and V's columns [cols * block_d, (cols + 1) * block_d).
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    (o_ref,  # output (GMEM)
     qo_smem, k_smem, v_smem, clean_smem, pos_smem, info_smem,  # scratch (SMEM)
     q_bar, pos_bar, info_bar, k_bar, v_bar, k_free, v_free, schedule,  # barriers
     *sink_scratch) = refs
    plgpu = _compat.pallas_mosaic_gpu()
    head = lax.axis_index("heads")
    columns = pl.ds(lax.axis_index("cols") * block_d, block_d)
    pair = lax.axis_index("rows")
    batch = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    kv_len, head_dim = k_ref.shape[1], k_ref.shape[3]
    dtype = q_ref.dtype
    split = block_d < head_dim

    def cast(x, layout):  # JAX 0.10's interpreter has no rule for layout casts: identity
        return x if interpret else plgpu.layout_cast(x, layout)

    def product(a, b_ref, *, transpose_b=False, acc=None, issued=None):
        """``acc + a @ b_ref`` (``b_ref^T``; ``acc`` zeros when None) in float32: a WGMMA
        accumulating in ``acc``'s registers, ``a`` from shared memory (a ref) or registers;
        ``issued()`` runs after the WGMMA is issued, before its result is awaited.
        JAX 0.10's interpreter runs WGMMA only on untransposed shared-memory operands and
        has no rule for ``run_state``: there, the same tiles meet in ``lax.dot_general``."""
        if interpret:
            a = a if isinstance(a, jax.Array) else a[...]
            dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
            out = lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)
            if issued is not None:
                issued()
            return out if acc is None else acc + out
        b = b_ref.transpose((1, 0)) if transpose_b else b_ref  # a TransformedRef

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if issued is not None:
                issued()

        if acc is not None:
            return pl.run_state(run)(plgpu.ACC.init(acc))

        def scoped(acc_ref):
            run(acc_ref)
            return acc_ref[...]

        return pl.run_scoped(scoped, plgpu.ACC((a.shape[0], b.shape[1]), jnp.float32))

    def tile(step):  # the K/V rows of a step: the last tile ends at kv_len
        return pl.ds(jnp.minimum(step * block_kv, kv_len - block_kv), block_kv)

    def read_info(who, source):
        plgpu.copy_gmem_to_smem(info_ref.at[batch, pair, source], info_smem.at[who],
                                info_bar.at[who])
        plgpu.barrier_wait(info_bar.at[who])
        return [info_smem[who, i] for i in range(8)]

    def take_turn():
        # FA3's ping-pong: the consumers meet here twice a step, warpgroup 1 half a step
        # behind 0, so one's softmax overlaps the other's WGMMAs.
        if ping_pong:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        row0 = (pair * _CONSUMERS + wg) * block_q
        q_smem = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, head, pl.ds(row0, block_q)], q_smem,
                                q_bar.at[wg])
        plgpu.copy_gmem_to_smem(pos_ref.at[batch, pl.ds(row0, block_q)], pos_smem.at[wg],
                                pos_bar.at[wg])
        if has_sinks:  # (the positions' barrier counts both copies)
            (sink_smem,) = sink_scratch
            plgpu.copy_gmem_to_smem(sink_ref.at[head, pl.ds(row0, block_q)], sink_smem.at[wg],
                                    pos_bar.at[wg])
        cta_lo, cta_hi, own_lo, own_hi, key_lo, key_hi, all_lo, all_hi = read_info(wg, wg)
        plgpu.barrier_wait(q_bar.at[wg])
        plgpu.barrier_wait(pos_bar.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def rows(smem):  # [block_q] (the interpreter has no rule for plgpu.load)
            return (smem[wg] if interpret
                    else _compat.mosaic_gpu_load(smem.at[wg], layout=row_layout))

        pos = rows(pos_smem)  # the rows' positions
        if attention_chunk_size is not None:
            # The first key of each row's chunk, floor(pos / size) * size (rem truncates).
            rem = lax.rem(pos, attention_chunk_size)
            chunk_lo = pos - jnp.where(rem < 0, rem + attention_chunk_size, rem)

        def wait_only(step, carry):
            # A tile of the CTA this warpgroup does not need: keep the barriers' phases
            # (the schedule's two a step included).
            slot = lax.rem(step - cta_lo, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()
            take_turn()
            return carry

        def step_fn(step, carry):
            acc, m, l_sum = carry
            slot = lax.rem(step - cta_lo, stages)
            plgpu.barrier_wait(k_bar.at[slot])

            # [block_q, block_kv]; the turn passes once the WGMMA is issued
            s = product(q_smem, k_smem.at[slot], transpose_b=True, issued=take_turn)
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
            start = jnp.minimum(step * block_kv, kv_len - block_kv)
            key = start + cast(lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1),
                               plgpu.Layout.WGMMA)
            row = lax.broadcast_in_dim(pos, (block_q, block_kv), [0])
            # Keys of the clamped last tile below step * block_kv were seen by the step before.
            visible = (key >= jnp.maximum(key_lo, step * block_kv)) & (key < key_hi)
            if causal:
                visible &= key <= row
            if sliding_window is not None:
                visible &= key > row - sliding_window
            if attention_chunk_size is not None:
                first = lax.broadcast_in_dim(chunk_lo, (block_q, block_kv), [0])
                visible &= (key >= first) & (key - first < attention_chunk_size)
            s = jnp.where(visible, s * _LOG2E, -jnp.inf)
            m_next = jnp.maximum(m, s.max(axis=1))
            # A row that has seen no key yet keeps m = -inf; exp2(-inf - 0) = 0.
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            correction = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_sum = l_sum * correction + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
            p16 = p.astype(dtype)
            if ping_pong:
                plgpu.barrier_arrive(schedule)  # softmax done: the other's S may run
            plgpu.barrier_wait(v_bar.at[slot])
            if ping_pong:
                plgpu.barrier_wait(schedule)  # and has been issued: P V may run

            def interior(acc):
                return product(p16, v_smem.at[slot], acc=acc)

            def boundary(acc):
                # Zero the tile's non-finite values for P V, then count, per row and
                # column, the non-finite values the row sees. (The tile is read twice
                # rather than keeping its mask live across the product: registers.)
                clean = clean_smem.at[wg]
                values = cast(v_smem[slot], plgpu.Layout.WGMMA)
                clean[...] = jnp.where(values - values == 0, values, jnp.zeros((), dtype))
                plgpu.commit_smem()
                acc = product(p16, clean, acc=acc)
                values = cast(v_smem[slot], plgpu.Layout.WGMMA)
                clean[...] = jnp.where(values - values == 0, jnp.zeros((), dtype),
                                       jnp.ones((), dtype))  # x - x: NaN for NaN and inf
                plgpu.commit_smem()
                hits = product(visible.astype(dtype), clean)
                return jnp.where(hits > 0, jnp.nan, acc)

            full = ((start == step * block_kv) & (start >= all_lo)
                    & (start + block_kv <= all_hi))
            acc = lax.cond(full, interior, boundary, acc)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_next, l_sum

        acc = cast(jnp.zeros((block_q, block_d), jnp.float32), plgpu.Layout.WGMMA)
        m = cast(jnp.full((block_q,), -jnp.inf, jnp.float32), row_layout)
        l_sum = cast(jnp.zeros((block_q,), jnp.float32), row_layout)
        pl.when(wg == 1)(take_turn)  # warpgroup 1 starts half a step behind 0
        lax.fori_loop(cta_lo, own_lo, wait_only, None)
        acc, m, l_sum = lax.fori_loop(own_lo, own_hi, step_fn, (acc, m, l_sum))
        lax.fori_loop(own_hi, cta_hi, wait_only, None)
        pl.when(wg == 0)(take_turn)
        if has_sinks:
            # The sink joins the denominator and weighs no value (forge_jax.ops.attention):
            # one more key of logit `sink` (+inf gives NaN, as exp2(inf - inf) does).
            sink = rows(sink_smem)
            m_next = jnp.maximum(m, sink)
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            correction = jnp.exp2(m - m_safe)
            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
            l_sum = l_sum * correction + jnp.exp2(sink - m_safe)
        # A row that saw no key has l_sum == 0 and acc == 0 (with a sink, l_sum > 0): zeros.
        # NaN stays NaN.
        l_sum = jnp.where(l_sum == 0, 1.0, l_sum)  # NaN (a +inf sink) stays NaN
        out = acc / lax.broadcast_in_dim(l_sum, acc.shape, [0])
        # The output's staging tile: Q's, or with V's columns split the boundary tile
        # (block_kv == block_q then), which a TMA copies whole.
        o_smem = clean_smem.at[wg] if split else q_smem
        o_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        rows = (batch, head, pl.ds(row0, block_q))
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[(*rows, columns)] if split else o_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
        cta_lo, cta_hi = read_info(_CONSUMERS, 0)[:2]

        def load(step, slot):
            keys = (batch, tile(step), head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_bar.at[slot])
            values = v_ref.at[(*keys, columns)] if split else v_ref.at[keys]
            plgpu.copy_gmem_to_smem(values, v_smem.at[slot], v_bar.at[slot])

        for i in range(stages):
            pl.when(cta_lo + i < cta_hi)(functools.partial(load, cta_lo + i, i))

        @pl.loop(cta_lo + stages, jnp.maximum(cta_hi, cta_lo + stages))
        def _(step):
            slot = lax.rem(step - cta_lo, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            load(step, slot)

        # Wait for the last tiles' releases too: every phase of a barrier is then observed
        # by each thread waiting on it (the interpreter checks it when the barriers are
        # freed; a CTA of more than `stages` tiles failed there without this).
        @pl.loop(jnp.maximum(cta_lo, cta_hi - stages), cta_hi)
        def _(step):
            slot = lax.rem(step - cta_lo, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def _forward(q, k, v, positions, lengths, sinks=None, *, scale, causal, sliding_window,
             logits_soft_cap, block_q, block_kv, stages, block_d, ping_pong, interpret,
             attention_chunk_size=None):
    plgpu = _compat.pallas_mosaic_gpu()
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows = q_len * group
    rows_pad = pl.cdiv(rows, _CONSUMERS * block_q) * _CONSUMERS * block_q
    # TMA tiles rows by 8: K/V of fewer than block_kv keys or a length that is not a
    # multiple of 8 are zero-padded (a copy; the padding keys are hidden like any past
    # kv_lengths). Caches are allocated in multiples of 8 and read in place.
    kv_pad = max(block_kv, -(-kv_len // 8) * 8)
    if kv_pad != kv_len:
        pad = ((0, 0), (0, kv_pad - kv_len), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    qg = _attention_common.group_queries(q, kv_heads, rows_pad=rows_pad)
    info, row_pos = _ranges(positions, lengths, rows_pad=rows_pad, group=group,
                            block_q=block_q, block_kv=block_kv, causal=causal,
                            sliding_window=sliding_window,
                            attention_chunk_size=attention_chunk_size)
    extra = []
    if sinks is not None:  # [kv_heads, rows_pad]: row r of kv head h is head h * group + r % group
        row_sinks = jnp.tile(sinks.reshape(kv_heads, 1, group), (1, q_len, 1))
        row_sinks = row_sinks.reshape(kv_heads, rows) * _LOG2E  # the kernel's base 2
        extra.append(jnp.pad(row_sinks, ((0, 0), (0, rows_pad - rows))))
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        plgpu.SMEM((_CONSUMERS, block_q, head_dim), q.dtype, **swizzled),
        plgpu.SMEM((stages, block_kv, head_dim), q.dtype, **swizzled),
        plgpu.SMEM((stages, block_kv, block_d), q.dtype, **swizzled),
        plgpu.SMEM((_CONSUMERS, block_kv, block_d), q.dtype, **swizzled),
        plgpu.SMEM((_CONSUMERS, block_q), jnp.int32),
        plgpu.SMEM((_CONSUMERS + 1, _INFO), jnp.int32),
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_arrivals=1 + (sinks is not None), num_barriers=_CONSUMERS),
        plgpu.Barrier(num_barriers=_CONSUMERS + 1),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS),  # the consumers' schedule (ping-pong)
    ]
    if sinks is not None:
        scratch.append(plgpu.SMEM((_CONSUMERS, block_q), jnp.float32))
    body = functools.partial(
        _kernel, scale=scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, block_q=block_q, block_kv=block_kv, stages=stages,
        block_d=block_d, ping_pong=ping_pong, interpret=interpret,
        attention_chunk_size=attention_chunk_size, has_sinks=sinks is not None)
    splits = head_dim // block_d
    cost = _cost.attention(queries=batch * q_len * q_heads, keys=kv_len, head_dim=head_dim,
                           causal=causal and q_len == kv_len, io=(qg, k, v, qg))
    if splits > 1:  # S = Q K^T and its softmax once per split, K read once per split
        cost = pl.CostEstimate(flops=cost.flops * (splits + 1) // 2,
                               transcendentals=cost.transcendentals * splits,
                               bytes_accessed=cost.bytes_accessed + (splits - 1) * k.nbytes)
    with _mosaic.maybe_interpret(interpret):
        out = _mosaic.costed_kernel(
            body, out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype), scratch_shapes=scratch,
            cost_estimate=cost, name=NAME,
            compiler_params=plgpu.CompilerParams(approx_math=True),
            grid=(kv_heads, splits, rows_pad // (_CONSUMERS * block_q), batch),
            grid_names=("heads", "cols", "rows", "batch"), num_threads=_CONSUMERS + 1,
            thread_name="wg")(qg, k, v, row_pos, info, *extra)
    return _attention_common.ungroup_queries(out, q_len=q_len, q_heads=q_heads,
                                             head_dim=head_dim)


# The contract's positions and lengths around _forward; backward: the XLA reference's VJP.
_attention = _attention_common.flash_attention_call(_forward)
_attention_sm100 = _attention_common.flash_attention_call(mosaic_attention_sm100.forward)


@functools.partial(jax.jit, static_argnames=(
    "scale", "causal", "sliding_window", "logits_soft_cap", "attention_chunk_size", "block_q",
    "block_kv", "stages", "block_d", "ping_pong", "interpret", "mma"))
def flash_attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    attention_chunk_size=None, block_q=None, block_kv=None, stages=None,
                    block_d=None, ping_pong=None, interpret=False, mma=None):
    """Flash attention on Hopper+ (see :func:`forge_jax.attention` for the contract).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``, bfloat16/float16, head_dim 64, 128 or 256
        (:func:`supports`, checked by dispatch, not here: other cases fail to compile).
      k, v: ``[batch, kv_len, kv_heads, head_dim]`` in ``q.dtype``,
        ``q_heads % kv_heads == 0``.
      scale, causal, q_positions, kv_lengths, sliding_window, logits_soft_cap, sinks,
        attention_chunk_size: as in the op.
      block_q: query rows per consumer warpgroup (64: one WGMMA tile).
      block_kv: keys per tile, a multiple of 64.
      stages: K/V tiles in flight (>= 2).
      block_d: output columns per CTA, a multiple of 64 dividing head_dim (default: all up
        to head_dim 128, 128 at 256); below head_dim, block_kv must be 64.
      ping_pong: FA3's schedule between the consumer warpgroups (default: on up to
        head_dim 128).
      interpret: run in the Mosaic GPU interpreter (any platform).
      mma: ``"wgmma"`` (Hopper, this module's kernel) or ``"tcgen05"`` (Blackwell: the
        kernel of :mod:`forge_jax.pallas_kernels.gpu.mosaic_attention_sm100`, which takes
        ``block_kv`` and ``stages`` and no ``block_q``); default: the GPU's.

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; differentiable in q, k, v.
    """
    mma = mma or _mosaic.mma_kind()
    extras = dict(sinks=sinks, attention_chunk_size=attention_chunk_size)
    if mma == "tcgen05":
        if q.size == 0 or k.shape[1] == 0:
            return jnp.zeros(q.shape, q.dtype)
        knobs = {n: x for n, x in dict(block_kv=block_kv, stages=stages).items()
                 if x is not None}
        return _attention_sm100(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                                kv_lengths=kv_lengths, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, interpret=interpret, **extras,
                                **knobs)
    if mma != "wgmma":
        raise ValueError(f"mma={mma!r}: 'wgmma' (Hopper) or 'tcgen05' (Blackwell)")
    config = dataclasses.replace(
        default_config({"q": q}), **{n: x for n, x in dict(
            block_q=block_q, block_kv=block_kv, stages=stages, block_d=block_d,
            ping_pong=ping_pong).items()
            if x is not None})
    head_dim = q.shape[-1]
    columns = _block_d(head_dim, config)
    if config.block_q != 64 or config.block_kv % 64 or config.block_kv <= 0 \
            or config.stages < 2 or columns % 64 or columns <= 0 or head_dim % columns \
            or (columns < head_dim and config.block_kv != config.block_q):
        raise ValueError(f"{config} with {head_dim=}: block_q must be 64, block_kv a "
                         "multiple of 64, stages >= 2, block_d a multiple of 64 dividing "
                         "head_dim, and block_kv == block_q when block_d < head_dim")
    if q.size == 0 or k.shape[1] == 0:  # nothing to launch; a query with no keys gets zeros
        return jnp.zeros(q.shape, q.dtype)
    return _attention(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                      kv_lengths=kv_lengths, sliding_window=sliding_window,
                      logits_soft_cap=logits_soft_cap, **extras, block_q=config.block_q,
                      block_kv=config.block_kv, stages=config.stages, block_d=columns,
                      ping_pong=config.ping_pong, interpret=interpret)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel compiles for these arguments, else why not: on compute
    capability 9.x this module's WGMMA kernel, on 10.x (Blackwell) the tcgen05 kernel of
    :mod:`forge_jax.pallas_kernels.gpu.mosaic_attention_sm100`."""
    q, k, v = args["q"], args["k"], args["v"]
    if _mosaic.mma_kind() == "tcgen05":  # Blackwell: the tcgen05 kernel's limits
        return mosaic_attention_sm100.reason(dtypes=[q.dtype, k.dtype, v.dtype],
                                             head_dim=q.shape[-1])
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in DTYPES:
        return (f"q.dtype={jnp.dtype(q.dtype).name}, k.dtype={jnp.dtype(k.dtype).name}, "
                f"v.dtype={jnp.dtype(v.dtype).name}: this kernel takes bfloat16 or float16, "
                "all three equal (16-bit WGMMA operands)")
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS:
        need = shared_memory_bytes(head_dim, q.dtype, Config())
        if head_dim % 64:
            why = "WGMMA tiles with the 128-byte swizzle take a multiple of 64 columns"
        elif need > SHARED_MEMORY:
            why = f"its tiles need {need} bytes of shared memory, more than {SHARED_MEMORY}"
        else:
            why = "not compiled and checked for this kernel yet"
        return f"head_dim={head_dim} not in {HEAD_DIMS}: {why}"
    return None


_registration.register(
    "attention", flash_attention, backend="mosaic_gpu", supports=supports, verified=VERIFIED,
    reads_sinks=True, reads_chunks=True,
    description="flash attention (FA3: TMA producer, two WGMMA consumers; Blackwell: one "
                "warpgroup, tcgen05 into TMEM), GQA rows per CTA, XLA-VJP backward",
    interpret_configs=lambda args: [])
