"""Pallas GPU kernel (Triton lowering): the chunked gated delta rule (prefill).

Grid ``(batch, v_heads, dv // block_v)``: the delta rule is separable in the value columns
(column ``j`` of the state reads and writes only column ``j`` of the values), so each program
owns a ``[dk, block_v]`` slice of one (row, value head)'s float32 state in registers and
walks the chunks in a loop. A chunk is the UT transform of the TPU kernel
(:mod:`forge_jax.pallas_kernels.tpu.gated_delta`, which explains the algebra): the inverse
of ``I + L`` as a Neumann product of ``[chunk, chunk]`` dots, then five products with the
state. float32 dots are IEEE (``Precision.HIGHEST``; Triton's float32 default is TF32,
whose 10-bit mantissa the Neumann squarings would amplify). Mosaic GPU would suit Hopper's
WGMMA for 64-row chunks; this first kernel is Triton, which runs on compute capability 8.0
and up.

Backward: the reference's VJP (:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`).
Op: :func:`forge_jax.gated_delta_rule`; reference: its XLA implementation
:func:`forge_jax.ops.gated_delta.gated_delta_rule_xla`. Tests:
``tests/test_pallas_gated_delta.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _gated_delta_layout as layout
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in Pallas' interpreter and compiled deviceless for H100 only; no GPU has run it).
VERIFIED: dict[str, str] = {}

# 64-token chunks compile for H100 but spill 69 KiB per thread (ptxas, deviceless, JAX 0.10.2,
# 2026-11-28; 18 KiB at 32, 6.5 KiB at 16) and take two minutes to compile: refused.
CHUNK_SIZES = (16, 32)
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch knobs: value columns per program, and Triton's warps."""

    block_v: int = 64
    num_warps: int = 8


# Untuned: no GPU has run the kernel. One row serves every device kind and the interpreter.
TUNED: Mapping[str, Mapping[str, int]] = {"default": dict(block_v=64, num_warps=8)}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.gated_delta_rule` arguments."""
    q, v, chunk = args["q"], args["v"], args["chunk_size"]
    if q.shape[1] == 1:
        return "one token is a decode step: the recurrence (XLA) serves it"
    if chunk not in CHUNK_SIZES:
        return (f"chunk_size={chunk}; the kernel is built for {CHUNK_SIZES} (at 64 its "
                "[chunk, chunk] products spill 69 KiB per thread on H100: pass chunk_size=32)")
    dk, dv = q.shape[-1], v.shape[-1]
    for name, n in (("dk", dk), ("dv", dv)):
        if n < _common.MIN_DOT or n & (n - 1) or n > 256:
            return (f"{name}={n}: the kernel is built for power-of-two head dims in [16, 256] "
                    "(whole Triton dots)")
    return None


def _dot(a, b, dims=((1,), (0,))):
    return lax.dot_general(a, b, (dims, ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, cum_ref, beta_ref, s0_ref, out_ref, s_out_ref, *, chunk,
            levels):
    # q_ref, k_ref: [tokens, dk]; v_ref, out_ref: [tokens, block_v]; cum_ref, beta_ref:
    # [tokens]; s0_ref, s_out_ref: [dk, block_v].
    tokens = cum_ref.shape[0]
    idx = jnp.arange(chunk, dtype=jnp.int32)
    row, col = idx[:, None], idx[None, :]
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    nt = ((1,), (1,))

    def body(i, s):
        rows = pl.ds(i * chunk, chunk)
        q = _compat.triton_load(q_ref, (rows, slice(None)))
        k = _compat.triton_load(k_ref, (rows, slice(None)))
        v = _compat.triton_load(v_ref, (rows, slice(None)))
        cum = _compat.triton_load(cum_ref, (rows,))
        beta = _compat.triton_load(beta_ref, (rows,))
        # Masked before exp: above the diagonal cum_i - cum_j > 0 may overflow.
        decay = jnp.exp(jnp.where(row >= col, cum[:, None] - cum[None, :], -jnp.inf))
        k_beta = k * beta[:, None]
        minus_l = jnp.where(row > col, -_dot(k_beta, k, nt) * decay, 0.0)
        t = minus_l + eye
        power = minus_l
        for _ in range(levels - 1):
            power = _dot(power, power)
            t = t + _dot(t, power)
        u = _dot(t, v * beta[:, None])
        w = _dot(t, k_beta * jnp.exp(cum)[:, None])
        v_new = u - _dot(w, s)
        attn = _dot(q, k, nt) * decay
        out = _dot(q * jnp.exp(cum)[:, None], s) + _dot(attn, v_new)
        _compat.triton_store(out_ref, (rows, slice(None)), out.astype(out_ref.dtype))
        last = jnp.max(jnp.where(idx == chunk - 1, cum, -jnp.inf))
        return s * jnp.exp(last) + _dot(k * jnp.exp(last - cum)[:, None], v_new, ((0,), (0,)))

    s = lax.fori_loop(0, tokens // chunk, body, s0_ref[...])
    s_out_ref[...] = s


@functools.partial(jax.jit, static_argnames=(
    "scale", "qk_l2norm", "chunk_size", "block_v", "num_warps", "interpret"))
def gated_delta_rule_forward(q, k, v, g, beta, state, lengths, *, scale, qk_l2norm, chunk_size,
                             block_v, num_warps, interpret=False):
    """The kernel alone (no VJP): ``(out, new_state)`` as :func:`forge_jax.gated_delta_rule`.

    Args:
      q, k, v, g, beta, state, lengths, scale, qk_l2norm: as the op.
      chunk_size: tokens per chunk, in :data:`CHUNK_SIZES`.
      block_v: value columns per program, a power of two >= 16 dividing ``dv``.
      num_warps: Triton's warps per program.
      interpret: run in Pallas' interpreter (any platform).
    """
    _compat.filter_triton_deprecation()
    batch, _, k_heads, dk = q.shape
    v_heads, dv = v.shape[2:]
    c = chunk_size
    block_v = min(block_v, dv)
    (qh, kh, vh, cum, _, bh), valid = layout.head_major(
        q, k, v, g, beta, lengths, scale=scale, qk_l2norm=qk_l2norm, chunk=c)
    cum, bh = cum[..., 0], bh[..., 0]  # [batch, v_heads, tokens]
    s0 = layout.initial_state(state, batch, v_heads, dk, dv)
    tokens = vh.shape[2]
    rep = v_heads // k_heads
    qk_spec = pl.BlockSpec((None, None, tokens, dk), lambda b, h, j: (b, h // rep, 0, 0))
    v_spec = pl.BlockSpec((None, None, tokens, block_v), lambda b, h, j: (b, h, 0, j))
    tok_spec = pl.BlockSpec((None, None, tokens), lambda b, h, j: (b, h, 0))
    s_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, h, j: (b, h, 0, j))
    flops, transcendentals = layout.cost(qh, vh, chunk=c)
    out, new_state = pl.pallas_call(
        functools.partial(_kernel, chunk=c, levels=layout.levels(c)),
        grid=(batch, v_heads, dv // block_v),
        in_specs=[qk_spec, qk_spec, v_spec, tok_spec, tok_spec, s_spec],
        out_specs=[v_spec, s_spec],
        out_shape=[jax.ShapeDtypeStruct(vh.shape, jnp.float32),
                   jax.ShapeDtypeStruct(s0.shape, jnp.float32)],
        compiler_params=_compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="forge_jax_gpu_gated_delta_rule",
        cost_estimate=pl.CostEstimate(
            flops=int(flops), transcendentals=int(transcendentals),
            bytes_accessed=int(sum(x.size * 4 for x in (qh, kh, vh, vh, cum, bh, s0, s0)))),
    )(qh, kh, vh, cum, bh, s0)
    return layout.finish(out, new_state, valid, v, state)


_gated_delta_rule = with_reference_vjp(gated_delta_rule_forward, layout.reference,
                                       static=("scale", "qk_l2norm", "chunk_size"))


def gated_delta_rule(q, k, v, g, beta, *, state, lengths, scale, qk_l2norm, chunk_size,
                     block_v=None, num_warps=None, interpret=False):
    """:func:`forge_jax.gated_delta_rule` through the kernel; differentiable (the XLA
    implementation's VJP). ``block_v``, ``num_warps`` override :data:`TUNED`."""
    config = _common.with_knobs(default_config({}, _common.device_kind(interpret)),
                                block_v=block_v, num_warps=num_warps)
    return _gated_delta_rule(q, k, v, g, beta, state, lengths, scale=scale,
                             qk_l2norm=qk_l2norm, chunk_size=chunk_size,
                             block_v=config.block_v, num_warps=config.num_warps,
                             interpret=interpret)


_registration.register(
    "gated_delta_rule", gated_delta_rule, backend="gpu", supports=supports, verified=VERIFIED,
    description="chunked UT transform, a state slice per program, float32 IEEE dots")
