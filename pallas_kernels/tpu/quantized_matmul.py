"""Pallas TPU kernel (Mosaic): a matrix multiply with a quantized weight,
``a @ dequantize(b).T`` for ``b`` an int8 or int4 :class:`forge_jax.QuantizedArray`
``[N, K]`` in the ``[out, in]`` layout, scales (and minimums) per group of ``G`` values along
``K`` (one scale per output channel is ``G == K``).

Grid ``(cdiv(M, block_m), N / block_n)``: each step reads an ``[block_m, K]`` tile of ``a`` and
``block_n`` rows of the weight as stored (int8, or uint8 holding two int4 values a byte) with
their ``[block_n, K / G]`` scales, dequantizes them in VMEM (float32 math, then the compute
dtype) and multiplies on the MXU with float32 accumulation: the weight crosses HBM once, at its
stored size. int4 is unpacked in VMEM: the low nibbles hold the even columns and the high ones
the odd columns, so the wrapper hands the kernel ``a``'s even and odd columns (a copy of the
activations, small for decode) and each half is one product, with no interleaving. Scales apply
per group of whole vregs: per channel, or groups of 128 int8 / 256 int4 values (smaller groups
are padded to whole vregs by Mosaic and run out of VMEM in libtpu's compile: :func:`supports`
refuses them). ``K`` is not tiled (a whole row of the weight a step), which bounds ``K``
(:data:`MAX_K`). ``alpha``, ``beta * c`` and the output cast are applied in XLA after the
kernel. Weight-only quantization (W8A16) keeps the activations in the compute dtype, so the
MXU multiplies floats.

W8A8 (``b.activations == "int8"``, int8 weights with per-channel scales): the activations'
rows are quantized to int8 in a small XLA prologue (:func:`forge_jax.quant.quantize_rows`,
the same function the XLA implementation calls), the kernel multiplies int8 x int8 on the MXU
with int32 accumulation (:func:`quantized_matmul_w8a8_forward`) and scales the float32 result
by the weight's column scales and the activations' row scales, the XLA implementation's
numerics. Only generations whose int8 MXU product Mosaic compiles take it
(:data:`_common.INT8_MXU`: v5e, v5p, v6e; libtpu refuses an int8 ``tpu.matmul`` for v4, and
TPU7x has no int8 MXU: :func:`supports` refuses both, and XLA serves W8A8 there). The
weight's bytes are those of W8A16; the activations cross HBM as int8 (a quarter of float32),
and the MXU's int8 rate is twice its bfloat16 rate on v5e, v5p and v6e.

Op: :func:`forge_jax.ops.quantized_matmul.quantized_matmul`; reference: its XLA implementation
:func:`forge_jax.ops.quantized_matmul.quantized_matmul_xla`. Launch knobs: :class:`Config`,
:data:`TUNED`, :func:`default_config`. Registered (bottom of this module) as ``"pallas"`` on
TPU, by name until :data:`VERIFIED` names a TPU, and ``"pallas_tpu_interpret"``. Tests:
``tests/test_pallas_tpu_quantized_matmul.py``.
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
from forge_jax.pallas_kernels.tpu import _common
from forge_jax.quant import QuantizedArray, quantize_rows

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none. Checked in the
# TPU interpreter against float64, and compiled deviceless for TPU v5e by libtpu 0.0.42.1
# (JAX 0.10.2, 2026-11-25, tests/test_pallas_tpu_quantized_matmul.py); no TPU has run it.
VERIFIED: dict[str, str] = {}
# K is not tiled: a step holds block_n whole weight rows and their float32 dequantized copy.
MAX_K = 8192
# An N that no multiple of 128 divides (SmolLM2's 576, or 960 fused q/k/v rows) is one
# block of all N rows, up to this many weights (4 MiB dequantized in float32).
MAX_WHOLE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows of ``a`` per step (a multiple of 8, or all of them) and at most as many weight
    rows per step (the largest multiple of 128 up to it dividing N; else all N rows)."""

    block_m: int
    block_n: int


# Untuned, pending a TPU: 128 weight rows of K = 8192 dequantized in float32 are 4 MiB.
TUNED: Mapping[str, Mapping[str, int]] = {
    "interpret": dict(block_m=128, block_n=128),
    "default": dict(block_m=128, block_n=128),
}


# W8A8: 512 rows a step. The weight is read once per block of rows, so a block of 128 rows
# does 256 int8 ops per weight byte, under the ~480 v5e's int8 MXU needs to outrun its HBM:
# 2048 x [14336, 4096] predicted 1.30 ms at 128 rows (HBM-bound, as W8A16's 1.31 ms) and
# 0.61 ms at 512 (int8-bound; W8A16 at 512 rows: 1.22 ms, bfloat16-bound). At K = 8192 a
# step holds 4 MiB of int8 activations (8 double-buffered) in v5e's 16 MiB scoped VMEM.
TUNED_W8A8: Mapping[str, Mapping[str, int]] = {
    "interpret": dict(block_m=128, block_n=512),  # fewer, larger steps: the tests' time
    "default": dict(block_m=512, block_n=128),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs from :data:`TUNED` (:data:`TUNED_W8A8` for a W8A8 ``b``)."""
    b = args.get("b")
    w8a8 = b is not None and b.activations == "int8"
    return Config(**_common.tuned(TUNED_W8A8 if w8a8 else TUNED, device_kind))


def _blocks_supported(a, b) -> str | None:
    """The dtype and block limits every path of the kernel shares (``None`` if they hold)."""
    n, k = b.shape
    if jnp.dtype(a.dtype) not in _common.FLOAT_DTYPES:
        return f"a.dtype={jnp.dtype(a.dtype).name}; the kernel is for float32/bfloat16"
    if n % _common.LANES and n * k > MAX_WHOLE:
        return (f"N={n} is not a multiple of {_common.LANES} (lane-dense output blocks), and "
                f"N * K = {n * k} weights are too many for one block (> {MAX_WHOLE})")
    if k > MAX_K:
        return f"K={k} > {MAX_K}: K is not tiled (a whole weight row a step)"
    return None


def _w8a8_supports(a, b) -> str | None:
    kind = _common.device_kind()
    if kind is not None and not _common.INT8_MXU.get(kind, False):
        known = ("has no int8 MXU product in Mosaic" if kind in _common.INT8_MXU
                 else "is not known to have an int8 MXU")
        return (f"activations='int8' (W8A8): {kind} {known} (int8 MXU: "
                f"{', '.join(k for k, v in _common.INT8_MXU.items() if v)}); XLA serves it")
    rows, group = b.full_block()
    if rows != 1 or group != b.shape[1]:
        return (f"activations='int8' (W8A8) with b.block={b.block}: the kernel takes one "
                f"scale per output channel")
    return _blocks_supported(a, b)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.ops.quantized_matmul` arguments,
    else why not."""
    a, b = args["a"], args["b"]
    if not args["trans_b"]:
        return "trans_b=False: the kernel reads the weight in the [out, in] layout"
    if b.activations == "int8":
        return _w8a8_supports(a, b)
    if b.format not in ("int8", "int4"):
        return f"b.format={b.format!r}: the kernel dequantizes int8 and int4"
    rows, group = b.full_block()
    k = b.shape[1]
    if rows != 1:
        return f"b.block={b.block}: the kernel takes scales per group along K only"
    if (reason := _blocks_supported(a, b)) is not None:
        return reason
    lanes = group // 2 if b.format == "int4" else group  # a group's bytes along a row
    if group != k and lanes % _common.LANES:
        return (f"groups of {group} values along K: {lanes} bytes a group is not a multiple "
                f"of {_common.LANES} lanes (Mosaic pads each group to whole vregs: int4 g32 "
                f"on SmolLM2's q/k/v ran out of VMEM in libtpu's compile for TPU v5e); "
                f"per-channel scales, or groups of 128 (int8) / 256 (int4) values, compile")
    return None


def _dequantized(q, s_ref, m_ref, *, group, offset, dtype):
    """``q`` [tn, c] (float32 values) with scales [tn, c / group] -> [tn, c] in ``dtype``."""
    tn, c = q.shape
    w = (q - offset).reshape(tn, c // group, group) * s_ref[...].astype(jnp.float32)[..., None]
    if m_ref is not None:
        w = w + m_ref[...].astype(jnp.float32)[..., None]
    return w.reshape(tn, c).astype(dtype)


def _kernel(*refs, fmt, group, asymmetric):
    # int8: a [tm, K], v [tn, K]; int4: a_even, a_odd [tm, K/2], v [tn, K/2] (uint8);
    # s (and m) [tn, K / G]; out [tm, tn] float32.
    if fmt == "int4":
        a_even, a_odd, v_ref, s_ref, *rest = refs
    else:
        a_ref, v_ref, s_ref, *rest = refs
    m_ref = rest[0] if asymmetric else None
    out_ref = rest[-1]
    dims = (((1,), (1,)), ((), ()))
    # float32 products in full precision; bfloat16 ones as they are (Mosaic refuses an fp32
    # contract precision for bfloat16 operands).
    dtype = (a_even if fmt == "int4" else a_ref).dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    dot = lambda x, w: jax.lax.dot_general(x, w, dims, precision=precision,
                                           preferred_element_type=jnp.float32)
    if fmt == "int8":
        w = _dequantized(v_ref[...].astype(jnp.float32), s_ref, m_ref, group=group, offset=0.0,
                         dtype=a_ref.dtype)
        out_ref[...] = dot(a_ref[...], w)
        return
    v = v_ref[...].astype(jnp.int32)
    offset = 0.0 if asymmetric else 8.0
    half = group // 2  # a group of G logical values is G / 2 bytes, in either half
    low = _dequantized((v & 0xF).astype(jnp.float32), s_ref, m_ref, group=half, offset=offset,
                       dtype=a_even.dtype)
    high = _dequantized((v >> 4).astype(jnp.float32), s_ref, m_ref, group=half, offset=offset,
                        dtype=a_even.dtype)
    out_ref[...] = dot(a_even[...], low) + dot(a_odd[...], high)


@functools.partial(jax.jit, static_argnames=("fmt", "group", "block_m", "block_n",
                                             "interpret"))
def quantized_matmul_forward(a2, values, scales, minimums, *, fmt, group, block_m, block_n,
                             interpret=False):
    """The kernel alone: ``a2 [M, K] @ W.T`` in float32 for ``W`` ``[N, K]`` stored as
    ``values`` (int8 ``[N, K]`` or packed int4 ``[N, K / 2]``) with ``scales`` (and
    ``minimums``) ``[N, K / group]``."""
    m, k = a2.shape
    n = values.shape[0]
    tm = m if m <= block_m else block_m
    tn = next((b for b in range(block_n // 128 * 128, 0, -128) if n % b == 0), n)
    asymmetric = minimums is not None
    kq = values.shape[1]
    if fmt == "int4":
        inputs = [a2[:, 0::2], a2[:, 1::2]]
        a_specs = [pl.BlockSpec((tm, k // 2), lambda i, j: (i, 0))] * 2
    else:
        inputs = [a2]
        a_specs = [pl.BlockSpec((tm, k), lambda i, j: (i, 0))]
    # Scales in float32 (a small array): Mosaic does not load float16 (GGUF's scales).
    scales = scales.astype(jnp.float32)
    minimums = None if minimums is None else minimums.astype(jnp.float32)
    inputs += [values, scales] + ([minimums] if asymmetric else [])
    g = scales.shape[1]
    w_specs = [pl.BlockSpec((tn, kq), lambda i, j: (j, 0)),
               pl.BlockSpec((tn, g), lambda i, j: (j, 0))]
    if asymmetric:
        w_specs.append(pl.BlockSpec((tn, g), lambda i, j: (j, 0)))
    pltpu = _compat.pallas_tpu()
    grid = (pl.cdiv(m, tm), n // tn)
    side = scales.size * scales.dtype.itemsize * (2 if asymmetric else 1)
    # The weight is read once per block of rows; a block of ``a`` once (its block index
    # stays the same along the grid's inner axis, so the pipeline does not fetch it again).
    cost = pl.CostEstimate(
        flops=2 * m * n * k, transcendentals=0,
        bytes_accessed=(values.size * values.dtype.itemsize + side) * grid[0]
        + a2.size * a2.dtype.itemsize + 4 * m * n)
    return pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, group=group, asymmetric=asymmetric),
        grid=grid,
        in_specs=a_specs + w_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_quantized_matmul",
    )(*inputs)


def _w8a8_kernel(qa_ref, sa_ref, v_ref, s_ref, out_ref):
    # qa [tm, K] int8, sa [tm, 1] float32, v [tn, K] int8, s [1, tn] float32, out [tm, tn].
    acc = jax.lax.dot_general(qa_ref[...], v_ref[...], (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)
    out_ref[...] = acc.astype(jnp.float32) * s_ref[...] * sa_ref[...]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def quantized_matmul_w8a8_forward(qa, sa, values, scales, *, block_m, block_n,
                                  interpret=False):
    """The W8A8 kernel alone: ``(qa @ values.T) * scales.T * sa`` in float32 for int8 ``qa``
    ``[M, K]`` with row scales ``sa`` ``[M, 1]`` and int8 ``values`` ``[N, K]`` with one scale
    per row, ``scales`` ``[N, 1]``; the integer product on the MXU, accumulated in int32."""
    m, k = qa.shape
    n = values.shape[0]
    tm = m if m <= block_m else block_m
    tn = next((b for b in range(block_n // 128 * 128, 0, -128) if n % b == 0), n)
    # The column scales as one lane-dense row (N floats, a copy of no consequence).
    scales = scales.astype(jnp.float32).reshape(1, n)
    grid = (pl.cdiv(m, tm), n // tn)
    # As the W8A16 kernel's: the weight once per block of rows, ``qa`` once.
    cost = pl.CostEstimate(
        flops=2 * m * n * k, transcendentals=0,
        bytes_accessed=(values.size + 4 * n) * grid[0] + qa.size + 4 * m + 4 * m * n)
    pltpu = _compat.pallas_tpu()
    return pl.pallas_call(
        _w8a8_kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((tm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((tm, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((tn, k), lambda i, j: (j, 0)),
                  pl.BlockSpec((1, tn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_quantized_matmul_w8a8",
    )(qa, sa, values, scales)


def quantized_matmul(a, b: QuantizedArray, *, trans_b, alpha, beta, c, out_dtype,
                     block_m=None, block_n=None, interpret=False):
    """:func:`forge_jax.ops.quantized_matmul.quantized_matmul` through the kernel (the
    arguments as the op binds them; ``trans_b`` must be True: :func:`supports`)."""
    del trans_b
    config = default_config({"b": b}, _common.device_kind(interpret))
    config = dataclasses.replace(config, **{name: v for name, v in (
        ("block_m", block_m), ("block_n", block_n)) if v is not None})
    lead, k = a.shape[:-1], a.shape[-1]
    if a.size == 0:  # no rows: nothing to launch (a grid of no programs does not lower)
        out = jnp.zeros((*lead, b.shape[0]), jnp.float32)
    elif b.activations == "int8":
        qa, sa = quantize_rows(a.reshape(-1, k))
        out = quantized_matmul_w8a8_forward(qa, sa, b.values, b.scales, block_m=config.block_m,
                                            block_n=config.block_n, interpret=interpret)
    else:
        out = quantized_matmul_forward(
            a.reshape(-1, k), b.values, b.scales, b.minimums, fmt=b.format,
            group=b.full_block()[1], block_m=config.block_m, block_n=config.block_n,
            interpret=interpret)
    return scale_and_add(out.reshape(*lead, b.shape[0]), alpha=alpha, beta=beta, c=c,
                         out_dtype=out_dtype)


_registration.register(
    "quantized_matmul", quantized_matmul, backend="tpu", supports=supports, verified=VERIFIED,
    description="int8/int4 weight rows dequantized in VMEM, one MXU product per step; W8A8: "
                "int8 x int8 on the MXU, int32 accumulation")
