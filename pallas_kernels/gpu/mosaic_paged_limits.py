"""What the Mosaic GPU paged kernels fit in on Hopper: the dtypes and sizes their lowering
takes, their shared memory, and the head dims that compile without register spills.

Shared by :mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention` (the kernel, its
``supports()``) and :mod:`forge_jax.pallas_kernels.gpu.mosaic_ragged_paged_attention` (the
same kernel over a ragged step). Each limit is settled by the H100 compile
(``tests/test_pallas_mgpu_paged.py``, ``tests/test_pallas_mgpu_ragged.py``; figures in
BENCHMARKS.md).
"""

from __future__ import annotations

import jax.numpy as jnp

ROWS = 64  # query rows per program: one WGMMA tile (M = 64 per warpgroup)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # with scales
MAX_TMA = 256  # elements along each dimension of one TMA copy
# Shared memory per block on Hopper and Blackwell (227 KiB, what Mosaic GPU checks a kernel
# against), less the alignment padding Mosaic adds between allocations (< 3 KiB here).
SMEM_LIMIT = 227 * 1024 - 4096
MIN_STAGES = 2  # a ring of one block would serialise the copies and the products
# The widest head_dim whose several-positions or quantized launches compile for H100 without
# register spills (:func:`register_reason`; 16-bit decode: up to 256).
MAX_SPILL_FREE_HEAD_DIM = 128


def block_keys(config_block: int, page_size: int) -> int:
    """Keys per block: whole pages, a multiple of 64 (the WGMMA N of ``Q K^T``, the K of
    ``P V``), at least ``config_block``."""
    return max(config_block, page_size, ROWS) // max(page_size, ROWS) * max(page_size, ROWS)


def fitting_stages(stages: int, *, head_dim: int, block_kv: int,
                   quantized: bool = False) -> int:
    """The most stages up to ``stages`` whose shared memory fits :data:`SMEM_LIMIT` (at
    least :data:`MIN_STAGES`, which may not fit: the kernels' ``supports()`` reject those sizes)."""
    while stages > MIN_STAGES and smem_bytes(head_dim=head_dim, block_kv=block_kv,
                                             stages=stages, quantized=quantized) > SMEM_LIMIT:
        stages -= 1
    return stages


def smem_bytes(*, head_dim: int, block_kv: int, stages: int, itemsize: int = 2,
               quantized: bool = False) -> int:
    """The kernel's shared memory (scratch and barriers, before Mosaic's alignment): the
    queries and positions, then the larger of the key/value ring with the probability
    tiles, or the float32 output staging. ``itemsize``: the compute dtype's; quantized
    pools: one-byte pages, their float32 scales and a dequantized tile."""
    page_bytes = 1 if quantized else itemsize
    ring = 2 * stages * block_kv * head_dim * page_bytes \
        + (2 * ROWS * block_kv + block_kv * head_dim) * itemsize + 2 * stages * 8
    if quantized:
        ring += 2 * stages * block_kv * 4 + block_kv * head_dim * itemsize
    staging = ROWS * head_dim * 4 + 2 * ROWS * 4
    return ROWS * head_dim * itemsize + ROWS * 4 + 8 + max(ring, staging)


def layout_reason(*, q_dtype, kv_dtype, head_dim: int, page_size: int, block_kv: int,
                  quantized: bool = False) -> str | None:
    """Why the kernels cannot take these dtypes and sizes (``block_kv``: keys per block, the
    launch's :func:`block_keys`); ``quantized``: the pools are int8/fp8 values with scales."""
    pages_ok = QUANTIZED_DTYPES if quantized else DTYPES
    for name, dtype, ok in (("q", q_dtype, DTYPES), ("k_pages", kv_dtype, pages_ok)):
        if jnp.dtype(dtype) not in ok:
            what = ("int8/fp8 (e4m3) values with their scales" if quantized else
                    "bfloat16/float16 (or int8/fp8 pages with scales)")
            return (f"{name}.dtype={jnp.dtype(dtype).name}: the Mosaic GPU paged kernel takes "
                    f"{'bfloat16/float16 queries' if name == 'q' else what} (WGMMA runs "
                    "float32 only as TF32, short of float32 accuracy)")
    if not quantized and jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        return (f"q.dtype={jnp.dtype(q_dtype).name} differs from "
                f"k_pages.dtype={jnp.dtype(kv_dtype).name}: both WGMMA operands take one dtype")
    if head_dim % 64 or head_dim > MAX_TMA:
        need = smem_bytes(head_dim=head_dim, block_kv=block_kv, stages=1, quantized=quantized)
        wide = "" if need <= SMEM_LIMIT else (
            f"; at this width even one key/value block in flight needs {need} bytes of shared "
            f"memory, more than {SMEM_LIMIT} (the H100 lowering refuses it: Gemma 4's 512)")
        return (f"head_dim={head_dim} is not a multiple of 64 up to {MAX_TMA} (the 128-byte "
                f"swizzle of WGMMA operands; <= 256 elements per TMA copy){wide}")
    if page_size % 8 or page_size > MAX_TMA or (64 % page_size and page_size % 64):
        return (f"page_size={page_size} must be a multiple of 8 up to {MAX_TMA} that divides "
                "64 or is a multiple of 64 (whole pages per 64-key block, 8-row tiles, <= 256 "
                "rows per TMA copy)")
    if smem_bytes(head_dim=head_dim, block_kv=block_kv, stages=MIN_STAGES,
                  quantized=quantized) > SMEM_LIMIT:
        return (f"head_dim={head_dim} with page_size={page_size} (blocks of {block_kv} keys): "
                f"{MIN_STAGES} key/value blocks in flight exceed the {SMEM_LIMIT // 1024} KiB "
                "of shared memory")
    return None


def register_reason(*, head_dim: int, quantized: bool, several_positions: bool) -> str | None:
    """Why ptxas spills registers for H100 past :data:`MAX_SPILL_FREE_HEAD_DIM` (shared with
    the ragged kernel, whose launch always has several positions); BENCHMARKS.md has the
    figures, ``tests/test_pallas_mgpu_paged.py`` shows them."""
    if head_dim <= MAX_SPILL_FREE_HEAD_DIM or not (several_positions or quantized):
        return None
    if several_positions:
        return (f"head_dim={head_dim} with several query positions: the H100 compile spills "
                f"registers past {MAX_SPILL_FREE_HEAD_DIM} (the NaN bookkeeping's second "
                "[64, head_dim] float32 accumulator beside the output's)")
    if head_dim % 128:
        return (f"head_dim={head_dim} with int8/fp8 pages: rows of {head_dim} bytes do not "
                "tile the 128-byte swizzle (the H100 lowering fails)")
    return (f"head_dim={head_dim} with int8/fp8 pages: the H100 compile spills registers past "
            f"{MAX_SPILL_FREE_HEAD_DIM} (the dequantized tiles beside the accumulator)")
