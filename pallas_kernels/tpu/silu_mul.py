"""Pallas TPU kernel (Mosaic): the gated activation ``silu(gate) * up``.

The inputs are viewed, for free (a reshape of contiguous data), as ``[rows, lanes]``:
``lanes`` is the largest of 1024, 512, 256, 128 that divides the size, so every vreg is
full; a size that no multiple of 128 divides keeps the array's own last dim as ``lanes``
(a block dim equal to the array's is always accepted by Mosaic, with partly filled vregs).
Grid ``(cdiv(rows, block_rows),)`` over ``(block_rows, lanes)`` blocks, ``block_rows`` a
multiple of the sublane tile (8 for float32, 16 for bfloat16) or all the rows; Pallas clips
the last partial block's writes on TPU. Each element of ``gate`` and ``up`` is read once and
the product written once; math in float32. The contract is that of
:func:`forge_jax.silu_mul` (its XLA implementation is the reference).

The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.activation.silu_mul`; reference: its XLA implementation
:func:`forge_jax.ops.activation.silu_mul_xla`. Tests:
``tests/test_pallas_tpu_elementwise.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.activation import silu_mul_xla
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}

_LANES = (1024, 512, 256, 128)
# When no multiple of 128 divides the size, a block holds at least a sublane tile of whole
# last-dim rows; past this width those no longer fit VMEM comfortably.
MAX_UNALIGNED_LANES = 32768


# The launch parameter, elements per block (rows per block: :func:`block_rows_for`), and its
# defaults per TPU generation (:func:`_common.per_generation`), untuned, pending
# measurements on TPU hardware.
Config = _common.BlockConfig
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_elements=256 * 1024), v5p=dict(block_elements=512 * 1024),
    v6e=dict(block_elements=512 * 1024), default=dict(block_elements=256 * 1024))
default_config = _common.block_config(TUNED)


def layout(shape) -> tuple[int, int]:
    """The ``(rows, lanes)`` view of an array of ``shape`` (see the module docstring)."""
    size = math.prod(shape)
    lanes = next((n for n in _LANES if size % n == 0), shape[-1] if shape else 1)
    return (size // lanes if lanes else 0), lanes


def block_rows_for(rows: int, lanes: int, dtype, device_kind: str | None = None) -> int:
    """Rows per block: a multiple of the sublane tile, or ``rows`` when that is smaller."""
    block_rows = _common.block_rows(default_config({}, device_kind).block_elements,
                                    max(lanes, 1), dtype)
    return rows if rows <= block_rows else block_rows


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.silu_mul` arguments, else why not."""
    gate = args["gate"]
    if jnp.dtype(gate.dtype) not in _common.FLOAT_DTYPES:
        return (f"gate.dtype={jnp.dtype(gate.dtype).name}; the kernel is built and tested for "
                "float32/bfloat16, the TPU inference dtypes (a policy: float16 lowers)")
    _, lanes = layout(gate.shape)
    if lanes > MAX_UNALIGNED_LANES:
        return (f"{gate.size=} has no factor of 128 and its last dim {lanes} > "
                f"{MAX_UNALIGNED_LANES}: a block of whole last-dim rows must fit VMEM")
    return None


def _kernel(gate_ref, up_ref, out_ref):
    # [block_rows, lanes] each.
    g = gate_ref[...].astype(jnp.float32)
    u = up_ref[...].astype(jnp.float32)
    # silu(g) = g * sigmoid(g), written as g / (1 + exp(-g)): for g -> -inf, exp(-g)
    # overflows to inf and the quotient is -0, as sigmoid's limit.
    out_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def silu_mul_forward(gate, up, *, block_rows, interpret=False):
    """The kernel alone (no VJP): ``silu(gate) * up``.

    Args:
      gate, up: arrays of one shape and dtype (float32/bfloat16).
      block_rows: rows of the :func:`layout` view per block, a multiple of 8 (16 for
        bfloat16 fills the packed sublanes) or at least the row count.
      interpret: run in the TPU interpreter (any platform).
    """
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    rows, lanes = layout(gate.shape)
    block_rows = min(block_rows, rows)
    spec = pl.BlockSpec((block_rows, lanes), lambda i: (i, 0))
    out = pl.pallas_call(
        _kernel,
        grid=(pl.cdiv(rows, block_rows),),
        in_specs=[spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((rows, lanes), gate.dtype),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_silu_mul",
        cost_estimate=_cost.elementwise(gate.size, flops=4, transcendentals=1,
                                        io=(gate, up, gate)),
    )(gate.reshape(rows, lanes), up.reshape(rows, lanes))
    return out.reshape(gate.shape)


_silu_mul = with_reference_vjp(silu_mul_forward, silu_mul_xla)


def silu_mul(gate, up, *, block_rows=None, interpret=False):
    """:func:`forge_jax.silu_mul` through the kernel; differentiable (the XLA
    implementation's VJP).

    Args:
      gate, up: as :func:`forge_jax.silu_mul`.
      block_rows: overrides :func:`block_rows_for` (from :data:`TUNED`).
      interpret: run in the TPU interpreter (any platform).
    """
    if block_rows is None:
        rows, lanes = layout(gate.shape)
        block_rows = block_rows_for(rows, lanes, gate.dtype,
                                    _common.device_kind(interpret))
    return _silu_mul(gate, up, block_rows=block_rows, interpret=interpret)


_registration.register(
    "silu_mul", silu_mul, backend="tpu", supports=supports, verified=VERIFIED,
    description="lane-dense [rows, 128k] view, float32 math")
