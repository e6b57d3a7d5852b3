"""Pallas TPU kernel (Mosaic): the chunked gated delta rule (prefill).

Grid ``(batch, v_heads, chunks)``, the chunks sequential (``"arbitrary"``): the ``[dk, dv]``
float32 state of one (row, value head) lives in VMEM scratch from the first chunk to the
last, and each chunk of ``chunk_size`` tokens is a handful of MXU products, the UT transform
of the DeltaNet papers: with ``L[i, j] = beta_i k_i . k_j exp(cum_i - cum_j)`` (``j < i``),
``(I + L)^-1`` is the Neumann product ``prod (I + (-L)^(2^n))`` (``L`` is nilpotent), which
keeps the inverse on the MXU (a row-by-row substitution would be ``chunk_size`` dependent
vector steps). Then ``u = T (beta v)``, ``w = T (beta k exp(cum))``, ``v' = u - w S``,
``out = (q exp(cum)) S + (q k^T * decay) v'`` and ``S <- exp(cum_last) S + (k
exp(cum_last - cum))^T v'``. The per-token work (norms, scale, padding, the cumulative
decay) is XLA's, in ``forge_jax.pallas_kernels._gated_delta_layout``.

Backward: the reference's VJP (:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`).
Op: :func:`forge_jax.gated_delta_rule`; reference: its XLA implementation
:func:`forge_jax.ops.gated_delta.gated_delta_rule_xla`. Tests:
``tests/test_pallas_gated_delta.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.pallas_kernels import _gated_delta_layout as layout
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and compiled deviceless for TPU v5e only; no TPU has run it).
VERIFIED: dict[str, str] = {}

CHUNK_SIZES = (16, 32, 64, 128)
_HIGHEST = jax.lax.Precision.HIGHEST


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.gated_delta_rule` arguments."""
    q, v, chunk = args["q"], args["v"], args["chunk_size"]
    if q.shape[1] == 1:
        return "one token is a decode step: the recurrence (XLA) serves it"
    if chunk not in CHUNK_SIZES:
        return (f"chunk_size={chunk}; the kernel is built for {CHUNK_SIZES} (multiples of the "
                "sublane tile whose [chunk, chunk] products fit one MXU pass)")
    dk, dv = q.shape[-1], v.shape[-1]
    if dk % _common.LANES or dv % _common.LANES:
        return (f"head dims dk={dk}, dv={dv}: the kernel is built for multiples of "
                f"{_common.LANES} lanes (Qwen3-Next's and Qwen3.5's 128)")
    if dk * dv > 256 * 256:
        return f"a state of dk * dv = {dk} * {dv} values does not fit the kernel's VMEM budget"
    return None


def _dot(a, b, dims=((1,), (0,))):
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=_HIGHEST,
                               preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, cum_ref, cum_row_ref, beta_ref, s0_ref, out_ref, s_out_ref,
            s_ref, *, chunk, levels):
    # q_ref, k_ref: [chunk, dk]; v_ref, out_ref: [chunk, dv]; cum_ref, beta_ref: [chunk, 1];
    # cum_row_ref: [1, chunk]; s0_ref, s_out_ref, s_ref: [dk, dv].
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        s_ref[...] = s0_ref[...]

    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    cum, cum_row, beta = cum_ref[...], cum_row_ref[...], beta_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    # Masked before exp: above the diagonal cum_i - cum_j > 0 may overflow.
    decay = jnp.exp(jnp.where(row >= col, cum - cum_row, -jnp.inf))
    k_beta = k * beta
    nt = ((1,), (1,))
    minus_l = jnp.where(row > col, -_dot(k_beta, k, nt) * decay, 0.0)
    t = minus_l + (row == col).astype(jnp.float32)
    power = minus_l
    for _ in range(levels - 1):
        power = _dot(power, power)
        t = t + _dot(t, power)
    u = _dot(t, v * beta)
    w = _dot(t, k_beta * jnp.exp(cum))
    s = s_ref[...]
    v_new = u - _dot(w, s)
    attn = _dot(q, k, nt) * decay
    out_ref[...] = (_dot(q * jnp.exp(cum), s) + _dot(attn, v_new)).astype(out_ref.dtype)
    last = cum_row[:, chunk - 1:chunk]  # [1, 1]
    s = s * jnp.exp(last) + _dot(k * jnp.exp(last - cum), v_new, ((0,), (0,)))
    s_ref[...] = s

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        s_out_ref[...] = s


@functools.partial(jax.jit, static_argnames=("scale", "qk_l2norm", "chunk_size", "interpret"))
def gated_delta_rule_forward(q, k, v, g, beta, state, lengths, *, scale, qk_l2norm, chunk_size,
                             interpret=False):
    """The kernel alone (no VJP): ``(out, new_state)`` as :func:`forge_jax.gated_delta_rule`.

    Args:
      q, k, v, g, beta, state, lengths, scale, qk_l2norm: as the op.
      chunk_size: tokens per chunk (one grid step), in :data:`CHUNK_SIZES`.
      interpret: run in the TPU interpreter (any platform).
    """
    batch, _, k_heads, dk = q.shape
    v_heads, dv = v.shape[2:]
    c = chunk_size
    (qh, kh, vh, cum, cum_row, bh), valid = layout.head_major(
        q, k, v, g, beta, lengths, scale=scale, qk_l2norm=qk_l2norm, chunk=c)
    s0 = layout.initial_state(state, batch, v_heads, dk, dv)
    tokens = vh.shape[2]
    rep = v_heads // k_heads
    qk_spec = pl.BlockSpec((None, None, c, dk), lambda b, h, i: (b, h // rep, i, 0))
    v_spec = pl.BlockSpec((None, None, c, dv), lambda b, h, i: (b, h, i, 0))
    col_spec = pl.BlockSpec((None, None, c, 1), lambda b, h, i: (b, h, i, 0))
    row_spec = pl.BlockSpec((None, None, None, 1, c), lambda b, h, i: (b, h, i, 0, 0))
    s_spec = pl.BlockSpec((None, None, dk, dv), lambda b, h, i: (b, h, 0, 0))
    flops, transcendentals = layout.cost(qh, vh, chunk=c)
    out, new_state = pl.pallas_call(
        functools.partial(_kernel, chunk=c, levels=layout.levels(c)),
        grid=(batch, v_heads, tokens // c),
        in_specs=[qk_spec, qk_spec, v_spec, col_spec, row_spec, col_spec, s_spec],
        out_specs=[v_spec, s_spec],
        out_shape=[jax.ShapeDtypeStruct(vh.shape, jnp.float32),
                   jax.ShapeDtypeStruct(s0.shape, jnp.float32)],
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_gated_delta_rule",
        cost_estimate=pl.CostEstimate(
            flops=int(flops), transcendentals=int(transcendentals),
            bytes_accessed=int(sum(x.size * 4 for x in (qh, kh, vh, vh, cum, bh, s0, s0)))),
    )(qh, kh, vh, cum, cum_row, bh, s0)
    return layout.finish(out, new_state, valid, v, state)


_gated_delta_rule = with_reference_vjp(gated_delta_rule_forward, layout.reference,
                                       static=("scale", "qk_l2norm", "chunk_size"))


def gated_delta_rule(q, k, v, g, beta, *, state, lengths, scale, qk_l2norm, chunk_size,
                     interpret=False):
    """:func:`forge_jax.gated_delta_rule` through the kernel; differentiable (the XLA
    implementation's VJP)."""
    return _gated_delta_rule(q, k, v, g, beta, state, lengths, scale=scale,
                             qk_l2norm=qk_l2norm, chunk_size=chunk_size, interpret=interpret)


_registration.register(
    "gated_delta_rule", gated_delta_rule, backend="tpu", supports=supports, verified=VERIFIED,
    description="chunked UT transform, state in VMEM across chunks, float32 math")
