"""Mosaic GPU kernel (Blackwell, sm_100a): ``out.T = dequantize(w) @ x.T`` for an int8 or fp8
(e4m3) weight with one scale per output channel, dequantized in registers feeding tcgen05.

The Hopper kernel of :mod:`forge_jax.pallas_kernels.gpu.mosaic_quantized_matmul` hands
WGMMA the dequantized weight tile from registers; sm_100a refuses WGMMA, and tcgen05 reads
its left operand from shared or tensor memory only. So each ``[128, tile_k]`` tile of stored
values goes shared memory -> registers (converted to the activations' bf16/f16, exact for
int8 and e4m3 values) -> a shared-memory tile -> tcgen05's left operand, against the
activations' ``[tile_m, tile_k]`` tile read through a transposed view, accumulating in a
``[128, tile_m]`` float32 tile of tensor memory (TMEM). As in the Hopper kernel the product
is transposed so that a decode step's few activation rows are the MMA's N (padded to 16,
tcgen05's smallest at M = 128), the weight's output channels its M (one program: 128 of
them); K is pipelined by TMA copies (``emit_pipeline``) and split over the SMs for decode's
few blocks; the per-channel scales multiply the accumulator once, in the epilogue.

The TMA copies of the next ``max_concurrent_steps - 1`` steps are in flight while a step
converts its tile and waits for its MMA (the pipeline refills a step's buffers when it
returns, so the MMA must be done by then): for decode's memory-bound shapes the conversion
and the small MMA hide behind the copies.

Constraints (:func:`reason`): int8 or fp8 e4m3 per output channel (block ``(1, K)``);
bf16/f16 activations; ``N % 128 == 0``; ``K % 64 == 0``. int4 and fp8 in 128 x 128 blocks
stay Hopper's.

In the Mosaic GPU interpreter (JAX 0.12 or newer; 0.10's has no tensor memory) everything
is the compiled kernel's code; register layouts are skipped.

Op: :func:`forge_jax.ops.quantized_matmul.quantized_matmul`, through the ``"mosaic_gpu"``
record of :mod:`forge_jax.pallas_kernels.gpu.mosaic_quantized_matmul` on compute capability
10.x. Tests: ``tests/test_pallas_mgpu_quantized_matmul_sm100.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _mosaic

pl = _compat.pallas()

TILE_N = 128  # weight rows (output channels) per program: tcgen05's M
MIN_ROWS = 16  # tcgen05's smallest N at M = 128
# Activation rows a program: 256 (tcgen05's largest N) leaves room for one stage of 80 KiB of
# copies beside the dequantized tile; 128 fits three.
MAX_TILE_M = 128
SMEM_BYTES = 232448  # Blackwell's shared memory a block may use (227 KiB)
CHUNK = 64  # accumulator columns read from TMEM at a time in the epilogue
WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def tile_m(m: int) -> int:
    """Activation rows per program: ``m`` rounded up to 16, at most :data:`MAX_TILE_M`."""
    return min(MAX_TILE_M, -(-max(m, 1) // MIN_ROWS) * MIN_ROWS)


def smem_bytes(tile_m: int, tile_k: int, steps: int, itemsize: int = 2) -> int:
    """Shared memory: ``steps`` stages of weight and activation tiles, the dequantized tile,
    the output staging and the scales (before Mosaic's alignment)."""
    stage = TILE_N * tile_k + tile_m * tile_k * itemsize
    return (steps * stage + TILE_N * tile_k * itemsize + TILE_N * min(CHUNK, tile_m) * 4
            + TILE_N * 4 + 64)


def fitting_steps(tile_m: int, tile_k: int, wanted: int) -> int:
    """The deepest pipeline up to ``wanted`` (at least 2) within the shared memory, with
    4 KiB for Mosaic's alignment."""
    steps = wanted
    while steps > 2 and smem_bytes(tile_m, tile_k, steps) > SMEM_BYTES - 4096:
        steps -= 1
    return steps


def reason(*, weight_dtype, per_channel: bool, n: int, k: int) -> str | None:
    """Why the kernel cannot take this weight (the activation checks are the record's)."""
    if jnp.dtype(weight_dtype) not in WEIGHT_DTYPES or not per_channel:
        return ("on Blackwell (tcgen05) the Mosaic GPU quantized matmul serves int8/fp8 with "
                "one scale per output channel; int4 and fp8 in 128 x 128 blocks are WGMMA "
                "code, which sm_100a refuses")
    if n % TILE_N:
        return f"N={n} is not a multiple of {TILE_N} (tcgen05's M: output channels a program)"
    if k % 64:
        return f"K={k} is not a multiple of 64 (the kernel's K step)"
    return None


def _swizzled(tile_minor: int, dtype) -> tuple:
    return _mosaic.swizzle_transforms(min(128, tile_minor * jnp.dtype(dtype).itemsize), dtype)


def _kernel(x_gmem, w_gmem, s_gmem, out_gmem, *, tile_m, tile_k, k_split, steps, interpret):
    # x_gmem [Mp, K] bf16/f16; w_gmem [N, K] int8/e4m3; s_gmem [N] f32 (per channel);
    # out_gmem [splits, N, Mp] f32, partial sums of out.T, one per K split.
    plgpu = _compat.pallas_mosaic_gpu()
    _, mi, si, rows, cols, ks = _mosaic.matmul_tiles(TILE_N, tile_m, k_split)
    compute = x_gmem.dtype
    row_layout = plgpu.Layout.TCGEN05.reduce(1)

    def scope(s_smem, s_bar, w_deq, mma_bar, acc_tmem, out_smem):
        plgpu.copy_gmem_to_smem(s_gmem.at[rows], s_smem, s_bar.at[0])

        def step(idx, w_smem, x_smem):
            w = w_smem[...]  # [TILE_N, tile_k] stored values
            if w.dtype == jnp.float8_e4m3fn and compute != jnp.float16:
                w = w.astype(jnp.float16)  # e4m3 -> f16 -> bf16: exact
            w_deq[...] = w.astype(compute)  # exact: bf16 and f16 hold int8 and e4m3 values
            plgpu.commit_smem()
            plgpu.tcgen05_mma(acc_tmem, w_deq, _mosaic.transposed(x_smem), mma_bar.at[0],
                              accumulate=idx[0] > 0)
            # The pipeline refills x_smem's buffer once the step returns, and the next step
            # rewrites w_deq: the MMA must be done reading both.
            plgpu.barrier_wait(mma_bar.at[0])

        plgpu.emit_pipeline(
            step, grid=(k_split // tile_k,), max_concurrent_steps=steps,
            in_specs=[
                plgpu.BlockSpec((TILE_N, tile_k), lambda k: (0, k),
                                transforms=_swizzled(tile_k, w_gmem.dtype)),
                plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k),
                                transforms=_swizzled(tile_k, compute)),
            ])(w_gmem.at[rows, ks], x_gmem.at[cols, ks])
        plgpu.barrier_wait(s_bar.at[0])
        s = _mosaic.layout_cast(s_smem[...], row_layout, interpret=interpret)
        for c in range(0, tile_m, CHUNK):  # staged a chunk at a time: 32 KiB, not 128
            width = min(CHUNK, tile_m - c)
            acc = plgpu.async_load_tmem(acc_tmem.at[:, pl.ds(c, width)],
                                        layout=None if interpret else plgpu.Layout.TCGEN05)
            plgpu.wait_load_tmem()
            plgpu.wait_smem_to_gmem(0)  # the previous chunk's copy has read the staging
            out_smem[:, pl.ds(0, width)] = acc * jax.lax.broadcast_in_dim(
                s, (TILE_N, width), (0,))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[:, pl.ds(0, width)],
                                    out_gmem.at[si, rows, pl.ds(mi * tile_m + c, width)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scope, plgpu.SMEM((TILE_N,), jnp.float32), plgpu.Barrier(num_barriers=1),
        plgpu.SMEM((TILE_N, tile_k), compute, transforms=_swizzled(tile_k, compute)),
        plgpu.Barrier(num_arrivals=1, num_barriers=1, orders_tensor_core=True),
        plgpu.TMEM((TILE_N, tile_m), jnp.float32),
        plgpu.SMEM((TILE_N, min(CHUNK, tile_m)), jnp.float32))


@functools.partial(jax.jit, static_argnames=("tile_k", "max_concurrent_steps", "split_k",
                                             "interpret"))
def quantized_matmul_transposed(x, w, scales, *, tile_k, max_concurrent_steps, split_k,
                                interpret=False):
    """The kernel alone: float32 ``out.T = dequantize(w) @ x.T`` in ``split_k`` partial sums
    ``[split_k, N, M]``, the arguments of the Hopper kernel's
    (:func:`forge_jax.pallas_kernels.gpu.mosaic_quantized_matmul.quantized_matmul_transposed`)
    with ``M`` a multiple of :func:`tile_m` and per-channel ``scales [N]`` only; the
    interpreter (``interpret``) needs JAX 0.12 or newer."""
    m, k = x.shape
    n = w.shape[0]
    tm = tile_m(m)
    _mosaic.check_matmul_tiles(x, w, tile_m=tm, tile_n=TILE_N, tile_k=tile_k, split_k=split_k)
    body = functools.partial(_kernel, tile_m=tm, tile_k=tile_k, k_split=k // split_k,
                             steps=max_concurrent_steps, interpret=interpret)
    cost = _mosaic.matmul_cost(x, w, scales, split_k=split_k)
    call = _mosaic.mesh_kernel(
        body, out_shape=jax.ShapeDtypeStruct((split_k, n, m), jnp.float32),
        grid=(n // TILE_N, m // tm, split_k), grid_names=("n", "m", "k"),
        cost_estimate=cost, name="forge_jax_mosaic_quantized_matmul_sm100",
        interpret=interpret)
    return call(x, w, scales)  # x first: the roofline's peak is its dtype's
