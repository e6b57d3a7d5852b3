"""Pallas GPU kernel (Triton lowering, Ampere and up): a matrix multiply with a quantized
weight, ``a @ dequantize(b).T`` for ``b`` an int8 or int4 :class:`forge_jax.QuantizedArray`
``[N, K]`` in the ``[out, in]`` layout, the dequantization fused into the product.

Grid ``(cdiv(M, block_m), cdiv(N, block_n))``: each program owns a ``[block_m, block_n]``
block of the output and walks K in steps of ``block_k`` stored bytes, reading the weight as
stored (int8, or uint8 holding two int4 values a byte) with masked loads, so the weight
crosses HBM once per row block at its stored size (decode has one row block: the whole
weight once). ``a``, the weight and the output are whole arrays in global memory (the
Triton lowering's masked gathers); rows past ``M`` and columns past ``N`` or ``K`` read
zeros and are not stored. Decode's 1 to 16 rows are one block of 16 rows (a Triton dot's
smallest), with narrow column blocks so the few rows still spread the weight over the SMs.

* int8, one scale per output channel (symmetric): the values reach the tensor cores exactly
  (every int8 is a bfloat16/float16 value), the step's product accumulates in float32, and
  the scale multiplies the accumulator once, in the epilogue.
* int8 in groups along K (GGUF's Q8_0, with or without minimums), and int4 in groups (32,
  64, 128 ...; symmetric ``q - 8`` or with a minimum): each step dequantizes its tile in
  registers, ``q * scale (+ minimum)`` in float32 with the group's scale gathered per value,
  rounded to the activations' dtype (as the XLA implementation does) before the dot. int4 is
  unpacked in registers: the low nibbles hold the even columns and the high ones the odd
  columns, so the wrapper hands the kernel ``a``'s even and odd columns (a copy of the
  activations, small for decode) and each half is one dot, with no interleaving.

``alpha``, ``beta * c`` and the output cast are applied in XLA after the kernel (an
``[M, N]`` float32 result, small beside the weight). Not served (``supports`` says so, XLA
serves them): ``trans_b=False``, fp8 (the Mosaic GPU kernel serves it on Hopper), scales
per block of rows, int8 activations (``activations="int8"``, W8A8).

Op: :func:`forge_jax.ops.quantized_matmul.quantized_matmul`; reference: its XLA
implementation :func:`forge_jax.ops.quantized_matmul.quantized_matmul_xla`. Launch knobs:
:class:`Config`, :data:`TUNED` (by device kind, then decode or prefill rows),
:func:`default_config`. Registered (bottom of this module) as ``"pallas"`` on GPU, by name
until :data:`VERIFIED` names a GPU (never ranked above XLA before that), and
``"pallas_gpu_interpret"``. Tests: ``tests/test_pallas_gpu_quantized_matmul.py``.
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
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.quant import QuantizedArray

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none. Checked in
# Pallas' interpreter against float64, compiled deviceless for a100 without spills (JAX
# 0.10.2, ptxas 12.9 of the CUDA 12 wheel, 2026-11-25, tests/test_aot.py; three cases for
# h100 by hand, no spills either); no GPU has run it.
VERIFIED: dict[str, str] = {}

FORMATS = ("int8", "int4")
# Element offsets are int32: stay clear of 2**31.
MAX_SIZE = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes (powers of two >= 16: Triton dots; ``block_k`` in stored bytes along K, so
    an int4 step covers ``2 * block_k`` values) and Triton launch parameters."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2


# By device kind (:func:`_common.kind_row`), then by rows of ``a`` (the smallest bucket >= M;
# the largest past the table). Not measured (no GPU has run the kernel): decode (<= 16 rows)
# takes narrow column blocks and long K steps, so an SmolLM2-sized product (N 576 to 1536)
# still has 18 to 48 programs and each streams whole 128-byte lines of the weight; prefill
# takes 64 x 64 tiles and 32-byte K steps. Sized so ptxas (a100) spills nothing: a prefill
# int4 step of 64 bytes held 255 registers and spilled 52 to 80 bytes.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "A100": {16: dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=3),
             128: dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)},
    "default": {16: dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2),
                128: dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)},
}
# float32 activations (IEEE products, several dot passes a step): smaller steps; with the
# 16-bit tiles ptxas spilled 184 bytes (int8 decode) to 3984 (int4 prefill, minimums).
TUNED_FLOAT32: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {16: dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2),
                128: dict(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2)},
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs for ``args`` (the rows and dtype of ``a``) on ``device_kind`` from
    :data:`TUNED` (16-bit activations) or :data:`TUNED_FLOAT32`."""
    a = args.get("a")
    rows = 1 if a is None else max(1, int(a.size // max(a.shape[-1], 1)))
    table = TUNED_FLOAT32 if a is not None and jnp.dtype(a.dtype) == jnp.float32 else TUNED
    return Config(**_common.tuned(table, device_kind, rows))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.ops.quantized_matmul` arguments,
    else why not."""
    a, b = args["a"], args["b"]
    if not args["trans_b"]:
        return "trans_b=False: the kernel reads the weight in the [out, in] layout"
    if b.format not in FORMATS:
        return f"b.format={b.format!r}: the kernel dequantizes int8 and int4"
    if b.activations is not None:
        return (f"b.activations={b.activations!r} (W8A8): the kernel multiplies dequantized "
                f"weights in the activations' dtype; XLA serves W8A8")
    if b.full_block()[0] != 1:
        return f"b.block={b.block}: the kernel takes scales per group along K only"
    if jnp.dtype(a.dtype) not in _common.FLOAT_DTYPES:
        return f"a.dtype={jnp.dtype(a.dtype).name}; the kernel reads float32/bf16/f16"
    if a.size > MAX_SIZE or b.values.size > MAX_SIZE:
        return f"a.size={a.size}, b.size={b.values.size}: the kernel's offsets are int32 " \
               f"(<= {MAX_SIZE})"
    return None


def _kernel(*refs, fmt, group, per_channel, asymmetric, block_m, block_n, block_k):
    # int8: a [M, K]; int4: a_even, a_odd [M, K / 2]. v [N, K] int8 or [N, K / 2] uint8,
    # s (and m) [N, K / group] float32, out [M, N] float32: whole arrays.
    if fmt == "int4":
        a_even, a_odd, v_ref, s_ref, *rest = refs
        a_refs = (a_even, a_odd)
    else:
        a_ref, v_ref, s_ref, *rest = refs
        a_refs = (a_ref,)
    m_ref = rest[0] if asymmetric else None
    out_ref = rest[-1]
    m, kq = a_refs[0].shape
    n = out_ref.shape[1]
    dtype = a_refs[0].dtype
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m, cols < n
    # float32 activations as IEEE products (Triton's default is TF32); 16-bit ones as they are.
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    dot = lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                                           preferred_element_type=jnp.float32)
    # Values per stored byte along K, and the stored bytes of one group.
    group_bytes = group // 2 if fmt == "int4" else group

    def dequantized(q, kk, k_ok):
        """``q`` [block_n, block_k] float32 values -> the weight tile in ``dtype``."""
        idx = (cols[:, None], (kk // group_bytes)[None, :])
        mask = col_ok[:, None] & k_ok[None, :]
        w = q * _compat.triton_load(s_ref, idx, mask=mask, other=0.0)
        if m_ref is not None:
            w = w + _compat.triton_load(m_ref, idx, mask=mask, other=0.0)
        return w.astype(dtype)

    def body(step, acc):
        kk = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
        k_ok = kk < kq
        v = _compat.triton_load(v_ref, (cols[:, None], kk[None, :]),
                                mask=col_ok[:, None] & k_ok[None, :], other=0)
        a_tiles = [_compat.triton_load(r, (rows[:, None], kk[None, :]),
                                       mask=row_ok[:, None] & k_ok[None, :], other=0)
                   for r in a_refs]
        if fmt == "int8":
            q = v.astype(jnp.float32)
            w = q.astype(dtype) if per_channel else dequantized(q, kk, k_ok)
            return acc + dot(a_tiles[0], w)
        v = v.astype(jnp.int32)
        offset = 0 if asymmetric else 8
        low = dequantized(((v & 0xF) - offset).astype(jnp.float32), kk, k_ok)
        high = dequantized(((v >> 4) - offset).astype(jnp.float32), kk, k_ok)
        return acc + dot(a_tiles[0], low) + dot(a_tiles[1], high)

    acc = jax.lax.fori_loop(0, pl.cdiv(kq, block_k), body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    if per_channel:
        acc = acc * _compat.triton_load(s_ref, (cols, 0), mask=col_ok, other=0.0)[None, :]
    _compat.triton_store(out_ref, (rows[:, None], cols[None, :]), acc,
                         mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("fmt", "group", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def quantized_matmul_forward(a2, values, scales, minimums, *, fmt, group, block_m, block_n,
                             block_k, num_warps, num_stages, interpret=False):
    """The kernel alone: ``a2 [M, K] @ W.T`` in float32 for ``W`` ``[N, K]`` stored as
    ``values`` (int8 ``[N, K]`` or packed int4 ``[N, K / 2]``) with ``scales`` (and
    ``minimums``) ``[N, K / group]``.

    Args:
      a2: ``[M, K]`` float32/bfloat16/float16.
      values, scales, minimums: the weight's stored arrays (``minimums`` None: symmetric).
      fmt: ``"int8"`` or ``"int4"``; group: values per scale along K.
      block_m, block_n, block_k: tile sizes, powers of two >= 16 (``block_k`` in bytes).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).
    """
    _compat.filter_triton_deprecation()
    _common.check_dot_blocks(block_m=block_m, block_n=block_n, block_k=block_k)
    m, k = a2.shape
    n, kq = values.shape
    asymmetric = minimums is not None
    per_channel = fmt == "int8" and not asymmetric and group == k
    inputs = [a2[:, 0::2], a2[:, 1::2]] if fmt == "int4" else [a2]
    # Scales in float32 (a small array; GGUF's are float16).
    inputs += [values, scales.astype(jnp.float32)]
    if asymmetric:
        inputs.append(minimums.astype(jnp.float32))
    grid = (pl.cdiv(m, block_m), pl.cdiv(n, block_n))
    side = scales.size * 4 * (2 if asymmetric else 1)
    # What the programs load: the weight once per block of rows, ``a`` once per block of
    # columns (from L2 where it stays there: HBM's traffic is at most this).
    cost = pl.CostEstimate(
        flops=2 * m * n * k, transcendentals=0,
        bytes_accessed=(values.size * values.dtype.itemsize + side) * grid[0]
        + a2.size * a2.dtype.itemsize * grid[1] + 4 * m * n)
    return _common.triton_call(
        functools.partial(_kernel, fmt=fmt, group=group, per_channel=per_channel,
                          asymmetric=asymmetric, block_m=block_m, block_n=block_n,
                          block_k=block_k),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        num_warps=num_warps, num_stages=num_stages,
        cost_estimate=cost,
        interpret=interpret,
        name="forge_jax_gpu_quantized_matmul",
    )(*inputs)


def quantized_matmul(a, b: QuantizedArray, *, trans_b, alpha, beta, c, out_dtype,
                     block_m=None, block_n=None, block_k=None, num_warps=None,
                     num_stages=None, interpret=False):
    """:func:`forge_jax.ops.quantized_matmul.quantized_matmul` through the kernel (the
    arguments as the op binds them; ``trans_b`` must be True: :func:`supports`); the knobs
    override the tuning table's entry."""
    del trans_b
    config = _common.with_knobs(
        default_config({"a": a}, _common.device_kind(interpret)), block_m=block_m,
        block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    lead, k = a.shape[:-1], a.shape[-1]
    if a.size == 0:  # no rows: nothing to launch (a grid of no programs does not lower)
        out = jnp.zeros((*lead, b.shape[0]), jnp.float32)
    else:
        out = quantized_matmul_forward(
            a.reshape(-1, k), b.values, b.scales, b.minimums, fmt=b.format,
            group=b.full_block()[1], interpret=interpret, **dataclasses.asdict(config))
    return scale_and_add(out.reshape(*lead, b.shape[0]), alpha=alpha, beta=beta, c=c,
                         out_dtype=out_dtype)


_registration.register(
    "quantized_matmul", quantized_matmul, backend="gpu", supports=supports, verified=VERIFIED,
    description="int8/int4 weights dequantized in registers, masked tiles, float32 "
                "accumulation (Ampere+)",
    interpret_configs=lambda args: [dict(block_m=16, block_n=32, block_k=32)])
