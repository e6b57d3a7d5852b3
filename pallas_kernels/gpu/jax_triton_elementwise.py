"""jax-triton kernels: ``"triton"`` implementations of rms_norm (with the fused residual
add), silu_mul and rope.

Plain Triton kernels (``_jax_triton_src.py``) launched through ``jax_triton.triton_call``, the
``gpu`` extra. jax-triton imports only with a GPU jaxlib and pins the Triton release, so it
is imported when a kernel is launched, never at registration; :func:`available` says why
it cannot run here (no GPU, not installed, a release built for another JAX, an import that
fails). Everything around the launch (argument order, output shapes, grid, launch
parameters from the tables below) is plain Python, tested on CPU with the launch
replaced.

* rms_norm: one program per row of ``x`` flattened to ``[rows, dim]``, the row padded to a
  power of two (``BLOCK``) with masked loads; float32 math; writes ``y`` and, with a
  residual, ``h = x + residual``.
* silu_mul: the inputs flattened, ``block_size`` elements per program.
* rope: one program per token and block of heads; the angles ``position * inv_freq`` in
  float32 in the kernel (only the ``[head_dim // 2]`` inverse frequencies, which carry the
  scaling, are read), both pairing conventions.

All three are differentiable through the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), and batch under ``jax.vmap`` by
launching once over the stacked rows (``custom_vmap``; jax-triton has no batching rule of
its own). Not Pallas: the Triton source is written by hand, hence the module's name.

Ops: :func:`forge_jax.ops.norm.rms_norm`, :func:`forge_jax.ops.activation.silu_mul`,
:func:`forge_jax.ops.rope.rope`; references: their XLA implementations
(:func:`~forge_jax.ops.norm.rms_norm_xla`, :func:`~forge_jax.ops.activation.silu_mul_xla`,
:func:`~forge_jax.ops.rope.rope_xla`). Launch knobs, per kernel: :class:`RmsNormConfig`,
:class:`SiluMulConfig`, :class:`RopeConfig`, their tables :data:`RMS_NORM_TUNED`,
:data:`SILU_MUL_TUNED`, :data:`ROPE_TUNED` and ``*_default_config``. Registered (bottom of
this module) as ``"triton"`` on GPU, by name until :data:`VERIFIED` names a GPU. Tests:
``tests/test_jax_triton_elementwise.py``, ``tests/test_gpu_tuning.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat, registry
from forge_jax.ops.activation import silu_mul_xla
from forge_jax.ops.norm import rms_norm_xla
from forge_jax.ops.rope import host_table_reason, inverse_frequencies, rope_xla
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels._vjp import rms_norm_reference, with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

# Where these kernels were compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}
PRIORITY = 5  # below the Pallas kernels, above XLA, once verified
MAX_HIDDEN = 32768  # a row lives in the registers of one program (see rms_norm.py)
MAX_SIZE = 2**31 - 1  # silu_mul's size is passed as an int32 scalar
MAX_HEAD_DIM = 512  # the tuning table's largest rope bucket


def import_reason() -> str | None:
    """``None`` if jax-triton imports here, else the error (e.g. a CPU-only jaxlib)."""
    try:
        importlib.import_module("jax_triton")
    except Exception as e:  # ImportError, or jax-triton's own ValueError on a CPU jaxlib
        return f"jax-triton does not import: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def available() -> str | None:
    """``None`` if the jax-triton kernels can run in this process, else why not: not
    installed, a release for another JAX, no GPU (or one below compute capability 8.0),
    or an import that fails. Versions are checked before anything is imported."""
    return (_compat.jax_triton_reason() or _common.gpu_reason("gpu")
            or _import_reason_once())


@functools.cache
def _import_reason_once() -> str | None:
    return import_reason()


def _float_reason(**arrays) -> str | None:
    for name, a in arrays.items():
        if a is not None and jnp.dtype(a.dtype) not in _common.FLOAT_DTYPES:
            return f"{name}.dtype={jnp.dtype(a.dtype).name}; the kernel reads float32/bf16/f16"
    return None


def rms_norm_supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rms_norm` arguments."""
    x = args["x"]
    reason = _float_reason(x=x, weight=args["weight"], residual=args["residual"])
    if reason:
        return reason
    if x.shape[-1] > MAX_HIDDEN:
        return (f"hidden size {x.shape[-1]} > {MAX_HIDDEN}: a row must fit the registers of "
                "one program")
    return None


def silu_mul_supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.silu_mul` arguments."""
    gate = args["gate"]
    reason = _float_reason(gate=gate)
    if reason:
        return reason
    if gate.size > MAX_SIZE:
        return f"{gate.size=} > {MAX_SIZE}: the kernel's size argument is int32"
    return None


def rope_supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rope` arguments."""
    x = args["x"]
    table = host_table_reason(args.get("scaling"))
    if table:
        return table
    reason = _float_reason(x=x)
    if reason:
        return reason
    if x.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {x.shape[-1]} > {MAX_HEAD_DIM}, beyond the launch table"
    if x.shape[0] * x.shape[1] > MAX_SIZE:
        return f"{x.shape[0] * x.shape[1]} tokens > {MAX_SIZE}: the grid is int32"
    return None


# --- launch knobs: per kernel, a Config, its table of defaults and default_config ---------


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
    """The rms_norm kernel's launch knob (one program per row, the row padded to a power of
    two): warps."""

    num_warps: int


@dataclasses.dataclass(frozen=True)
class SiluMulConfig:
    """The silu_mul kernel's launch knobs: elements per program and warps."""

    block_size: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """The rope kernel's launch knobs: heads per program (one token each) and warps."""

    block_heads: int
    num_warps: int


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind).
# Bucketed by the padded row (rms_norm) and head dim (rope): the smallest bucket >= the
# call's. Not measured yet (no GPU has run the kernels): the ranges of Triton's tutorials.
RMS_NORM_TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        1024: dict(num_warps=4),
        4096: dict(num_warps=8),
        32768: dict(num_warps=16),
    },
}
SILU_MUL_TUNED: Mapping[str, Mapping[str, int]] = {
    "default": dict(block_size=4096, num_warps=8),
}
ROPE_TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        64: dict(block_heads=16, num_warps=2),
        128: dict(block_heads=16, num_warps=4),
        256: dict(block_heads=8, num_warps=4),
        512: dict(block_heads=4, num_warps=4),
    },
}


def rms_norm_default_config(args: Mapping[str, Any],
                            device_kind: str | None = None) -> RmsNormConfig:
    """The knobs for ``args["x"]`` (anything with a shape) from :data:`RMS_NORM_TUNED`."""
    return RmsNormConfig(**_common.tuned(RMS_NORM_TUNED, device_kind,
                                         _common.next_pow2(args["x"].shape[-1])))


def silu_mul_default_config(args: Mapping[str, Any],
                            device_kind: str | None = None) -> SiluMulConfig:
    """The knobs from :data:`SILU_MUL_TUNED` (the same for any arguments)."""
    del args
    return SiluMulConfig(**_common.tuned(SILU_MUL_TUNED, device_kind))


def rope_default_config(args: Mapping[str, Any], device_kind: str | None = None) -> RopeConfig:
    """The knobs for ``args["x"]`` (``[batch, seq, heads, head_dim]``) from
    :data:`ROPE_TUNED`, at most the (padded) head count per program."""
    _, _, heads, head_dim = args["x"].shape
    config = RopeConfig(**_common.tuned(ROPE_TUNED, device_kind, _common.next_pow2(head_dim)))
    return dataclasses.replace(config,
                               block_heads=min(config.block_heads, _common.next_pow2(heads)))


# --- launch plans --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``triton_call``: the kernel's name in ``_jax_triton_src``, the grid, the scalar
    arguments after the arrays, the outputs, and the launch and meta-parameters."""

    kernel: str
    grid: tuple[int, ...]
    scalars: tuple[Any, ...]
    out: tuple[jax.ShapeDtypeStruct, ...]
    num_warps: int
    num_stages: int
    meta: Mapping[str, int]


def rms_norm_launch(shape: Sequence[int], dtype: Any, *, eps: float, residual: bool,
                    device_kind: str | None = None, num_warps: int | None = None) -> Launch:
    """The launch of the rms_norm kernel for ``x`` of ``shape`` (rows flattened)."""
    dim = shape[-1]
    rows = math.prod(shape[:-1])
    config = rms_norm_default_config({"x": jax.ShapeDtypeStruct(tuple(shape), dtype)},
                                     device_kind)
    out = jax.ShapeDtypeStruct((rows, dim), dtype)
    return Launch("add_rms_norm_kernel" if residual else "rms_norm_kernel", (rows,),
                  (dim, float(eps)), (out, out) if residual else (out,),
                  num_warps or config.num_warps, 1, {"BLOCK": _common.next_pow2(dim)})


def silu_mul_launch(size: int, dtype: Any, *, device_kind: str | None = None,
                    block_size: int | None = None, num_warps: int | None = None) -> Launch:
    """The launch of the silu_mul kernel over ``size`` elements."""
    config = silu_mul_default_config({}, device_kind)
    block = block_size or config.block_size
    if block < 1 or block & (block - 1):
        raise ValueError(f"block_size={block} must be a power of two (a Triton block)")
    return Launch("silu_mul_kernel", (-(-size // block),), (size,),
                  (jax.ShapeDtypeStruct((size,), dtype),), num_warps or config.num_warps, 1,
                  {"BLOCK": block})


def rope_launch(shape: Sequence[int], dtype: Any, *, interleaved: bool,
                device_kind: str | None = None, block_heads: int | None = None,
                num_warps: int | None = None) -> Launch:
    """The launch of the rope kernel for ``x`` of ``shape`` ``[batch, seq, heads, head_dim]``."""
    batch, seq, heads, head_dim = shape
    config = rope_default_config({"x": jax.ShapeDtypeStruct(tuple(shape), dtype)}, device_kind)
    block = block_heads or config.block_heads
    if block < 1 or block & (block - 1):
        raise ValueError(f"block_heads={block} must be a power of two (a Triton block)")
    return Launch("rope_kernel", (batch * seq, -(-heads // block)), (heads, head_dim),
                  (jax.ShapeDtypeStruct((batch * seq, heads, head_dim), dtype),),
                  num_warps or config.num_warps, 1,
                  {"BLOCK_HEADS": block, "HALF": _common.next_pow2(head_dim // 2),
                   "INTERLEAVED": bool(interleaved)})


def _launch(launch: Launch, *arrays: jax.Array) -> Any:
    """Runs ``launch`` on ``arrays`` through jax-triton (replaced in the CPU tests)."""
    src = importlib.import_module("forge_jax.pallas_kernels.gpu._jax_triton_src")
    return _compat.triton_call(
        *arrays, *launch.scalars, kernel=getattr(src, launch.kernel),
        out=launch.out if len(launch.out) > 1 else launch.out[0], grid=launch.grid,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        name=f"forge_jax_triton_{launch.kernel}", **launch.meta)


def _device_kind() -> str | None:
    return _common.device_kind(False)


# --- rms_norm ------------------------------------------------------------------------------


def rms_norm_forward(x, weight, residual=None, *, eps, num_warps=None):
    """The kernel alone: ``y`` or ``(y, h)`` as :func:`forge_jax.rms_norm`."""
    has_residual = residual is not None
    if x.size == 0:
        outs = [jnp.zeros(x.shape, x.dtype)] * (2 if has_residual else 1)
        return tuple(outs) if has_residual else outs[0]
    launch = rms_norm_launch(x.shape, x.dtype, eps=eps, residual=has_residual,
                             device_kind=_device_kind(), num_warps=num_warps)
    rows, dim = launch.out[0].shape
    arrays = [x.reshape(rows, dim)] + ([residual.reshape(rows, dim)] if has_residual else [])
    out = _launch(launch, *arrays, weight)
    out = [o.reshape(x.shape) for o in (out if has_residual else [out])]
    return tuple(out) if has_residual else out[0]


def _batched_rows(forward: Callable[..., Any], xla: Callable[..., Any]):
    """``forward(x, weight, residual_or_None)`` with a vmap rule: batched rows are more rows
    of one launch; a batched weight (per-example weights) goes to ``xla``."""

    @jax.custom_batching.custom_vmap
    def fn(x, weight, residual):
        return forward(x, weight, residual)

    @fn.def_vmap
    def rule(axis_size, in_batched, x, weight, residual):
        x_b, w_b, r_b = in_batched
        if w_b:
            out = jax.vmap(xla, in_axes=(0 if x_b else None, 0, 0 if r_b else None))(
                x, weight, residual)
        else:
            if not x_b:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            if residual is not None and not r_b:
                residual = jnp.broadcast_to(residual, (axis_size, *residual.shape))
            out = fn(x, weight, residual)
        return out, jax.tree.map(lambda _: True, out)

    return fn


def _rms_norm_batched(x, weight, residual, *, eps, num_warps):
    fwd = _batched_rows(
        lambda x, w, r: rms_norm_forward(x, w, r, eps=eps, num_warps=num_warps),
        lambda x, w, r: rms_norm_xla(x, w, eps=eps, residual=r))
    return fwd(x, weight, residual)


_rms_norm = with_reference_vjp(_rms_norm_batched, rms_norm_reference, static=("eps",))


def rms_norm(x, weight, *, eps, residual, num_warps=None):
    """:func:`forge_jax.rms_norm` through the jax-triton kernel; differentiable (XLA VJP).

    Args:
      x, weight, eps, residual: as :func:`forge_jax.rms_norm` (``x`` ``[..., dim]``).
      num_warps: override the tuning table's entry.
    """
    with jax.named_scope("triton_rms_norm"):
        return _rms_norm(x, weight, residual, eps=eps, num_warps=num_warps)


# --- silu_mul ------------------------------------------------------------------------------


def silu_mul_forward(gate, up, *, block_size=None, num_warps=None):
    """The kernel alone: ``silu(gate) * up``."""
    if gate.size == 0:
        return jnp.zeros(gate.shape, gate.dtype)
    launch = silu_mul_launch(gate.size, gate.dtype, device_kind=_device_kind(),
                             block_size=block_size, num_warps=num_warps)
    return _launch(launch, gate.reshape(-1), up.reshape(-1)).reshape(gate.shape)


def _silu_mul_batched(gate, up, *, block_size, num_warps):
    @jax.custom_batching.custom_vmap
    def fwd(gate, up):
        return silu_mul_forward(gate, up, block_size=block_size, num_warps=num_warps)

    @fwd.def_vmap
    def rule(axis_size, in_batched, gate, up):
        gate, up = (a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                    for a, b in zip((gate, up), in_batched, strict=True))
        return fwd(gate, up), True

    return fwd(gate, up)


_silu_mul = with_reference_vjp(_silu_mul_batched, silu_mul_xla)


def silu_mul(gate, up, *, block_size=None, num_warps=None):
    """:func:`forge_jax.silu_mul` through the jax-triton kernel; differentiable (XLA VJP).

    Args:
      gate, up: as :func:`forge_jax.silu_mul`.
      block_size, num_warps: override the tuning table's entry.
    """
    with jax.named_scope("triton_silu_mul"):
        return _silu_mul(gate, up, block_size=block_size, num_warps=num_warps)


# --- rope ----------------------------------------------------------------------------------


def rope_forward(x, positions, *, theta, scaling, interleaved, block_heads=None,
                 num_warps=None):
    """The kernel alone: :func:`forge_jax.rope` of ``x [batch, seq, heads, head_dim]``."""
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    launch = rope_launch(x.shape, x.dtype, interleaved=interleaved, device_kind=_device_kind(),
                         block_heads=block_heads, num_warps=num_warps)
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1], theta, scaling))
    tokens, heads, head_dim = launch.out[0].shape
    out = _launch(launch, x.reshape(tokens, heads, head_dim),
                  positions.reshape(tokens).astype(jnp.int32), inv_freq)
    return out.reshape(x.shape)


def _rope_batched(x, positions, *, theta, scaling, interleaved, block_heads, num_warps):
    @jax.custom_batching.custom_vmap
    def fwd(x, positions):
        return rope_forward(x, positions, theta=theta, scaling=scaling, interleaved=interleaved,
                            block_heads=block_heads, num_warps=num_warps)

    @fwd.def_vmap
    def rule(axis_size, in_batched, x, positions):
        # Batched sequences are more sequences of one launch.
        x = x if in_batched[0] else jnp.broadcast_to(x, (axis_size, *x.shape))
        if not in_batched[1]:
            positions = jnp.broadcast_to(positions, (axis_size, *positions.shape))
        out = fwd(x.reshape(-1, *x.shape[2:]), positions.reshape(-1, positions.shape[-1]))
        return out.reshape(x.shape), True

    return fwd(x, positions)


_rope = with_reference_vjp(_rope_batched, rope_xla, static=("theta", "scaling", "interleaved"))


def rope(x, positions, *, theta, scaling, interleaved, block_heads=None, num_warps=None):
    """:func:`forge_jax.rope` through the jax-triton kernel; differentiable in ``x`` (XLA VJP).

    Args:
      x, positions, theta, scaling, interleaved: as :func:`forge_jax.rope`.
      block_heads, num_warps: override the tuning table's entry.
    """
    with jax.named_scope("triton_rope"):
        return _rope(x, positions, theta=theta, scaling=scaling, interleaved=interleaved,
                     block_heads=block_heads, num_warps=num_warps)


# --- registration --------------------------------------------------------------------------


def _register(op: str, fn: Callable[..., Any], supports, description: str,
              configs: registry.ConfigsFn) -> None:
    _registration.add(registry.Implementation(
        op=op, name="triton", fn=fn, platforms=frozenset({"gpu"}), priority={"gpu": PRIORITY},
        verified=VERIFIED,
        supports=lambda args, platform: (_common.gpu_reason(platform) or available()
                                         or supports(args)),
        available=available, description=f"{description} (jax-triton)", configs=configs))


_register("rms_norm", rms_norm, rms_norm_supports,
          "one program per row, fused residual add, float32 math",
          lambda args: [dict(num_warps=w) for w in (1, 2, 4, 8, 16)])
_register("silu_mul", silu_mul, silu_mul_supports, "flattened blocks, float32 math",
          lambda args: [dict(block_size=b, num_warps=w) for b in (1024, 2048, 4096, 8192)
                        for w in (4, 8)])
_register("rope", rope, rope_supports, "one program per token and block of heads, float32 "
          "angles", lambda args: [dict(block_heads=h, num_warps=w) for h in (1, 2, 4, 8, 16)
                                  for w in (2, 4)])
