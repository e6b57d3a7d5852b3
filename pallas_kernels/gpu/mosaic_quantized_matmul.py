"""Mosaic GPU kernel (Hopper+): ``alpha * a @ dequantize(b).T + beta * c`` for an int8, fp8
or int4 weight, dequantized in registers feeding WGMMA.

The product is computed transposed, ``out.T [N, M] = W [N, K] @ a.T``: the weight is
WGMMA's left operand, the only one that may come from registers, so each ``[64, tile_k]``
tile of stored values goes shared memory -> registers -> bf16/f16 -> WGMMA, and the
activations are its right operand, read from shared memory through a transposed view. The
activation rows are WGMMA's N dimension, which may be as small as 8: a decode step's few
rows are padded to 8, not to 64. One warpgroup computes a ``[64, tile_m]`` block of
``out.T`` over a pipelined loop of TMA copies along K. Decode's few blocks (``N / 64``) are
spread over the SMs by splitting K (``split_k`` partial sums, added in XLA with ``alpha``,
``beta * c``, the transpose back and the cast: ``N * M`` floats, small beside the weight).

Scales: one per output channel (int8, fp8) is applied once, to the float32 accumulator, in
the epilogue; the values reach WGMMA exactly (int8 and e4m3 values are bf16 and f16
values), so the product is exact up to float32 accumulation (the XLA implementation rounds
``q * scale`` to the activations' dtype first). fp8 in 128 x 128 blocks (Hugging Face's
fine-grained FP8: ``weight_scale_inv``) scales each tile in registers by its block's scale
(one per K step, ``tile_k`` 128) and rounds it to the activations' dtype, as XLA does.
int4 (groups of 32 or 64 along K, symmetric ``q - 8`` or with a minimum): a step reads four
groups of packed bytes; the low nibbles (even columns) and the high nibbles (odd columns)
become two float32 tiles, scaled (plus the minimum) per group with the scales spread over
the tile in registers, rounded to the activations' dtype (as XLA does) and multiplied with
``a``'s even and odd columns (split by XLA before the kernel: a copy of ``a``, small for
decode): two WGMMAs a step, no interleaving. Its row tiles stop at 128 (256 spilled).

Served: ``trans_b=True`` (a weight in the ``[out, in]`` layout), int8 (symmetric) or fp8
e4m3 per channel (``block=(1, K)``), fp8 in 128 x 128 blocks (512 <= K <= 32768), int4 in
groups of 32 or 64 (``K`` a multiple of four groups), bf16/f16 activations, ``N % 64 ==
0``, ``K % 64 == 0``, the leading dimensions of ``a`` flattened into rows. Not served
(``supports`` says so and auto keeps XLA): int4 groups of 128, int8 group-wise scales
(GGUF's Q8_0 groups of 32) and minimums, ``[K, N]`` weights, float32 activations (WGMMA
takes no float32 operand from registers: a compile error).

Interpreter: the Mosaic GPU interpreter of JAX 0.10 reads WGMMA's operands from untransformed
shared memory only (no register operand, no transposed view) and has no rule for layout
casts; under ``interpret=True`` the dequantized tile and the transposed activation tile are
stored to shared-memory scratch and read from there, and layout hints are skipped. The
pipeline, dequantization, scaling, split and epilogue are the same code.

Op: :func:`forge_jax.ops.quantized_matmul.quantized_matmul`; reference: its XLA
implementation :func:`forge_jax.ops.quantized_matmul.quantized_matmul_xla`. Launch knobs:
:class:`Config`, :data:`TUNED`, :func:`default_config`. Registered (bottom of this module)
as ``"mosaic_gpu"`` on GPU, by name until :data:`VERIFIED` names a GPU, and
``"mosaic_gpu_interpret"``. Tests: ``tests/test_pallas_mgpu_quantized_matmul.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.quantized_matmul import scale_and_add
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels.gpu import _common, _mosaic, mosaic_quantized_matmul_sm100

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (compiled
# deviceless for h100 only; no GPU has run it).
VERIFIED: dict[str, str] = {}

ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
WEIGHT_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn),
                 "int4": jnp.dtype(jnp.uint8)}
# int4: groups along K served, and groups a pipeline step (its scales: 4 float32 a row,
# TMA's 16-byte minimum).
INT4_GROUPS = (32, 64)
INT4_GROUPS_PER_STEP = 4
# int4 dequantizes two [64, 2 * group] float32 tiles (and their scales) a step beside the
# accumulator: with 256 rows it spills (ptxas, groups of 64, asymmetric); 128 do not.
INT4_MAX_TILE_M = 128
TILE_N = 64  # one warpgroup's WGMMA rows
MIN_ROWS = 8  # WGMMA's smallest N
MAX_TILE_M = 256  # WGMMA's largest N (and TMA's largest box)
# Rows (WGMMA N) beyond which a block of activations is cut in tiles of PREFILL_TILE_M.
PREFILL_TILE_M = 128
# Hugging Face's fine-grained FP8 layout: one scale per 128 x 128 block of the weight.
FP8_BLOCK = 128
# Hopper's shared memory a block may use (227 KiB).
SMEM_BYTES = 232448
# An int32 element offset stays clear of 2**31.
MAX_SIZE = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch knobs: K per pipeline step, pipeline depth, and how many SMs to fill by
    splitting K (``split_k = 0``: chosen from ``sms``)."""

    tile_k: int = 128
    max_concurrent_steps: int = 3
    split_k: int = 0
    sms: int = 132


# Not measured: the H100's 132 SMs, the B200's 148.
TUNED: Mapping[str, Mapping[str, int]] = {
    "H100": dict(tile_k=128, max_concurrent_steps=3, sms=132),
    "B200": dict(tile_k=128, max_concurrent_steps=3, sms=148),
    "default": dict(tile_k=128, max_concurrent_steps=3, sms=132),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs on ``device_kind`` from :data:`TUNED`."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tile_m_for(m: int, largest: int = MAX_TILE_M) -> int:
    """Activation rows per block: all of them (padded to a multiple of 8) up to ``largest``
    (decode: one block of rows), else :data:`PREFILL_TILE_M`. int4's is
    :data:`INT4_MAX_TILE_M`."""
    rows = round_up(max(m, 1), MIN_ROWS)
    return rows if rows <= largest else PREFILL_TILE_M


def split_for(blocks: int, k_steps: int, sms: int) -> int:
    """The number of K splits: the largest divisor of ``k_steps`` that keeps
    ``blocks * split`` within ``sms`` and at least two steps a split (a pipeline)."""
    best = 1
    for d in range(1, k_steps + 1):
        if k_steps % d == 0 and blocks * d <= sms and (k_steps // d >= 2 or d == 1):
            best = d
    return best


def pipeline_steps(tile_m: int, tile_k: int, w_bytes: int, x_bytes: int, wanted: int,
                   extra: int = 0) -> int:
    """The pipeline depth: ``wanted`` stages of (weight, activation) tiles (and ``extra``
    bytes a stage), fewer if the stages and the epilogue's ``[64, tile_m]`` float32 tile
    would pass :data:`SMEM_BYTES`."""
    stage = TILE_N * tile_k * w_bytes + tile_m * tile_k * x_bytes + extra
    free = SMEM_BYTES - TILE_N * tile_m * 4 - 4 * TILE_N - 1024  # epilogue, scales, barriers
    return max(1, min(wanted, free // stage))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.matmul` arguments (a quantized
    ``b``), else why not."""
    a, b = args["a"], args["b"]
    tcgen05 = _mosaic.mma_kind() == "tcgen05"
    if b.format == "mxfp4":
        return ("b.format='mxfp4': the kernel dequantizes int8, int4 and fp8, not FP4 E2M1 "
                "codes with E8M0 exponents (XLA serves it)")
    if b.activations is not None:
        return (f"b.activations={b.activations!r} (W8A8): the kernel multiplies dequantized "
                f"weights in the activations' dtype; XLA serves W8A8")
    if jnp.dtype(a.dtype) not in ACTIVATION_DTYPES:
        return (f"a.dtype={jnp.dtype(a.dtype).name}; the kernel's WGMMA reads bfloat16/float16 "
                f"activations")
    if not args["trans_b"]:
        return "trans_b=False; the kernel reads a [N, K] weight (the [out, in] layout)"
    n, k = b.shape
    if tcgen05:  # Blackwell: the tcgen05 kernel's cases
        if b.minimums is not None:
            return f"b has minimums; on Blackwell the kernel serves none ({b.format})"
        return _sm100_reason(b) or _size_reason(a, b)
    block = tuple(b.full_block())
    if b.format == "int4":
        group = block[1]
        if block[0] != 1 or group not in INT4_GROUPS:
            return (f"int4 b.block={b.block}; the kernel serves groups of "
                    f"{' or '.join(map(str, INT4_GROUPS))} along K")
        if k % (INT4_GROUPS_PER_STEP * group):
            return (f"K={k} is not a multiple of {INT4_GROUPS_PER_STEP * group} "
                    f"({INT4_GROUPS_PER_STEP} groups of {group} a step)")
    elif block == (FP8_BLOCK, FP8_BLOCK) and b.format == "fp8":
        if not 4 * FP8_BLOCK <= k <= MAX_TILE_M * FP8_BLOCK:
            return (f"K={k}: fp8 in {FP8_BLOCK} x {FP8_BLOCK} blocks needs 512 <= K <= 32768 "
                    f"(a block row's scales are one TMA copy of 16 bytes to 256 values)")
    elif block != (1, k):
        return (f"b.block={b.block}; the kernel serves one scale per output channel "
                f"(block (1, {k})), and fp8 in {FP8_BLOCK} x {FP8_BLOCK} blocks")
    if b.minimums is not None and b.format != "int4":
        return f"b has minimums; the kernel serves them for int4 only, not {b.format}"
    if n % TILE_N:
        return f"N={n} is not a multiple of {TILE_N} (a warpgroup's WGMMA rows)"
    if k % 64:
        return f"K={k} is not a multiple of 64 (the kernel's K step)"
    return _size_reason(a, b)


def _size_reason(a, b) -> str | None:
    if b.values.size > MAX_SIZE or a.size > MAX_SIZE:
        return f"operands over {MAX_SIZE} elements: the kernel's offsets are int32"
    return None


def _swizzled(tile_minor: int, dtype, operand: str) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = _compat.pallas_mosaic_gpu().find_swizzle(tile_minor * bits, operand)
    return _mosaic.swizzle_transforms(swizzle, dtype)


def _kernel(x_gmem, w_gmem, s_gmem, out_gmem, s_smem, out_smem, s_barrier, *stage, tile_m,
            tile_k, k_split, steps, blocked, interpret):
    # x_gmem [Mp, K] bf16/f16, w_gmem [N, K] int8/fp8, out_gmem [splits, N, Mp] f32 (partial
    # sums of out.T, one per K split); s_gmem [N] f32 per channel, or, ``blocked``,
    # [N / 128, K / 128] (a 64-row tile reads the row of its 128-row block: one scale a step).
    plgpu = _compat.pallas_mosaic_gpu()
    ni, mi, si, rows, cols, ks = _mosaic.matmul_tiles(TILE_N, tile_m, k_split)
    compute = x_gmem.dtype
    if blocked:
        plgpu.copy_gmem_to_smem(s_gmem.at[ni * TILE_N // FP8_BLOCK], s_smem, s_barrier)
        plgpu.barrier_wait(s_barrier)
    else:
        plgpu.copy_gmem_to_smem(s_gmem.at[rows], s_smem, s_barrier)

    def scope(acc_ref):
        def step(idx, w_smem, x_smem):
            w = w_smem[...]  # [64, tile_k]
            if w.dtype == jnp.float8_e4m3fn and compute != jnp.float16:
                # Hopper converts e4m3 to f16 only; e4m3 -> f16 -> bf16 is exact.
                w = w.astype(jnp.float16)
            if blocked:  # the block's scale, rounded into the tile as XLA's dequantize does
                scale = s_smem[si * (k_split // tile_k) + idx[0]]
                w = w.astype(jnp.float32) * scale
            w = w.astype(compute)  # exact for int8 and e4m3 values: bf16 and f16 hold them
            if interpret:  # operands staged as the interpreter's WGMMA reads them
                a_stage, b_stage = stage
                a_stage[...] = w
                b_stage[...] = x_smem[...].T
                plgpu.wgmma(acc_ref, a_stage, b_stage)
            else:
                plgpu.wgmma(acc_ref, w, plgpu.transpose_ref(x_smem, (1, 0)))
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            step, grid=(k_split // tile_k,), max_concurrent_steps=steps,
            in_specs=[
                plgpu.BlockSpec((TILE_N, tile_k), lambda k: (0, k),
                                transforms=_swizzled(tile_k, w_gmem.dtype, "lhs")),
                plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k),
                                transforms=_swizzled(tile_k, compute, "rhs")),
            ])(w_gmem.at[rows, ks], x_gmem.at[cols, ks])
        acc = acc_ref[...]  # [64, tile_m] f32
        if not blocked:
            plgpu.barrier_wait(s_barrier)
            s = s_smem[...]
            if not interpret:  # the scale as the accumulator's row vector (WGMMA layout)
                s = plgpu.layout_cast(s, plgpu.Layout.WGMMA.reduce(1))
            acc = acc * jax.lax.broadcast_in_dim(s, (TILE_N, tile_m), (0,))
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, rows, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.ACC((TILE_N, tile_m), jnp.float32))


def _int4_kernel(xe_gmem, xo_gmem, w_gmem, s_gmem, *refs, tile_m, tile_kp, group_bytes,
                 k_split, steps, asymmetric, interpret):
    # xe_gmem, xo_gmem [Mp, K/2]: a's even and odd columns; w_gmem [N, K/2] uint8, byte j
    # holding column 2j (low nibble) and 2j + 1 (high nibble): the low nibbles multiply the
    # even columns and the high ones the odd columns, two WGMMAs a step, no interleaving.
    # s_gmem (and m_gmem) [K/G, N] f32 (transposed: a group's scales are a contiguous row,
    # the view JAX 0.12's lowering takes); out_gmem [splits, N, Mp] f32. k_split: bytes.
    plgpu = _compat.pallas_mosaic_gpu()
    m_gmem, (out_gmem, out_smem, *stage) = (refs[0], refs[1:]) if asymmetric else (None, refs)
    ni, mi, si = (jax.lax.axis_index(a) for a in ("n", "m", "k"))
    rows = pl.ds(ni * TILE_N, TILE_N)
    cols = pl.ds(mi * tile_m, tile_m)
    ks = pl.ds(si * k_split, k_split)
    gs = pl.ds(si * (k_split // group_bytes), k_split // group_bytes)
    compute = xe_gmem.dtype
    shape = (TILE_N, tile_kp)

    def spread(v_smem):  # [groups, 64] per group and row -> [64, tile_kp] per byte
        if interpret:
            col = jax.lax.broadcasted_iota(jnp.int32, shape, 1) // group_bytes
        else:
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                         layout=plgpu.Layout.WGMMA) // group_bytes
        out = None
        for g in range(tile_kp // group_bytes):
            v = v_smem[g, :]
            if not interpret:
                v = plgpu.layout_cast(v, plgpu.Layout.WGMMA.reduce(1))
            v = jax.lax.broadcast_in_dim(v, shape, (0,))
            out = v if out is None else jnp.where(col == g, v, out)
        return out

    def scope(acc_ref):
        def step(_, w_smem, xe_smem, xo_smem, s_smem, *m_smem):
            w = w_smem[...].astype(jnp.int32)  # 8-bit registers take bitwise ops only
            scale = spread(s_smem)
            minimum = spread(m_smem[0]) if asymmetric else None
            for half, x_smem in ((w & 0xF, xe_smem), (w >> 4, xo_smem)):
                q = half.astype(jnp.float32)
                # As XLA's dequantize: float32, rounded once to the activations' dtype.
                v = (q * scale + minimum) if asymmetric else (q - 8.0) * scale
                v = v.astype(compute)
                if interpret:  # operands staged as the interpreter's WGMMA reads them
                    a_stage, b_stage = stage
                    a_stage[...] = v
                    b_stage[...] = x_smem[...].T
                    plgpu.wgmma(acc_ref, a_stage, b_stage)
                else:
                    plgpu.wgmma(acc_ref, v, plgpu.transpose_ref(x_smem, (1, 0)))
            plgpu.wgmma_wait(0)

        groups = plgpu.BlockSpec((tile_kp // group_bytes, TILE_N), lambda k: (k, 0))
        x_spec = plgpu.BlockSpec((tile_m, tile_kp), lambda k: (0, k),
                                 transforms=_swizzled(tile_kp, compute, "rhs"))
        plgpu.emit_pipeline(
            step, grid=(k_split // tile_kp,), max_concurrent_steps=steps,
            in_specs=[plgpu.BlockSpec((TILE_N, tile_kp), lambda k: (0, k),
                                      transforms=_swizzled(tile_kp, jnp.uint8, "lhs")),
                      x_spec, x_spec, groups] + [groups] * asymmetric,
        )(w_gmem.at[rows, ks], xe_gmem.at[cols, ks], xo_gmem.at[cols, ks], s_gmem.at[gs, rows],
          *([m_gmem.at[gs, rows]] if asymmetric else []))
        out_smem[...] = acc_ref[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, rows, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.ACC((TILE_N, tile_m), jnp.float32))


@functools.partial(jax.jit, static_argnames=("tile_k", "max_concurrent_steps", "split_k",
                                             "interpret"))
def quantized_matmul_transposed(x, w, scales, *, tile_k, max_concurrent_steps, split_k,
                                interpret=False):
    """The kernel alone: float32 ``out.T = dequantize(w) @ x.T``.

    Args:
      x: ``[M, K]`` bfloat16/float16 activations, ``M`` a multiple of the row tile
        (:func:`tile_m_for`; the wrapper pads).
      w: ``[N, K]`` int8 or float8_e4m3fn stored values.
      scales: ``[N]`` float32, one per output channel; or ``[N / 128, K / 128]`` float32
        for fp8 in 128 x 128 blocks (``tile_k`` 128).
      tile_k: K per pipeline step (64 or 128, dividing ``K / split_k``).
      max_concurrent_steps: pipeline depth (the wrapper's is :func:`pipeline_steps`).
      split_k: the number of K splits (each a partial sum).
      interpret: run in the Mosaic GPU interpreter (any platform).

    Returns:
      ``[split_k, N, M]`` float32 partial sums of ``out.T``.
    """
    plgpu = _compat.pallas_mosaic_gpu()
    m, k = x.shape
    n = w.shape[0]
    tile_m = tile_m_for(m)
    _mosaic.check_matmul_tiles(x, w, tile_m=tile_m, tile_n=TILE_N, tile_k=tile_k,
                               split_k=split_k)
    blocked = scales.ndim == 2
    if blocked and (tile_k != FP8_BLOCK or scales.shape != (n // FP8_BLOCK, k // FP8_BLOCK)):
        raise ValueError(f"{scales.shape=} and {tile_k=}: blocks of {FP8_BLOCK} x {FP8_BLOCK} "
                         f"need tile_k={FP8_BLOCK} and {(n // FP8_BLOCK, k // FP8_BLOCK)} scales")
    scratch = [plgpu.SMEM(scales.shape[-1:] if blocked else (TILE_N,), jnp.float32),
               plgpu.SMEM((TILE_N, tile_m), jnp.float32), plgpu.Barrier()]
    if interpret:
        scratch += [plgpu.SMEM((TILE_N, tile_k), x.dtype), plgpu.SMEM((tile_k, tile_m), x.dtype)]
    body = functools.partial(_kernel, tile_m=tile_m, tile_k=tile_k, k_split=k // split_k,
                             steps=max_concurrent_steps, blocked=blocked, interpret=interpret)
    cost = _mosaic.matmul_cost(x, w, scales, split_k=split_k)
    call = _mosaic.mesh_kernel(
        lambda *refs: pl.run_scoped(functools.partial(body, *refs), *scratch),
        out_shape=jax.ShapeDtypeStruct((split_k, n, m), jnp.float32),
        grid=(n // TILE_N, m // tile_m, split_k), grid_names=("n", "m", "k"),
        cost_estimate=cost, name="forge_jax_mosaic_quantized_matmul", interpret=interpret)
    return call(x, w, scales)  # x first: the roofline's peak is its dtype's


@functools.partial(jax.jit, static_argnames=("group", "max_concurrent_steps", "split_k",
                                             "interpret"))
def int4_matmul_transposed(x_even, x_odd, w, scales, minimums, *, group, max_concurrent_steps,
                           split_k, interpret=False):
    """The int4 kernel alone: float32 ``out.T = dequantize(w) @ x.T``.

    Args:
      x_even, x_odd: ``[M, K / 2]`` bfloat16/float16: the activations' even and odd
        columns, ``M`` a multiple of the row tile (:func:`tile_m_for`).
      w: ``[N, K / 2]`` uint8, two 4-bit values a byte (column ``2j`` in byte ``j``'s low
        nibble).
      scales: ``[K / group, N]`` float32 (transposed); minimums: the same or None
        (symmetric: ``q - 8``).
      group: values a scale along K (:data:`INT4_GROUPS`).
      max_concurrent_steps, split_k, interpret: as :func:`quantized_matmul_transposed`.

    Returns:
      ``[split_k, N, M]`` float32 partial sums of ``out.T``.
    """
    plgpu = _compat.pallas_mosaic_gpu()
    m, kp = x_even.shape
    n = w.shape[0]
    tile_m = tile_m_for(m, INT4_MAX_TILE_M)
    group_bytes = group // 2
    tile_kp = INT4_GROUPS_PER_STEP * group_bytes
    if m % tile_m or n % TILE_N or kp % (tile_kp * split_k):
        raise ValueError(f"{x_even.shape=} and {w.shape=} do not tile by ({tile_m}, {TILE_N}, "
                         f"{tile_kp} bytes x {split_k=})")
    asymmetric = minimums is not None
    scratch = [plgpu.SMEM((TILE_N, tile_m), jnp.float32)]
    if interpret:
        scratch += [plgpu.SMEM((TILE_N, tile_kp), x_even.dtype),
                    plgpu.SMEM((tile_kp, tile_m), x_even.dtype)]
    body = functools.partial(_int4_kernel, tile_m=tile_m, tile_kp=tile_kp,
                             group_bytes=group_bytes, k_split=kp // split_k,
                             steps=max_concurrent_steps, asymmetric=asymmetric,
                             interpret=interpret)
    operands = (x_even, x_odd, w, scales) + ((minimums,) if asymmetric else ())
    cost = pl.CostEstimate(
        flops=4 * m * n * kp, transcendentals=0,
        bytes_accessed=sum(x.size * x.dtype.itemsize for x in operands) + 4 * split_k * n * m)
    call = _mosaic.mesh_kernel(
        lambda *refs: pl.run_scoped(functools.partial(body, *refs), *scratch),
        out_shape=jax.ShapeDtypeStruct((split_k, n, m), jnp.float32),
        grid=(n // TILE_N, m // tile_m, split_k), grid_names=("n", "m", "k"),
        cost_estimate=cost, name="forge_jax_mosaic_quantized_matmul", interpret=interpret)
    return call(*operands)


def quantized_matmul(a, b, *, trans_b, alpha, beta, c, out_dtype, tile_k=None,
                     max_concurrent_steps=None, split_k=None, interpret=False, mma=None):
    """:func:`forge_jax.matmul` with a quantized ``b`` through the kernel.

    Args:
      a, b, trans_b, alpha, beta, c, out_dtype: as the op binds them (``supports`` holds).
      tile_k, max_concurrent_steps, split_k: override :func:`default_config`'s.
      interpret: run in the Mosaic GPU interpreter (any platform).
      mma: ``"wgmma"`` (Hopper, this module's kernels) or ``"tcgen05"`` (Blackwell:
        :mod:`forge_jax.pallas_kernels.gpu.mosaic_quantized_matmul_sm100`, int8/fp8 per
        channel); default: the GPU's (:func:`_mosaic.mma_kind`).
    """
    del trans_b  # True: supports() holds
    mma = mma or _mosaic.mma_kind()
    if mma not in ("wgmma", "tcgen05"):
        raise ValueError(f"mma={mma!r}: 'wgmma' (Hopper) or 'tcgen05' (Blackwell)")
    config = _common.with_knobs(default_config({}, _common.device_kind(interpret)),
                                tile_k=tile_k, max_concurrent_steps=max_concurrent_steps,
                                split_k=split_k)
    lead, k = a.shape[:-1], a.shape[-1]
    n = b.shape[0]
    x = a.reshape(-1, k)  # [M, K]
    m = x.shape[0]
    if mma == "tcgen05":
        if why := _sm100_reason(b):
            raise ValueError(why)
        tile_m = mosaic_quantized_matmul_sm100.tile_m(m)
    else:
        tile_m = tile_m_for(m, INT4_MAX_TILE_M if b.format == "int4" else MAX_TILE_M)
    rows = round_up(max(m, 1), tile_m)
    x = jnp.pad(x, ((0, rows - m), (0, 0)))
    if mma == "tcgen05":
        part = _int8_fp8_sm100(x, b, rows // tile_m, config, interpret)
    elif b.format == "int4":
        part = _int4(x, b, rows // tile_m, config, interpret)
    else:
        part = _int8_fp8(x, b, rows // tile_m, config, interpret)
    out = jnp.sum(part, axis=0, dtype=jnp.float32).T[:m].reshape(*lead, n)
    return scale_and_add(out, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype)


def _sm100_reason(b) -> str | None:
    n, k = b.shape
    return mosaic_quantized_matmul_sm100.reason(
        weight_dtype=b.values.dtype, per_channel=tuple(b.full_block()) == (1, k), n=n, k=k)


def _int8_fp8_sm100(x, b, m_tiles, config, interpret):
    sm100 = mosaic_quantized_matmul_sm100
    n, k = b.shape
    step = config.tile_k if k % config.tile_k == 0 else 64
    splits = config.split_k or split_for((n // sm100.TILE_N) * m_tiles, k // step, config.sms)
    steps = sm100.fitting_steps(sm100.tile_m(x.shape[0]), step, config.max_concurrent_steps)
    return sm100.quantized_matmul_transposed(
        x, b.values, b.scales.reshape(n).astype(jnp.float32), tile_k=step,
        max_concurrent_steps=steps, split_k=splits, interpret=interpret)


def _int4(x, b, m_tiles, config, interpret):
    n, k = b.shape
    group = b.full_block()[1]
    tile_m = tile_m_for(x.shape[0], INT4_MAX_TILE_M)
    tile_kp = INT4_GROUPS_PER_STEP * group // 2
    splits = config.split_k or split_for((n // TILE_N) * m_tiles, k // 2 // tile_kp,
                                         config.sms)
    scales_bytes = TILE_N * INT4_GROUPS_PER_STEP * 4 * (1 + (b.minimums is not None))
    steps = pipeline_steps(tile_m, tile_kp, 1, 2 * x.dtype.itemsize,
                           config.max_concurrent_steps, extra=scales_bytes)
    # Transposed by XLA at each call (a copy of the scales, 1/4 of the values' bytes at
    # groups of 32 in float32): JAX 0.12 lowers no strided column of shared memory.
    f32 = lambda v: None if v is None else v.astype(jnp.float32).T
    return int4_matmul_transposed(
        x[:, 0::2], x[:, 1::2], b.values, f32(b.scales), f32(b.minimums), group=group,
        max_concurrent_steps=steps, split_k=splits, interpret=interpret)


def _int8_fp8(x, b, m_tiles, config, interpret):
    n, k = b.shape
    tile_m = tile_m_for(x.shape[0])
    blocked = tuple(b.full_block()) == (FP8_BLOCK, FP8_BLOCK)
    step = FP8_BLOCK if blocked else config.tile_k if k % config.tile_k == 0 else 64
    splits = config.split_k or split_for((n // TILE_N) * m_tiles, k // step, config.sms)
    steps = pipeline_steps(tile_m, step, b.values.dtype.itemsize, x.dtype.itemsize,
                           config.max_concurrent_steps)
    return quantized_matmul_transposed(
        x, b.values, b.scales.astype(jnp.float32) if blocked else
        b.scales.reshape(n).astype(jnp.float32), tile_k=step,
        max_concurrent_steps=steps, split_k=splits, interpret=interpret)


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults."""
    del args
    return [dict(tile_k=tk, max_concurrent_steps=s) for tk in (64, 128) for s in (2, 3, 4)]


_registration.register(
    "quantized_matmul", quantized_matmul, backend="mosaic_gpu", supports=supports,
    verified=VERIFIED, configs=configs,
    description="int8/fp8/int4 weights dequantized in registers feeding WGMMA "
                "(out.T = W @ a.T, rows padded to 8, split K)",
    interpret_configs=lambda args: [dict(tile_k=64)])
