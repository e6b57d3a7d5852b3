"""Pallas GPU kernel (Triton lowering): the grouped matrix multiply
``out[r] = x[r] @ w[group of r]``.

The same schedule as the TPU kernel (:func:`forge_jax.ops.grouped_matmul.tile_schedule`,
megablox's): the rows are cut into tiles of ``block_m`` and each non-empty group visits
every tile its rows touch. Grid ``(visits, n blocks)``, the visits' static upper bound
``cdiv(m, block_m) + groups - 1``; a program reads its visit's group and tile from the
schedule (the Triton lowering has no scalar prefetch: ``x``, ``w`` and ``out`` are whole
arrays in global memory, read and written with masked gathers), loops over ``k`` in blocks
of ``block_k`` with float32 accumulation, and stores only its group's rows of the tile.
Rows of other groups are masked loads (zeros), so NaN padding rows are never read; the
programs of one tile write disjoint rows, so they never race. Programs past the real
visit count compute and store nothing; rows of no group are set to zero in XLA afterwards.

A quantized ``w`` (int8, or int4 symmetric or with minimums; ``[groups, n, k]``,
``trans_w=True``, scales per group in any block) runs the same schedule in
:func:`_quantized_kernel`: each ``[block_n, block_k]`` block of values is gathered (int4:
the byte of each value, its nibble selected by the column's parity) with its scales,
dequantized in registers to ``x``'s dtype and contracted over ``k``. fp8 is refused
(Triton's e4m3 conversion needs compute capability 8.9, and no GPU has compiled it). There
is no gradient through a quantized ``w``.

The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.grouped_matmul.grouped_matmul`; reference: its XLA implementation
:func:`forge_jax.ops.grouped_matmul.grouped_matmul_xla`. Tests:
``tests/test_pallas_gpu_grouped_matmul.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.grouped_matmul import cdiv, grouped_matmul_xla, no_gradient, tile_schedule
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.quant import QuantizedArray

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

# Element offsets are int32: stay clear of 2**31.
MAX_SIZE = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes (powers of two >= 16: Triton dots) and Triton launch parameters."""

    block_m: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int = 2


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind
# and the interpreter). Not measured yet: the shapes of common Triton matmul configs.
TUNED: Mapping[str, Mapping[str, int]] = {
    "H100": dict(block_m=64, block_k=64, block_n=128, num_warps=4, num_stages=3),
    "A100": dict(block_m=64, block_k=32, block_n=128, num_warps=4, num_stages=3),
    "L4": dict(block_m=32, block_k=32, block_n=64, num_warps=4, num_stages=2),
    "default": dict(block_m=32, block_k=32, block_n=64, num_warps=4, num_stages=2),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs on ``device_kind`` from :data:`TUNED` (the same for any arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.grouped_matmul` arguments, else
    why not."""
    x, w = args["x"], args["w"]
    trans_w = args.get("trans_w", False)
    if jnp.dtype(x.dtype) not in _common.FLOAT_DTYPES:
        return f"x.dtype={jnp.dtype(x.dtype).name}; the kernel reads float32/bf16/f16"
    if isinstance(w, QuantizedArray):
        if not trans_w:
            return ("a quantized w as [groups, k, n]: the kernel dequantizes [groups, n, k] "
                    "(trans_w=True), the layout fj.quantize gives per-channel scales and "
                    "int4 groups in")
        if w.format == "mxfp4":
            return ("a quantized w in mxfp4: the kernel dequantizes integer values with "
                    "float scales, not FP4 E2M1 codes with E8M0 exponents (XLA serves it)")
        if w.format == "fp8":
            return ("a quantized w in fp8: Triton converts float8_e4m3fn only on compute "
                    "capability >= 8.9, and no GPU has compiled this kernel's fp8 path")
        arrays = (("x", x), ("w.values", w.values), ("w.scales", w.scales))
    elif trans_w:
        return ("trans_w=True with a float w: the kernel reads float w as [groups, k, n] "
                "blocks (the XLA implementation serves [groups, n, k])")
    else:
        arrays = (("x", x), ("w", w))
    for name, a in arrays:
        if a.size > MAX_SIZE:
            return f"{name}.size={a.size} > {MAX_SIZE}: the kernel's offsets are int32"
    return None


def _tile(schedule_refs, x_ref, out_ref, load_w, w_contract, *, block_m, block_k, block_n):
    """One ``[block_m, block_n]`` output tile of the grouped product: the schedule picks the
    group and row tile of grid step ``program_id(0)``; ``load_w(group, kk, k_ok, cols,
    col_ok)`` gives the weight block for k indices ``kk`` (float, in any layout: its axis
    ``w_contract`` is contracted with x's k). Rows of other groups and steps past the
    schedule's visits write nothing."""
    group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref = schedule_refs
    m, k = x_ref.shape
    n = out_ref.shape[1]
    s = pl.program_id(0)
    group = group_ids_ref[s]
    rows = tile_ids_ref[s] * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    mine = (rows >= starts_ref[group]) & (rows < ends_ref[group])  # rows < m too
    col_ok = cols < n
    real = s < visits_ref[0]

    def body(kb, acc):
        kk = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = kk < k
        xb = _compat.triton_load(x_ref, (rows[:, None], kk[None, :]),
                                 mask=mine[:, None] & k_ok[None, :], other=0)
        wb = load_w(group, kk, k_ok, cols, col_ok).astype(xb.dtype)
        # HIGHEST: float32 operands as IEEE products (Triton's default is TF32).
        return acc + jax.lax.dot_general(xb, wb, (((1,), (w_contract,)), ((), ())),
                                         precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)

    k_blocks = jnp.where(real, pl.cdiv(k, block_k), 0)
    acc = jax.lax.fori_loop(0, k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
    _compat.triton_store(out_ref, (rows[:, None], cols[None, :]), acc.astype(out_ref.dtype),
                         mask=real & mine[:, None] & col_ok[None, :])


def _kernel(group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref, x_ref, w_ref,
            out_ref, **blocks):
    # x_ref [m, k], w_ref [groups, k, n], out_ref [m, n]: whole arrays; the schedule refs
    # [steps] and the group bounds [groups] likewise.
    def load_w(group, kk, k_ok, cols, col_ok):
        return _compat.triton_load(w_ref, (group, kk[:, None], cols[None, :]),
                                   mask=k_ok[:, None] & col_ok[None, :], other=0)

    _tile((group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref), x_ref, out_ref,
          load_w, 0, **blocks)


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul_forward(x, w, group_starts, group_ends, *, block_m, block_k, block_n,
                           num_warps, num_stages, interpret=False):
    """The kernel alone (no VJP).

    Args:
      x: ``[m, k]``; w: ``[groups, k, n]``, one dtype (float32/bfloat16/float16).
      group_starts, group_ends: int32 ``[groups]``, consecutive row ranges (as the op binds
        them).
      block_m, block_k, block_n: tile sizes, powers of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).
    """
    _compat.filter_triton_deprecation()
    _common.check_dot_blocks(block_m=block_m, block_k=block_k, block_n=block_n)
    m, k = x.shape
    groups, _, n = w.shape
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    group_ids, tile_ids, visits = tile_schedule(group_starts, group_ends, m, block_m)
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0,
        bytes_accessed=itemsize * (m * k * cdiv(n, block_n) + groups * k * n + m * n))
    out = _common.triton_call(
        functools.partial(_kernel, block_m=block_m, block_k=block_k, block_n=block_n),
        grid=(group_ids.shape[0], cdiv(n, block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        num_warps=num_warps, num_stages=num_stages,
        cost_estimate=cost,
        interpret=interpret,
        name="forge_jax_grouped_matmul",
    )(group_ids, tile_ids, group_starts, group_ends, visits[None], x, w)
    # Rows of no group were never written: zeros.
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    covered = (rows >= group_starts[0]) & (rows < group_ends[-1])
    return jnp.where(covered, out, jnp.zeros((), out.dtype))


def _quantized_kernel(group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref, x_ref,
                      values_ref, scales_ref, *refs, int4, rows_per_scale, cols_per_scale,
                      **blocks):
    # x_ref [m, k]; values_ref [groups, n, k] (int4: [groups, n, k / 2], two values a
    # byte); scales_ref (and minimums) [groups, n / rows_per_scale, k / cols_per_scale];
    # out_ref [m, n]. The w block is gathered as [block_n, block_k], dequantized in
    # registers to x's dtype, and contracted over k: no float copy of w exists anywhere.
    *minimums_ref, out_ref = refs

    def load_w(group, kk, k_ok, cols, col_ok):
        ok = col_ok[:, None] & k_ok[None, :]
        if int4:
            packed = _compat.triton_load(values_ref, (group, cols[:, None], (kk // 2)[None, :]),
                                         mask=ok, other=0)
            q = jnp.where((kk % 2 == 1)[None, :], packed >> 4, packed & 0xF)
            q = q.astype(jnp.float32) - (0.0 if minimums_ref else 8.0)
        else:
            q = _compat.triton_load(values_ref, (group, cols[:, None], kk[None, :]), mask=ok,
                                    other=0).astype(jnp.float32)
        at = (group, (cols // rows_per_scale)[:, None], (kk // cols_per_scale)[None, :])
        wb = q * _compat.triton_load(scales_ref, at, mask=ok, other=0).astype(jnp.float32)
        if minimums_ref:
            wb = wb + _compat.triton_load(minimums_ref[0], at, mask=ok,
                                          other=0).astype(jnp.float32)
        return wb

    _tile((group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref), x_ref, out_ref,
          load_w, 1, **blocks)


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul_quantized_forward(x, w, group_starts, group_ends, *, block_m, block_k,
                                     block_n, num_warps, num_stages, interpret=False):
    """The kernel with a quantized ``w`` (no gradient).

    Args:
      x: ``[m, k]`` float32/bfloat16/float16.
      w: a :class:`forge_jax.QuantizedArray` ``[groups, n, k]`` (int8 or int4) with blocks
        of 1 along the groups (``trans_w=True``'s layout).
      group_starts, group_ends, block_m, block_k, block_n, num_warps, num_stages,
        interpret: as :func:`grouped_matmul_forward`.
    """
    _compat.filter_triton_deprecation()
    _common.check_dot_blocks(block_m=block_m, block_k=block_k, block_n=block_n)
    m, k = x.shape
    groups, n, _ = w.shape
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    _, rows_per_scale, cols_per_scale = w.full_block()
    group_ids, tile_ids, visits = tile_schedule(group_starts, group_ends, m, block_m)
    stored = w.nbytes
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0,
        bytes_accessed=jnp.dtype(x.dtype).itemsize * (m * k * cdiv(n, block_n) + m * n)
        + stored)
    minimums = () if w.minimums is None else (w.minimums,)
    out = _common.triton_call(
        functools.partial(_quantized_kernel, block_m=block_m, block_k=block_k,
                          block_n=block_n, int4=w.format == "int4",
                          rows_per_scale=rows_per_scale, cols_per_scale=cols_per_scale),
        grid=(group_ids.shape[0], cdiv(n, block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        num_warps=num_warps, num_stages=num_stages,
        cost_estimate=cost,
        interpret=interpret,
        name="forge_jax_grouped_matmul_quantized",
    )(group_ids, tile_ids, group_starts, group_ends, visits[None], x, w.values, w.scales,
      *minimums)
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    covered = (rows >= group_starts[0]) & (rows < group_ends[-1])
    return jnp.where(covered, out, jnp.zeros((), out.dtype))


def _reference(x, w, group_starts, group_ends):
    return grouped_matmul_xla(x, w, group_starts=group_starts, group_ends=group_ends)


_grouped_matmul = with_reference_vjp(grouped_matmul_forward, _reference)


def grouped_matmul(x, w, *, group_starts, group_ends, trans_w=False, block_m=None, block_k=None,
                   block_n=None, num_warps=None, num_stages=None, interpret=False):
    """:func:`forge_jax.grouped_matmul` through the kernel; differentiable (XLA VJP).

    Args:
      x, w, group_starts, group_ends, trans_w: as the op binds them (a float ``w`` as
        ``[groups, k, n]``, or an int8/int4 quantized one as ``[groups, n, k]`` with
        ``trans_w``, dequantized in the kernel, without a gradient).
      block_m, block_k, block_n, num_warps, num_stages: override the tuning table's entry.
      interpret: run in Pallas' interpreter (any platform).
    """
    reason = supports(dict(x=x, w=w, trans_w=trans_w))
    if reason is not None and (trans_w or isinstance(w, QuantizedArray)):
        raise ValueError(f"the GPU grouped_matmul kernel cannot serve this: {reason}")
    config = _common.with_knobs(default_config({}, _common.device_kind(interpret)),
                                block_m=block_m, block_k=block_k, block_n=block_n,
                                num_warps=num_warps, num_stages=num_stages)
    if isinstance(w, QuantizedArray):
        return no_gradient(grouped_matmul_quantized_forward, x, w, group_starts, group_ends,
                           interpret=interpret, **dataclasses.asdict(config))
    return _grouped_matmul(x, w, group_starts, group_ends, interpret=interpret,
                           **dataclasses.asdict(config))


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults."""
    del args
    return [dict(block_m=bm, block_k=bk, block_n=bn, num_warps=w)
            for bm in (16, 64, 128) for bk in (32, 64) for bn in (64, 128) for w in (4, 8)]


_registration.register(
    "grouped_matmul", grouped_matmul, backend="gpu", supports=supports, verified=VERIFIED,
    description="megablox schedule of (row tile, group) visits, masked gathers; int8/int4 "
                "w ([groups, n, k]) dequantized in registers",
    configs=configs, interpret_configs=lambda args: [dict(block_m=16, block_n=32)])
