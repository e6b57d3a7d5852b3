"""Pallas GPU kernel (Triton lowering): the gated activation ``silu(gate) * up``.

The inputs are flattened to one dimension; grid ``(cdiv(size, block_size),)``, each program
reads ``block_size`` elements of ``gate`` and ``up`` once and writes the product once, the
last block masked. Math in float32. The contract is that of :func:`forge_jax.silu_mul` (its
XLA implementation is the reference).

The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.activation.silu_mul`; reference: its XLA implementation
:func:`forge_jax.ops.activation.silu_mul_xla`. Tests: ``tests/test_pallas_gpu_silu_mul.py``,
``tests/test_gpu_tuning.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.activation import silu_mul_xla
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

# Block starts are int32 (program id * block size): stay well clear of 2**31.
MAX_SIZE = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: elements per program and Triton launch parameters."""

    block_size: int
    num_warps: int
    num_stages: int = 1


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind
# and the interpreter). Not measured yet: 16 elements, two 16-byte bf16 vectors, per thread.
TUNED: Mapping[str, Mapping[str, int]] = {
    "default": dict(block_size=4096, num_warps=8),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs on ``device_kind`` from :data:`TUNED` (the same for any
    :func:`forge_jax.silu_mul` arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.silu_mul` arguments, else why not."""
    gate = args["gate"]
    if jnp.dtype(gate.dtype) not in _common.FLOAT_DTYPES:
        return f"gate.dtype={jnp.dtype(gate.dtype).name}; the kernel reads float32/bf16/f16"
    if gate.size > MAX_SIZE:
        return f"{gate.size=} > {MAX_SIZE}: the kernel's block offsets are int32"
    return None


def _kernel(gate_ref, up_ref, out_ref, *, size):
    # [block_size] each; the last block runs past the array's end, hence the mask.
    block_size = gate_ref.shape[0]
    mask = pl.program_id(0) * block_size + jnp.arange(block_size) < size
    g = _compat.triton_load(gate_ref, mask=mask, other=0).astype(jnp.float32)
    u = _compat.triton_load(up_ref, mask=mask, other=0).astype(jnp.float32)
    # silu(g) = g * sigmoid(g), written as g / (1 + exp(-g)): for g -> -inf, exp(-g)
    # overflows to inf and the quotient is -0, as sigmoid's limit.
    _compat.triton_store(out_ref, None, (g / (1.0 + jnp.exp(-g)) * u).astype(out_ref.dtype),
                         mask=mask)


@functools.partial(jax.jit, static_argnames=("block_size", "num_warps", "num_stages",
                                             "interpret"))
def silu_mul_forward(gate, up, *, block_size, num_warps, num_stages, interpret=False):
    """The kernel alone (no VJP): ``silu(gate) * up``.

    Args:
      gate, up: arrays of one shape and dtype (float32/bfloat16/float16).
      block_size: elements per program (a power of two).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).
    """
    _compat.filter_triton_deprecation()
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    size = gate.size
    spec = pl.BlockSpec((block_size,), lambda i: (i,))
    out = _common.triton_call(
        functools.partial(_kernel, size=size),
        grid=(pl.cdiv(size, block_size),),
        in_specs=[spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((size,), gate.dtype),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
        name="forge_jax_silu_mul",
        cost_estimate=_cost.elementwise(size, flops=4, transcendentals=1, io=(gate, up, gate)),
    )(gate.reshape(size), up.reshape(size))
    return out.reshape(gate.shape)


_silu_mul = with_reference_vjp(silu_mul_forward, silu_mul_xla)


def silu_mul(gate, up, *, block_size=None, num_warps=None, num_stages=None, interpret=False):
    """:func:`forge_jax.silu_mul` through the kernel; differentiable (XLA VJP).

    Args:
      gate, up: as :func:`forge_jax.silu_mul`.
      block_size, num_warps, num_stages: override the tuning table's entry.
      interpret: run in Pallas' interpreter (any platform).
    """
    config = _common.with_knobs(default_config({"gate": gate}, _common.device_kind(interpret)),
                                block_size=block_size, num_warps=num_warps,
                                num_stages=num_stages)
    return _silu_mul(gate, up, interpret=interpret, **dataclasses.asdict(config))


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults."""
    del args
    return [dict(block_size=b, num_warps=w) for b in (1024, 2048, 4096, 8192) for w in (4, 8)]


_registration.register(
    "silu_mul", silu_mul, backend="gpu", supports=supports, verified=VERIFIED,
    description="flattened blocks, float32 math", configs=configs,
    interpret_configs=lambda args: [dict(block_size=256)])
