"""Pallas TPU kernel (Mosaic): flash attention forward, backward by the XLA reference's VJP.

Grid ``(batch, q_heads, q_blocks, kv_blocks)``, the last one sequential: each program
multiplies one ``[block_q, head_dim]`` query block of one head with one
``[block_k, head_dim]`` K/V block of its kv head, carrying the online softmax (running
max ``m``, sum ``l`` and the float32 accumulator) in VMEM scratch across the kv blocks, as
in JAX's own ``pallas/ops/tpu/flash_attention.py``. Q, K, V and the output are read and
written in their ``[batch, seq, heads, head_dim]`` layout, viewed as ``[batch, seq,
heads * head_dim]`` (a free reshape): a block is one head's ``head_dim`` lanes, and the K/V
index map sends query head ``h`` to kv head ``h // group`` (GQA/MQA with no copy or repeat
of K/V). The price of that layout: each K/V block is copied into VMEM once per query head
(``group`` times per kv head), and a decode program is a one-row dot; serving a whole
group per program would need the group's queries folded into rows (a transpose of Q).

Block skipping: the keys any query of a block may see lie in ``[lo, hi)`` (from the
block's smallest and largest positions, the sequence length and the window), computed in
XLA and scalar-prefetched into SMEM. A kv block outside that range is not computed
(``pl.when``), and its index map points at a block inside the range, so the pipeline does
not copy it either.

The contract is that of :func:`forge_jax.attention` (see :mod:`forge_jax.ops.attention`):
positions are explicit ``q_positions``, else ``kv_lengths[b] - q_len + t`` with
``kv_lengths``, else ``kv_len - q_len + t``. Hidden keys are masked by ``where`` on the
logits (never a bias: hidden slots may hold NaN/inf), a ``+inf`` logit becomes NaN, and
since a zero probability does not hide a NaN value (``0 * NaN = NaN``), non-finite values
leave the ``p @ v`` product; a block that holds one (rare, hence a ``lax.cond``) marks NaN
the output columns of exactly the queries that see it. A query that sees no key gets zeros.

Backward: :func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`, the VJP of the XLA reference
(:func:`forge_jax.ops.attention.attention_reference`, which materialises the
``[batch, heads, q_len, kv_len]`` probabilities) with the same explicit positions and
lengths: no Pallas backward kernel has been written, so gradients cost what XLA's do.

Mosaic constraints (checked by :func:`supports`): a block's last dimension is ``head_dim``
lanes of a ``heads * head_dim`` row, which Mosaic tiles only when ``head_dim`` is a
multiple of 128; ``block_q`` (sublanes of Q) is a multiple of the sublane tile (8 rows for
float32, 16 for bfloat16) or all of ``q_len``, ``block_k`` a multiple of 128 (lanes of
the logits) or all of ``kv_len``; sequences that are not a multiple of the block end in a
partial block (its rows past the end are garbage, masked by the length, never written).
TPUs have no float16 vector unit.

Op: :func:`forge_jax.ops.attention.attention`; reference: its XLA implementation
:func:`forge_jax.ops.attention.attention_xla`. Launch knobs: :class:`Config`, the per-device
table :data:`TUNED`, :func:`default_config`. Registered (bottom of this module) as
``"pallas"`` on TPU, by name until :data:`VERIFIED` names a TPU, and
``"pallas_tpu_interpret"``. Tests: ``tests/test_pallas_tpu_attention.py``.
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
from forge_jax.pallas_kernels import _attention_common, _cost, _registration
from forge_jax.pallas_kernels._attention_common import POS_LIMIT
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: query rows and keys per program step (the wrapper clips
    them to ``q_len`` and ``kv_len``, :func:`block_sizes`)."""

    block_q: int
    block_k: int


# The defaults per TPU generation (``jax.Device.device_kind``, :data:`_common.GENERATIONS`;
# "default" serves any other kind and the interpreter), sized against each generation's
# default scoped VMEM (:data:`_common.SCOPED_VMEM_MIB`: 16 MiB on v4/v5e, 32 MiB on v5p/v6e;
# v6e's faster MXU takes bigger blocks). Untuned, pending measurements on TPU hardware.
TUNED: Mapping[str, Mapping[str, int]] = {
    "TPU v4": dict(block_q=256, block_k=512),
    "TPU v5 lite": dict(block_q=256, block_k=512),
    "TPU v5": dict(block_q=512, block_k=512),
    "TPU v5p": dict(block_q=512, block_k=512),
    "TPU v6 lite": dict(block_q=512, block_k=1024),
    "default": dict(block_q=128, block_k=128),
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tuned blocks on ``device_kind`` (the same for any arguments), before
    :func:`block_sizes` clips them to a call's sequences."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def block_sizes(q_len: int, kv_len: int, dtype, *, block_q: int | None = None,
                block_k: int | None = None, device_kind: str | None = None) -> tuple[int, int]:
    """``(block_q, block_k)``: the knobs, else :data:`TUNED`, clipped to the sequences.

    Raises ``ValueError`` for a block Mosaic cannot tile.
    """
    config = default_config({}, device_kind)
    block_q = min(block_q or config.block_q, q_len)
    block_k = min(block_k or config.block_k, kv_len)
    tile = _common.sublane_tile(dtype)
    if block_q != q_len and block_q % tile:
        raise ValueError(f"{block_q=} must be a multiple of {tile} (the sublane tile of "
                         f"{jnp.dtype(dtype).name}) or q_len={q_len}")
    if block_k != kv_len and block_k % _common.LANES:
        raise ValueError(
            f"{block_k=} must be a multiple of {_common.LANES} lanes or kv_len={kv_len}")
    return block_q, block_k


def _precision(dtype):
    # float32 operands as IEEE products (TPUs default to bfloat16 passes for them);
    # bfloat16 products are exact in float32 anyway.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _kernel(len_ref, lo_ref, hi_ref,  # scalar prefetch (SMEM)
            q_ref, k_ref, v_ref, pos_ref,  # inputs
            o_ref,  # output
            m_ref, l_ref, acc_ref,  # scratch
            *, scale, causal, sliding_window, logits_soft_cap, num_q_blocks):
    # len_ref [batch]; lo_ref, hi_ref [batch * q_blocks]: the keys any query of the block may
    # see lie in [lo, hi). q_ref, o_ref [block_q, head_dim]; k_ref, v_ref [block_k, head_dim];
    # pos_ref [block_q, 1]; m_ref, l_ref [block_q, _common.LANES] (lane-replicated); acc_ref
    # [block_q, head_dim] float32.
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_k = k_ref.shape[0]
    lo, hi = lo_ref[b * num_q_blocks + i], hi_ref[b * num_q_blocks + i]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((j * block_k < hi) & ((j + 1) * block_k > lo))
    def _():
        q, k = q_ref[...], k_ref[...]
        if q.dtype != k.dtype:  # mixed float32/bfloat16: the dot runs in float32
            q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                            preferred_element_type=jnp.float32) * scale  # [block_q, block_k]
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        s = jnp.where(s == jnp.inf, jnp.nan, s)  # a +inf logit is NaN data, not a winner
        col = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        pos = pos_ref[...]  # [block_q, 1]
        # len_ref[b] <= kv_len, so the garbage rows of a partial last block are hidden too.
        visible = col < len_ref[b]
        if causal:
            visible &= col <= pos
        if sliding_window is not None:
            visible &= col > pos - sliding_window
        s = jnp.where(visible, s, -jnp.inf)  # where, not a bias: hidden keys may be NaN
        m_prev, l_prev = m_ref[...][:, :1], l_ref[...][:, :1]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing
        p = jnp.exp(s - m_safe)
        correction = jnp.exp(m_prev - m_safe)
        l_next = correction * l_prev + p.sum(axis=1, keepdims=True)

        v = v_ref[...]
        v32 = v.astype(jnp.float32)
        nonfinite = (jnp.abs(v32) == jnp.inf) | (v32 != v32)
        v = jnp.where(nonfinite, 0.0, v32).astype(v.dtype)
        # Probabilities meet the values in the values' dtype (flash-attention practice).
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_precision(v.dtype), preferred_element_type=jnp.float32)
        acc = correction * acc_ref[...] + pv

        def mark_nonfinite(acc):
            hits = lax.dot_general(jnp.where(visible, 1.0, 0.0), jnp.where(nonfinite, 1.0, 0.0),
                                   (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [block_q, head_dim]
            return jnp.where(hits > 0, jnp.nan, acc)

        any_nonfinite = jnp.max(jnp.where(nonfinite, 1.0, 0.0)) > 0
        acc_ref[...] = lax.cond(any_nonfinite, mark_nonfinite, lambda acc: acc, acc)
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_next, l_ref.shape)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        # A query that saw no key has l == 0 and acc == 0 (or NaN it must show).
        l_sum = l_ref[...][:, :1]
        o_ref[...] = (acc_ref[...] / jnp.where(l_sum == 0, 1.0, l_sum)).astype(o_ref.dtype)


def _forward(q, k, v, positions, lengths, *, scale, causal, sliding_window, logits_soft_cap,
             block_q, block_k, interpret):
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    num_q_blocks, num_k_blocks = pl.cdiv(q_len, block_q), pl.cdiv(kv_len, block_k)

    # [lo, hi): the keys any query of each (sequence, query block) may see.
    pad = num_q_blocks * block_q - q_len
    pos_hi = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-POS_LIMIT)
    pos_lo = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=POS_LIMIT)
    hi = jnp.broadcast_to(lengths[:, None], (batch, num_q_blocks))
    if causal:
        hi = jnp.minimum(hi, pos_hi.reshape(batch, num_q_blocks, block_q).max(-1) + 1)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        lo = jnp.maximum(
            lo, pos_lo.reshape(batch, num_q_blocks, block_q).min(-1) - sliding_window + 1)
    hi = jnp.maximum(hi, 0)
    lo = jnp.minimum(lo, hi)

    def kv_index(b, h, i, j, len_ref, lo_ref, hi_ref):
        # Blocks outside [lo, hi) are not computed: point them at one that is (or block 0
        # when none is), so the pipeline copies nothing new for them.
        del len_ref
        first = lax.div(lo_ref[b * num_q_blocks + i], block_k)
        last = lax.div(hi_ref[b * num_q_blocks + i] + block_k - 1, block_k) - 1
        block = jnp.maximum(jnp.minimum(j, last), jnp.minimum(first, last))
        # lax.div, not //: the floor of a signed quotient lowers through sign.
        return b, jnp.maximum(block, 0), lax.div(h, group)

    def q_index(b, h, i, j, *_):
        return b, i, h

    kernel = functools.partial(
        _kernel, scale=scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, num_q_blocks=num_q_blocks)
    q_spec = pl.BlockSpec((None, block_q, head_dim), q_index)
    kv_spec = pl.BlockSpec((None, block_k, head_dim), kv_index)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, q_heads, num_q_blocks, num_k_blocks),
            in_specs=[
                q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, *_: (b, i, 0)),
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((block_q, _common.LANES), jnp.float32),
                pltpu.VMEM((block_q, _common.LANES), jnp.float32),
                pltpu.VMEM((block_q, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, q_len, q_heads * head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_flash_attention",
        cost_estimate=_cost.attention(queries=batch * q_len * q_heads, keys=k.shape[1],
                                      head_dim=head_dim, causal=causal and q_len == k.shape[1],
                                      io=(q, k, v, q)),
    )(lengths, lo.reshape(-1), hi.reshape(-1),
      q.reshape(batch, q_len, q_heads * head_dim),
      k.reshape(batch, kv_len, kv_heads * head_dim),
      v.reshape(batch, kv_len, kv_heads * head_dim),
      positions[:, :, None])
    return out.reshape(q.shape)


# The contract's positions and lengths around _forward; backward: the XLA reference's VJP.
_attention = _attention_common.flash_attention_call(_forward)


@functools.partial(jax.jit, static_argnames=(
    "scale", "causal", "sliding_window", "logits_soft_cap", "block_q", "block_k", "interpret"))
def flash_attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, block_q=None, block_k=None,
                    interpret=False):
    """Flash attention on TPU (see :func:`forge_jax.attention` for the contract).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``, float32/bfloat16, ``head_dim`` a multiple
        of 128.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, float32/bfloat16 (mixed with ``q``:
        that dot runs in float32), ``q_heads % kv_heads == 0``.
      scale, causal, q_positions, kv_lengths, sliding_window, logits_soft_cap: as in the op.
      block_q: queries per program, a multiple of the sublane tile (8 for float32, 16 for
        bfloat16); clipped to ``q_len``. Default from :data:`TUNED`.
      block_k: keys per step, a multiple of 128; clipped to ``kv_len``. Default from
        :data:`TUNED`.
      interpret: run in the TPU interpreter (any platform).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; differentiable in q, k, v (the
      backward pass is the XLA reference's VJP).
    """
    q_len, kv_len = q.shape[1], k.shape[1]
    if q.size == 0 or kv_len == 0:  # nothing to launch; a query with no keys gets zeros
        return jnp.zeros(q.shape, q.dtype)
    block_q, block_k = block_sizes(q_len, kv_len, q.dtype, block_q=block_q, block_k=block_k,
                                   device_kind=_common.device_kind(interpret))
    return _attention(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                      kv_lengths=kv_lengths, sliding_window=sliding_window,
                      logits_soft_cap=logits_soft_cap, block_q=block_q, block_k=block_k,
                      interpret=interpret)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these :func:`forge_jax.attention` arguments, else
    why not."""
    q = args["q"]
    for name in ("q", "k", "v"):
        dtype = jnp.dtype(args[name].dtype)
        if dtype not in _common.FLOAT_DTYPES:
            return (f"{name}.dtype={dtype.name}: the kernel reads float32/bfloat16 "
                    "(TPUs have no float16 vector unit)")
    head_dim = q.shape[-1]
    if head_dim % _common.LANES:
        return (f"head_dim={head_dim} is not a multiple of {_common.LANES}: a block is one head's "
                "lanes of a [seq, heads * head_dim] row, which Mosaic tiles only in whole "
                "lanes")
    return None


_registration.register(
    "attention", flash_attention, backend="tpu", supports=supports, verified=VERIFIED,
    description="flash attention, VMEM online softmax, masked kv blocks skipped, XLA-VJP "
                "backward")
