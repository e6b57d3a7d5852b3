"""Pallas GPU kernel (Triton lowering): RMSNorm, optionally fused with the residual add.

Grid ``(cdiv(rows, block_rows),)`` over the rows of ``x`` flattened to ``[rows, dim]``. Each
program reads ``block_rows`` whole rows of ``x`` (and ``residual``) once, padded to the next
power of two with masked loads, and writes ``y`` (and ``h``) once. The contract is that of
:func:`forge_jax.rms_norm` (its XLA implementation is the reference): ``h = x + residual``
rounded to ``x.dtype``, ``y = weight * h / sqrt(mean(h * h) + eps)``, float32 math.

Backward: the reference's VJP (:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`).
Op: :func:`forge_jax.ops.norm.rms_norm`; reference: its XLA implementation
:func:`forge_jax.ops.norm.rms_norm_xla`. Launch knobs: :class:`Config`, the per-device table
:data:`TUNED`, :func:`default_config`. Registered by
:func:`~forge_jax.pallas_kernels._registration.register` (GPU; :data:`VERIFIED`). Tests:
``tests/test_pallas_gpu_norm.py``, ``tests/test_gpu_tuning.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import rms_norm_reference, with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

# A whole row lives in the registers of one program (one read of x, no second pass). At
# 32768 float32 values a row fills 64 registers per thread of 16 warps, one live copy of
# it half of an SM's register file; beyond that Triton spills to local memory, and a
# looped two-pass kernel (JAX's layer_norm) would be the right design. 32768 covers every
# released model (Llama 3 405B: 16384, Nemotron-4 340B: 18432).
MAX_HIDDEN = 32768


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: rows per program and Triton launch parameters."""

    block_rows: int
    num_warps: int
    num_stages: int = 1


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind
# and the interpreter), by padded hidden size: a row of ``dim`` values takes the smallest
# bucket >= ``next_pow2(dim)``. Not measured yet (no GPU has run the kernel): the ranges of
# JAX's own Pallas kernels and Triton's tutorials; fj.autotune measures, per shape, what
# these guess.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        256: dict(block_rows=16, num_warps=4),
        1024: dict(block_rows=8, num_warps=4),
        2048: dict(block_rows=4, num_warps=8),
        4096: dict(block_rows=2, num_warps=8),
        8192: dict(block_rows=1, num_warps=8),
        32768: dict(block_rows=1, num_warps=16),
    },
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs for these :func:`forge_jax.rms_norm` arguments (``args["x"]``:
    anything with a shape) on ``device_kind``, from :data:`TUNED`."""
    return Config(**_common.tuned(TUNED, device_kind, _common.next_pow2(args["x"].shape[-1])))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rms_norm` arguments, else why not."""
    x, weight, residual = args["x"], args["weight"], args["residual"]
    for name, a in (("x", x), ("weight", weight), ("residual", residual)):
        if a is not None and jnp.dtype(a.dtype) not in _common.FLOAT_DTYPES:
            return f"{name}.dtype={jnp.dtype(a.dtype).name}; the kernel reads float32/bf16/f16"
    if x.shape[-1] > MAX_HIDDEN:
        return (f"hidden size {x.shape[-1]} > {MAX_HIDDEN}: a row must fit the registers of "
                "one program")
    return None


def _kernel(*refs, n_rows, dim, eps, has_residual):
    # x_ref, res_ref, y_ref, h_ref: [block_rows, block_dim] (rows and columns padded past the
    # array's end, hence the masks); w_ref: [block_dim].
    if has_residual:
        x_ref, res_ref, w_ref, y_ref, h_ref = refs
    else:
        (x_ref, w_ref, y_ref), res_ref, h_ref = refs, None, None
    block_rows, block_dim = x_ref.shape
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(block_dim)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    h = _compat.triton_load(x_ref, mask=mask, other=0)
    if has_residual:
        r = _compat.triton_load(res_ref, mask=mask, other=0)
        # Rounded to x.dtype before normalising, as the reference does: the residual
        # stream carried forward is exactly what was normalised.
        h = (h.astype(jnp.float32) + r.astype(jnp.float32)).astype(h_ref.dtype)
        _compat.triton_store(h_ref, None, h, mask=mask)
    h = h.astype(jnp.float32)
    w = _compat.triton_load(w_ref, mask=cols < dim, other=0).astype(jnp.float32)
    # Padded columns are zeros, so the sum is over the row; divide by the true width.
    inv = jax.lax.rsqrt(jnp.sum(h * h, axis=1, keepdims=True) / dim + eps)
    _compat.triton_store(y_ref, None, (h * inv * w[None, :]).astype(y_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "num_stages",
                                             "interpret"))
def rms_norm_forward(x, weight, residual=None, *, eps, block_rows, num_warps, num_stages,
                     interpret=False):
    """The kernel alone (no VJP): ``y`` or ``(y, h)`` as :func:`forge_jax.rms_norm`.

    Args:
      x: ``[..., dim]`` float32/bfloat16/float16.
      weight: ``[dim]``.
      residual: optional ``[..., dim]`` like ``x``.
      eps: added to the mean square.
      block_rows: rows per program (a power of two).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).
    """
    _compat.filter_triton_deprecation()
    dim = x.shape[-1]
    n_rows = x.size // dim
    has_residual = residual is not None
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * (2 if has_residual else 1)
    if n_rows == 0:
        outs = [jnp.zeros(s.shape, s.dtype) for s in out_shape]
        return tuple(outs) if has_residual else outs[0]
    block_dim = _common.next_pow2(dim)
    row_spec = pl.BlockSpec((block_rows, block_dim), lambda i: (i, 0))
    operands = [x.reshape(n_rows, dim)]
    if has_residual:
        operands.append(residual.reshape(n_rows, dim))
    operands.append(weight)
    out = _common.triton_call(
        functools.partial(_kernel, n_rows=n_rows, dim=dim, eps=eps, has_residual=has_residual),
        grid=(pl.cdiv(n_rows, block_rows),),
        in_specs=[row_spec] * (len(operands) - 1) + [pl.BlockSpec((block_dim,), lambda i: (0,))],
        out_specs=[row_spec] * len(out_shape),
        out_shape=[jax.ShapeDtypeStruct((n_rows, dim), x.dtype)] * len(out_shape),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
        name="forge_jax_rms_norm",
        cost_estimate=_cost.elementwise(n_rows * dim, flops=4 + has_residual,
                                        io=(*operands, *operands[:-1])),
    )(*operands)
    out = [o.reshape(x.shape) for o in out]
    return tuple(out) if has_residual else out[0]


_rms_norm = with_reference_vjp(rms_norm_forward, rms_norm_reference, static=("eps",))


def rms_norm(x, weight, *, eps, residual, block_rows=None, num_warps=None, num_stages=None,
             interpret=False):
    """:func:`forge_jax.rms_norm` through the kernel; differentiable (XLA VJP).

    Args:
      x, weight, eps, residual: as :func:`forge_jax.rms_norm`.
      block_rows, num_warps, num_stages: override the tuning table's entry.
      interpret: run in Pallas' interpreter (any platform).
    """
    config = _common.with_knobs(default_config({"x": x}, _common.device_kind(interpret)),
                                block_rows=block_rows, num_warps=num_warps,
                                num_stages=num_stages)
    return _rms_norm(x, weight, residual, eps=eps, interpret=interpret,
                     **dataclasses.asdict(config))


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults: rows per program up to
    :data:`MAX_HIDDEN` values per program, at 4 and 8 warps."""
    padded = _common.next_pow2(args["x"].shape[-1])
    return [dict(block_rows=r, num_warps=w) for r in (1, 2, 4, 8, 16, 32)
            if r * padded <= MAX_HIDDEN for w in (4, 8)]


_registration.register(
    "rms_norm", rms_norm, backend="gpu", supports=supports, verified=VERIFIED,
    description="one program per block of rows, fused residual add, float32 math",
    configs=configs, interpret_configs=lambda args: [dict(block_rows=2), dict(block_rows=8)])
