"""Pallas TPU kernel (Mosaic): RMSNorm, optionally fused with the residual add.

``x`` is flattened to ``[rows, dim]``; grid ``(cdiv(rows, block_rows),)`` over blocks of
``(block_rows, dim)``: whole rows, so the hidden dim is the lane dim (Mosaic accepts a block
dim equal to the array's, 576 included, although only multiples of 128 fill the lanes) and
``block_rows`` is a multiple of the sublane tile (8 for float32, 16 for the packed 16-bit
types) or all the rows. On TPU, Pallas clips the last partial block's writes; its rows
past the end are never mixed with real ones (every row is normalised on its own). Each
block reads ``x`` (and ``residual``) once and writes ``y`` (and ``h``) once. The contract is
that of :func:`forge_jax.rms_norm` (its XLA implementation is the reference): ``h = x +
residual`` rounded to ``x.dtype``, ``y = weight * h / sqrt(mean(h * h) + eps)``, float32 math.

Backward: the reference's VJP (:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`).
Op: :func:`forge_jax.ops.norm.rms_norm`; reference: its XLA implementation
:func:`forge_jax.ops.norm.rms_norm_xla`. Tests: ``tests/test_pallas_tpu_elementwise.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import rms_norm_reference, with_reference_vjp
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}

# A block holds whole rows (one pass, no second read of x) and at least one sublane tile of
# them: at 32768 float32 values, 16 rows of each of the four arrays, double-buffered, plus
# their float32 copies, already take ~12 MiB of the 16 MiB scoped VMEM of a v4/v5e. Wider
# rows would need a looped two-pass kernel; no released model has them (Llama 3 405B:
# 16384, Nemotron-4 340B: 18432).
MAX_HIDDEN = 32768


# The launch parameter, elements per block (rows per block: :func:`block_rows_for`), and its
# defaults per TPU generation (:func:`_common.per_generation`), untuned, pending
# measurements on TPU hardware.
Config = _common.BlockConfig
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_elements=128 * 1024), v5p=dict(block_elements=256 * 1024),
    v6e=dict(block_elements=256 * 1024), default=dict(block_elements=128 * 1024))
default_config = _common.block_config(TUNED)


def block_rows_for(rows: int, dim: int, dtype, device_kind: str | None = None) -> int:
    """Rows per block for ``rows`` rows of ``dim`` values of ``dtype`` on ``device_kind``:
    a multiple of the sublane tile, or ``rows`` itself when that is smaller (a block equal
    to the array's dim is always accepted by Mosaic)."""
    block_rows = _common.block_rows(default_config({}, device_kind).block_elements, dim, dtype)
    return rows if rows <= block_rows else block_rows


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rms_norm` arguments, else why not."""
    x, weight, residual = args["x"], args["weight"], args["residual"]
    for name, a in (("x", x), ("weight", weight), ("residual", residual)):
        if a is not None and jnp.dtype(a.dtype) not in _common.FLOAT_DTYPES:
            return (f"{name}.dtype={jnp.dtype(a.dtype).name}; the kernel is built and tested for "
                    "float32/bfloat16, the TPU inference dtypes (a policy: float16 lowers)")
    if x.shape[-1] > MAX_HIDDEN:
        return (f"hidden size {x.shape[-1]} > {MAX_HIDDEN}: a block of whole rows must fit "
                "VMEM")
    return None


def _kernel(*refs, eps, has_residual):
    # x_ref, res_ref, y_ref, h_ref: [block_rows, dim]; w_ref: [1, dim].
    if has_residual:
        x_ref, res_ref, w_ref, y_ref, h_ref = refs
    else:
        (x_ref, w_ref, y_ref), res_ref, h_ref = refs, None, None
    h = x_ref[...]
    if has_residual:
        # Rounded to x.dtype before normalising, as the reference does: the residual
        # stream carried forward is exactly what was normalised.
        h = (h.astype(jnp.float32) + res_ref[...].astype(jnp.float32)).astype(h_ref.dtype)
        h_ref[...] = h
    h = h.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(h * h, axis=1, keepdims=True) + eps)
    y_ref[...] = (h * inv * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "interpret"))
def rms_norm_forward(x, weight, residual=None, *, eps, block_rows, interpret=False):
    """The kernel alone (no VJP): ``y`` or ``(y, h)`` as :func:`forge_jax.rms_norm`.

    Args:
      x: ``[..., dim]`` float32/bfloat16.
      weight: ``[dim]`` float32/bfloat16.
      residual: optional ``[..., dim]`` like ``x``.
      eps: added to the mean square.
      block_rows: rows per block, a multiple of 8 (16 for bfloat16 fills the packed
        sublanes) or at least the row count.
      interpret: run in the TPU interpreter (any platform).
    """
    dim = x.shape[-1]
    n_rows = x.size // dim if dim else 0
    has_residual = residual is not None
    n_out = 2 if has_residual else 1
    if n_rows == 0:
        outs = [jnp.zeros(x.shape, x.dtype)] * n_out
        return tuple(outs) if has_residual else outs[0]
    block_rows = min(block_rows, n_rows)
    row_spec = pl.BlockSpec((block_rows, dim), lambda i: (i, 0))
    operands = [x.reshape(n_rows, dim)]
    if has_residual:
        operands.append(residual.reshape(n_rows, dim))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, has_residual=has_residual),
        grid=(pl.cdiv(n_rows, block_rows),),
        in_specs=[row_spec] * len(operands) + [pl.BlockSpec((1, dim), lambda i: (0, 0))],
        out_specs=[row_spec] * n_out,
        out_shape=[jax.ShapeDtypeStruct((n_rows, dim), x.dtype)] * n_out,
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_rms_norm",
        cost_estimate=_cost.elementwise(n_rows * dim, flops=4 + has_residual,
                                        io=(*operands, *operands, weight)),
    )(*operands, weight.reshape(1, dim))
    out = [o.reshape(x.shape) for o in out]
    return tuple(out) if has_residual else out[0]


_rms_norm = with_reference_vjp(rms_norm_forward, rms_norm_reference, static=("eps",))


def rms_norm(x, weight, *, eps, residual, block_rows=None, interpret=False):
    """:func:`forge_jax.rms_norm` through the kernel; differentiable (the XLA
    implementation's VJP).

    Args:
      x, weight, eps, residual: as :func:`forge_jax.rms_norm`.
      block_rows: overrides :func:`block_rows_for` (from :data:`TUNED`).
      interpret: run in the TPU interpreter (any platform).
    """
    if block_rows is None:
        dim = x.shape[-1]
        block_rows = block_rows_for(x.size // dim if dim else 0, dim, x.dtype,
                                    _common.device_kind(interpret))
    return _rms_norm(x, weight, residual, eps=eps, block_rows=block_rows, interpret=interpret)


_registration.register(
    "rms_norm", rms_norm, backend="tpu", supports=supports, verified=VERIFIED,
    description="blocks of whole rows, fused residual add, float32 math")
