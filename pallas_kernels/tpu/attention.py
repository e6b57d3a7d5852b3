"""Pallas TPU kernel (Mosaic): flash attention forward, backward by the XLA reference's VJP.

Grid ``(batch, q_heads, q_blocks, kv_blocks)``, the last one sequential: each program
multiplies one ``[block_q, head_dim]`` query block of one head with one
``[block_k, head_dim]`` K/V block of its kv head, carrying the online softmax (running
max ``m``, sum ``l`` and the float32 accumulator) in VMEM scratch across the kv blocks, as
in JAX's own ``pallas/ops/tpu/flash_attention.py``. Q, K, V and the output are read and
written in their ``[batch, seq, heads, head_dim]`` layout, viewed as ``[batch, seq,
heads * head_dim]`` (a free reshape): a block is one head's ``head_dim`` lanes (heads
narrower than 128 lanes are folded, see below), and the K/V
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

Heads narrower than a 128-lane tile (head_dim 64, 80, 96, 192): Mosaic tiles a block's last
dimension only in whole 128 lanes (or the whole row), so such heads are folded: a program
reads ``heads`` kv heads side by side (:func:`heads_per_block`: two heads of 64 make one
tile; three, as SmolLM2's, make the whole 192-lane row) and the query heads that attend to
them, laid out alike by a transpose of Q (``[batch, group, q_len, kv_heads * head_dim]``;
free without GQA); K and V are still read in place. Each head's logits are a dot of the
block's queries with the other heads' lanes zeroed, and its online softmax state is its
own (``m``, ``l`` per head; the accumulator's lanes by head), as tpu-inference's
head-dim-64 ragged attention folds heads into lanes.

Mosaic constraints (checked by :func:`supports`): ``block_q`` (sublanes of Q) is a
multiple of the sublane tile (8 rows for float32, 16 for bfloat16) or all of ``q_len``,
``block_k`` a multiple of 128 (lanes of the logits) or all of ``kv_len``; sequences that
are not a multiple of the block end in a partial block (its rows past the end are garbage,
masked by the length, never written).
TPUs have no float16 vector unit.

Op: :func:`forge_jax.ops.attention.attention`; reference: its XLA implementation
:func:`forge_jax.ops.attention.attention_xla`. Tests:
``tests/test_pallas_tpu_attention.py``.
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

# The widest row of folded heads a program reads (:func:`heads_per_block`), with the blocks
# shrunk for it (:func:`block_sizes`): 640 lanes (eight heads of 80) compile for v4, v5e
# and v6e in float32; 896 (eight float32 heads of 112) compile for v5e but not v4 ("Used
# 18.39M of 16.00M vmem"; forge_jax.aot, JAX 0.10.2, libtpu 0.0.42.1, 2026-11-25).
MAX_LANES = 640


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: query rows and keys per program step (the wrapper clips
    them to ``q_len`` and ``kv_len``, :func:`block_sizes`)."""

    block_q: int
    block_k: int


# The defaults per TPU generation (:func:`_common.per_generation`; v6e's faster MXU takes
# bigger blocks). Untuned, pending measurements on TPU hardware.
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_q=256, block_k=512), v5p=dict(block_q=512, block_k=512),
    v6e=dict(block_q=512, block_k=1024), default=dict(block_q=128, block_k=128))


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tuned blocks on ``device_kind`` (the same for any arguments), before
    :func:`block_sizes` clips them to a call's sequences."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def block_sizes(q_len: int, kv_len: int, dtype, *, block_q: int | None = None,
                block_k: int | None = None, device_kind: str | None = None,
                lanes: int = _common.LANES) -> tuple[int, int]:
    """``(block_q, block_k)``: the knobs, else :data:`TUNED`, clipped to the sequences.

    ``lanes``: the width of a block's rows (``heads_per_block * head_dim``); the table's
    blocks are for one 128-lane head and shrink by ``lanes // 256`` for wider folds (Phi-2's
    eight float32 heads of 80, 640 lanes, ran out of v5e's 16 MiB scoped VMEM at 256 x 512).
    Raises ``ValueError`` for a block Mosaic cannot tile.
    """
    config = default_config({}, device_kind)
    tile = _common.sublane_tile(dtype)
    shrink = max(1, lanes // (2 * _common.LANES))
    block_q = min(block_q or max(tile, config.block_q // shrink // tile * tile), q_len)
    block_k = min(block_k or max(_common.LANES, config.block_k // shrink // _common.LANES
                                 * _common.LANES), kv_len)
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


def heads_per_block(kv_heads: int, head_dim: int) -> int:
    """KV heads one program reads side by side: 1 when ``head_dim`` is whole 128-lane
    tiles, else the fewest (dividing ``kv_heads``) whose ``heads * head_dim`` lanes are, else
    all of them (a block as wide as the row, which Mosaic accepts whatever its width)."""
    for heads in range(1, kv_heads + 1):
        if kv_heads % heads == 0 and heads * head_dim % _common.LANES == 0:
            return heads
    return kv_heads


def _kernel(len_ref, lo_ref, hi_ref,  # scalar prefetch (SMEM)
            q_ref, k_ref, v_ref, pos_ref, *refs,  # inputs, output, scratch
            scale, causal, sliding_window, logits_soft_cap, num_q_blocks, heads, head_dim,
            chunk_size, has_sinks):
    # With chunked attention, chunk_ref [block_q, 1]: the first key of each query's chunk;
    # with sinks, sink_ref [1, heads * head_dim]: each lane's head's sink logit.
    chunk_ref = refs[0] if chunk_size else None
    sink_ref = refs[int(bool(chunk_size))] if has_sinks else None
    o_ref, m_ref, l_ref, acc_ref = refs[int(bool(chunk_size)) + int(has_sinks):]
    # len_ref [batch]; lo_ref, hi_ref [batch * q_blocks]: the keys any query of the block may
    # see lie in [lo, hi). q_ref, o_ref [block_q, heads * head_dim]; k_ref, v_ref [block_k,
    # heads * head_dim]: `heads` heads side by side in the lanes, query head c of the block
    # attending to kv head c; pos_ref [block_q, 1]; m_ref, l_ref [heads, block_q,
    # _common.LANES] (lane-replicated); acc_ref [block_q, heads * head_dim] float32.
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    block_k = k_ref.shape[0]
    lo, hi = lo_ref[b * num_q_blocks + i], hi_ref[b * num_q_blocks + i]
    # Which head each lane belongs to: heads narrower than a tile are computed with the other
    # heads' lanes zeroed (a whole-width dot) rather than sliced out of the tile.
    lane_head = lax.div(lax.broadcasted_iota(jnp.int32, (1, heads * head_dim), 1), head_dim)

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
        col = j * block_k + lax.broadcasted_iota(jnp.int32, (q.shape[0], block_k), 1)
        pos = pos_ref[...]  # [block_q, 1]
        # len_ref[b] <= kv_len, so the garbage rows of a partial last block are hidden too.
        visible = col < len_ref[b]
        if causal:
            visible &= col <= pos
        if sliding_window is not None:
            visible &= col > pos - sliding_window
        if chunk_size:  # the query's own chunk: [start, start + size)
            start = chunk_ref[...]  # [block_q, 1]
            visible &= col >= start
            if not causal:
                visible &= col < start + chunk_size

        v = v_ref[...]
        v32 = v.astype(jnp.float32)
        nonfinite = (jnp.abs(v32) == jnp.inf) | (v32 != v32)
        v = jnp.where(nonfinite, 0.0, v32).astype(v.dtype)
        acc = acc_ref[...]
        for c in range(heads):
            mine = lane_head == c
            # (The other heads' lanes are zeroed in float32: on one bfloat16 row, half a
            # packed sublane, Mosaic refuses the select, "Not implemented: Sublane broadcast".)
            qc = q if heads == 1 else jnp.where(mine, q.astype(jnp.float32), 0.0).astype(q.dtype)
            s = lax.dot_general(qc, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                                preferred_element_type=jnp.float32) * scale  # [block_q, block_k]
            if logits_soft_cap is not None:
                s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
            s = jnp.where(s == jnp.inf, jnp.nan, s)  # a +inf logit is NaN data, not a winner
            s = jnp.where(visible, s, -jnp.inf)  # where, not a bias: hidden keys may be NaN
            m_prev, l_prev = m_ref[c][:, :1], l_ref[c][:, :1]
            m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing
            p = jnp.exp(s - m_safe)
            correction = jnp.exp(m_prev - m_safe)
            l_next = correction * l_prev + p.sum(axis=1, keepdims=True)
            # Probabilities meet the values in the values' dtype (flash-attention practice).
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=_precision(v.dtype),
                                 preferred_element_type=jnp.float32)
            acc = correction * acc + pv if heads == 1 else jnp.where(
                mine, correction * acc + pv, acc)
            m_ref[c] = jnp.broadcast_to(m_next, m_ref.shape[1:])
            l_ref[c] = jnp.broadcast_to(l_next, l_ref.shape[1:])

        def mark_nonfinite(acc):
            # Which keys a query sees does not depend on the head: one product for all.
            hits = lax.dot_general(jnp.where(visible, 1.0, 0.0), jnp.where(nonfinite, 1.0, 0.0),
                                   (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [block_q, lanes]
            return jnp.where(hits > 0, jnp.nan, acc)

        any_nonfinite = jnp.max(jnp.where(nonfinite, 1.0, 0.0)) > 0
        acc_ref[...] = lax.cond(any_nonfinite, mark_nonfinite, lambda acc: acc, acc)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        # A query that saw no key has l == 0 and acc == 0 (or NaN it must show).
        acc = acc_ref[...]
        l_sum = None
        for c in range(heads):
            l_c = l_ref[c][:, :1]
            if has_sinks:
                # The sink joins the denominator and weighs no value (forge_jax.ops.attention).
                mine = lane_head == c
                sink = jnp.max(jnp.where(mine, sink_ref[...], -jnp.inf), axis=1,
                               keepdims=True)  # [1, 1]
                m_c = m_ref[c][:, :1]
                m_next = jnp.maximum(m_c, sink)
                m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
                correction = jnp.exp(m_c - m_safe)
                l_c = correction * l_c + jnp.exp(sink - m_safe)
                acc = correction * acc if heads == 1 else jnp.where(mine, correction * acc, acc)
            l_sum = l_c if l_sum is None else jnp.where(lane_head == c, l_c, l_sum)
        o_ref[...] = (acc / jnp.where(l_sum == 0, 1.0, l_sum)).astype(o_ref.dtype)


def _forward(q, k, v, positions, lengths, sinks=None, *, scale, causal, sliding_window,
             logits_soft_cap, block_q, block_k, interpret, attention_chunk_size=None):
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    num_q_blocks, num_k_blocks = pl.cdiv(q_len, block_q), pl.cdiv(kv_len, block_k)
    heads = heads_per_block(kv_heads, head_dim)
    head_blocks = kv_heads // heads  # blocks of `heads` kv heads in a K/V row

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
    chunk_start = None
    if attention_chunk_size is not None:
        size = attention_chunk_size
        chunk_start = jnp.floor_divide(positions, size) * size  # [batch, q_len]
        starts = jnp.pad(chunk_start, ((0, 0), (0, pad)), constant_values=POS_LIMIT)
        lo = jnp.maximum(lo, starts.reshape(batch, num_q_blocks, block_q).min(-1))
        if not causal:
            ends = jnp.pad(chunk_start, ((0, 0), (0, pad)), constant_values=-POS_LIMIT)
            hi = jnp.minimum(hi, ends.reshape(batch, num_q_blocks, block_q).max(-1) + size)
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
        return b, jnp.maximum(block, 0), kv_block(h)

    if heads == 1:
        # Whole-tile heads: Q read in place, program h is query head h, its kv head h // group.
        def kv_block(h):
            return lax.div(h, group)

        q_rows = q.reshape(batch, q_len, q_heads * head_dim)
        q_spec = pl.BlockSpec((None, block_q, head_dim), lambda b, h, i, j, *_: (b, i, h))
    else:
        # Heads narrower than a tile, folded: the query heads that share a position in
        # their groups are laid side by side as their kv heads are in K/V (a transpose of Q,
        # a free reshape without GQA), so that a program reads `heads` query heads and their
        # `heads` kv heads as tiles of whole lanes. Program h: group position h //
        # head_blocks, kv head block h % head_blocks. K and V are read in place.
        def kv_block(h):
            return lax.rem(h, head_blocks)

        q_rows = (q.reshape(batch, q_len, kv_heads, group, head_dim)
                  .transpose(0, 3, 1, 2, 4).reshape(batch, group, q_len, kv_heads * head_dim))
        q_spec = pl.BlockSpec((None, None, block_q, heads * head_dim),
                              lambda b, h, i, j, *_: (b, lax.div(h, head_blocks), i,
                                                      lax.rem(h, head_blocks)))

    kernel = functools.partial(
        _kernel, scale=scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, num_q_blocks=num_q_blocks, heads=heads,
        head_dim=head_dim, chunk_size=attention_chunk_size or 0, has_sinks=sinks is not None)
    kv_spec = pl.BlockSpec((None, block_k, heads * head_dim), kv_index)
    extra_specs, extra = [], []
    if chunk_start is not None:
        extra_specs.append(pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, *_: (b, i, 0)))
        extra.append(chunk_start[:, :, None])
    if sinks is not None:
        # [programs, 1, heads * head_dim]: each lane holds its query head's sink. Program h
        # is query head h (whole-tile heads), else group position h // head_blocks of the
        # kv heads of block h % head_blocks.
        h = jnp.arange(q_heads if heads == 1 else group * head_blocks)
        lane_heads = jnp.arange(heads)
        q_head = (h[:, None] if heads == 1 else
                  ((h % head_blocks)[:, None] * heads + lane_heads[None, :]) * group
                  + (h // head_blocks)[:, None])  # [programs, heads]
        extra_specs.append(pl.BlockSpec((None, 1, heads * head_dim),
                                        lambda b, h, i, j, *_: (h, 0, 0)))
        extra.append(jnp.repeat(sinks.astype(jnp.float32)[q_head], head_dim, axis=1)[:, None])
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, q_heads if heads == 1 else group * head_blocks, num_q_blocks,
                  num_k_blocks),
            in_specs=[
                q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, *_: (b, i, 0)),
                *extra_specs,
            ],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((heads, block_q, _common.LANES), jnp.float32),
                pltpu.VMEM((heads, block_q, _common.LANES), jnp.float32),
                pltpu.VMEM((block_q, heads * head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_flash_attention",
        cost_estimate=_cost.attention(queries=batch * q_len * q_heads, keys=k.shape[1],
                                      head_dim=head_dim, causal=causal and q_len == k.shape[1],
                                      io=(q, k, v, q)),
    )(lengths, lo.reshape(-1), hi.reshape(-1), q_rows,
      k.reshape(batch, kv_len, kv_heads * head_dim),
      v.reshape(batch, kv_len, kv_heads * head_dim),
      positions[:, :, None], *extra)
    if heads > 1:
        out = (out.reshape(batch, group, q_len, kv_heads, head_dim)
               .transpose(0, 2, 3, 1, 4))
    return out.reshape(q.shape)


# The contract's positions and lengths around _forward; backward: the XLA reference's VJP.
_attention = _attention_common.flash_attention_call(_forward)


@functools.partial(jax.jit, static_argnames=(
    "scale", "causal", "sliding_window", "logits_soft_cap", "attention_chunk_size", "block_q",
    "block_k", "interpret"))
def flash_attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    attention_chunk_size=None, block_q=None, block_k=None, interpret=False):
    """Flash attention on TPU (see :func:`forge_jax.attention` for the contract).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``, float32/bfloat16; heads narrower than 128
        lanes are folded (:func:`heads_per_block`).
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, float32/bfloat16 (mixed with ``q``:
        that dot runs in float32), ``q_heads % kv_heads == 0``.
      scale, causal, q_positions, kv_lengths, sliding_window, logits_soft_cap, sinks,
        attention_chunk_size: as in the op.
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
    kv_heads, head_dim = k.shape[2], q.shape[3]
    block_q, block_k = block_sizes(q_len, kv_len, q.dtype, block_q=block_q, block_k=block_k,
                                   device_kind=_common.device_kind(interpret),
                                   lanes=heads_per_block(kv_heads, head_dim) * head_dim)
    return _attention(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                      kv_lengths=kv_lengths, sliding_window=sliding_window,
                      logits_soft_cap=logits_soft_cap, sinks=sinks,
                      attention_chunk_size=attention_chunk_size, block_q=block_q,
                      block_k=block_k, interpret=interpret)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these :func:`forge_jax.attention` arguments, else
    why not."""
    q = args["q"]
    for name in ("q", "k", "v"):
        dtype = jnp.dtype(args[name].dtype)
        if dtype not in _common.FLOAT_DTYPES:
            return (f"{name}.dtype={dtype.name}: the kernel reads float32/bfloat16 "
                    "(TPUs have no float16 vector unit)")
    kv_heads, head_dim = args["k"].shape[2], q.shape[-1]
    lanes = heads_per_block(kv_heads, head_dim) * head_dim
    if lanes > MAX_LANES:
        return (f"head_dim={head_dim} with kv_heads={kv_heads}: a program would read "
                f"{lanes} lanes of folded heads (more than {MAX_LANES}), one unrolled "
                "softmax per head")
    return None


_registration.register(
    "attention", flash_attention, backend="tpu", supports=supports, verified=VERIFIED,
    reads_sinks=True, reads_chunks=True,
    description="flash attention, VMEM online softmax, masked kv blocks skipped, XLA-VJP "
                "backward")
