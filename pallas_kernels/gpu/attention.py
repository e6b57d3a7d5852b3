"""Pallas GPU kernel (Triton lowering): flash attention, forward in Pallas, backward by XLA.

Grid ``(batch, kv_heads, row_blocks)``. The queries of one GQA group are laid out
query-major as ``q_len * group`` rows (row ``r`` is query ``r // group``, head
``r % group`` of the group), so one program serves ``block_q`` such rows: every K/V block
is read once for all the group's heads, for any group size (9/3, 12/4, 14/2), with no
padding of the group and no repeat of K/V in memory. Each program walks the K/V blocks
with an online softmax (float32), visiting only the blocks some row can see: the loop
bounds come from its rows' smallest and largest positions, the sequence's ``kv_lengths``
and the sliding window or chunk (``attention_chunk_size``: a row sees the keys of its own
chunk). Attention sinks (``sinks``, one logit per query head) join each row's softmax
sum after the last block, weighing no value. Head dims that are not a power of two (80, 96)
are read and written with masked loads/stores of the next power of two; K/V are read in
place.

The contract is that of :func:`forge_jax.attention`: positions are explicit
``q_positions``, else ``kv_lengths[b] - q_len + t`` with ``kv_lengths``, else
``kv_len - q_len + t``. K/V slots outside the range any row of the program may see are
never read (masked loads give zeros). Inside it, a key hidden from a row is hidden by
``where`` on the logits, and non-finite values are taken out of the ``p @ v`` product
(``0 * NaN`` is NaN); a block that holds any (rare: a ``lax.cond``) marks NaN the output
columns of exactly the rows that see one. So NaN/inf a row may not see never reaches it,
NaN it sees propagates (an inf value it sees gives NaN, not inf).

Backward: :func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`, the VJP of the XLA reference
(:func:`forge_jax.ops.attention.attention_reference`, which materialises the
``[batch, heads, q_len, kv_len]`` probabilities) with the same explicit positions and
lengths. This is a deliberate choice: no Pallas backward kernel has been written and
checked yet, so gradients cost what XLA's attention gradients cost.

Op: :func:`forge_jax.ops.attention.attention`; reference: its XLA implementation
:func:`forge_jax.ops.attention.attention_xla`. Tests:
``tests/test_pallas_gpu_attention.py``, ``tests/test_gpu_tuning.py``.
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
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

MAX_HEAD_DIM = 512  # Gemma 4's full layers (and its KV cache's width)


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: ``block_q`` query rows (flattened ``(query, group head)``
    pairs) and ``block_k`` keys per program step, and Triton launch parameters."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind
# and the interpreter), by padded head dim (:func:`_common.dot_size`; the smallest
# bucket >= it). Not measured yet (no GPU has run the kernel): "default" holds the ranges of
# JAX's own Pallas flash attention; the per-kind rows size the tiles to each device's shared
# memory (see :data:`_common.DEVICE_KINDS`). The wrapper clips the blocks to the rows and
# keys of the call.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        64: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
        128: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
        256: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        512: dict(block_q=32, block_k=16, num_warps=8, num_stages=2),
    },
    "H100": {
        # 8 warps: with 4, ptxas spills 28 bytes at head_dim 64 (255 registers; compiled
        # with forge_jax.aot, JAX 0.10.2, 2026-11-25); with 8, 212 registers and no spill.
        64: dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
        128: dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
        256: dict(block_q=64, block_k=32, num_warps=8, num_stages=2),
        # head_dim 512 (Gemma 4): 201 registers, no spill; blocks of 32 x 32 spill 24 bytes
        # (255 registers) (forge_jax.aot, JAX 0.10.2, 2026-11-28).
        512: dict(block_q=32, block_k=16, num_warps=8, num_stages=2),
    },
    "A100": {
        # 8 warps at head_dim 64 too: with 4, JAX 0.12's ptxas spills 4 bytes in bfloat16
        # (255 registers; JAX 0.10.2's did not).
        64: dict(block_q=128, block_k=64, num_warps=8, num_stages=2),
        # 8 warps: with 4, ptxas spills 280 bytes at head_dim 128 in bfloat16 (255
        # registers; forge_jax.aot, JAX 0.10.2, 2026-11-25); with 8, 254 and no spill.
        128: dict(block_q=64, block_k=64, num_warps=8, num_stages=2),
        256: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        512: dict(block_q=32, block_k=16, num_warps=8, num_stages=2),
    },
    "L4": {
        64: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
        128: dict(block_q=64, block_k=32, num_warps=4, num_stages=2),
        256: dict(block_q=32, block_k=32, num_warps=4, num_stages=1),
        512: dict(block_q=16, block_k=16, num_warps=8, num_stages=1),
    },
}


# Float32 tiles take twice the shared memory and registers of 16-bit ones: the rows above,
# sized for bfloat16, do not compile on an H100 at head_dim 80-128 ("Shared memory size
# limit exceeded: requested 262656, available: 232448") and spill 20-47 KB at 64 and 256.
# These, checked by compiling for the targets (tests/test_aot.py; JAX 0.10.2, 2026-11-25),
# compile on H100 without spills up to head_dim 128 (896 bytes spilled at 256), on A100
# (1076 bytes at 256) and in an L4's 99 KiB (552 bytes at 128, none at 256). At head_dim
# 512, blocks of 16 x 16 with one stage: 245 registers, no spill on H100 (32 x 16 spills
# 1272 bytes, 32 x 32 needs 266368 bytes of shared memory; JAX 0.10.2, 2026-11-28).
TUNED_FLOAT32: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        128: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        256: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        512: dict(block_q=16, block_k=16, num_warps=8, num_stages=1),
    },
    "L4": {
        128: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        256: dict(block_q=32, block_k=16, num_warps=8, num_stages=1),
        512: dict(block_q=16, block_k=16, num_warps=8, num_stages=1),
    },
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs for ``args["q"]`` (``[batch, q_len, q_heads, head_dim]``, anything
    with a shape and dtype) on ``device_kind``, from :data:`TUNED` (:data:`TUNED_FLOAT32`
    for float32)."""
    q = args["q"]
    table = TUNED_FLOAT32 if jnp.dtype(q.dtype).itemsize == 4 else TUNED
    return Config(**_common.tuned(table, device_kind, _common.dot_size(q.shape[-1])))


def _floor_div(x, d: int):
    """``floor(x / d)`` of int32 ``x`` (any sign) and a positive static ``d``
    (``lax.div`` truncates towards zero)."""
    x = x.astype(jnp.int32)
    return lax.div(jnp.where(x < 0, x - jnp.int32(d - 1), x), jnp.int32(d))


def _kernel(q_ref, k_ref, v_ref, pos_ref, len_ref, *rest,
            head_dim, block_q, block_k, scale, causal, sliding_window, logits_soft_cap,
            attention_chunk_size, has_sinks):
    # q_ref, o_ref [rows, head_dim_pad] (rows = q_len * group of one kv head); pos_ref [rows];
    # len_ref [1]: valid keys of this sequence; k_ref, v_ref [kv_len, head_dim_pad];
    # sink_ref (with sinks) [rows]: the sink logit of each row's head.
    sink_ref, o_ref = rest if has_sinks else (None, *rest)
    rows = q_ref.shape[0]
    kv_len, head_dim_pad = k_ref.shape
    row0 = pl.program_id(2) * block_q
    row_ids = row0 + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = row_ids < rows
    col_ok = jnp.arange(head_dim_pad, dtype=jnp.int32) < head_dim
    q_mask = row_ok[:, None] & col_ok[None, :]
    rows_slice = pl.ds(row0, block_q)
    q = _compat.triton_load(q_ref, (rows_slice, slice(None)), mask=q_mask, other=0)
    pos = _compat.triton_load(pos_ref, (rows_slice,), mask=row_ok, other=0)

    # The keys any row of this block may see lie in [key_lo, key_hi).
    key_hi = jnp.minimum(len_ref[0], kv_len)
    if causal:
        key_hi = jnp.minimum(key_hi, jnp.max(jnp.where(row_ok, pos, -POS_LIMIT)) + 1)
    key_lo = jnp.int32(0)
    if sliding_window is not None:
        key_lo = jnp.maximum(
            key_lo, jnp.min(jnp.where(row_ok, pos, POS_LIMIT)) - sliding_window + 1)
    if attention_chunk_size is not None:
        # A row at p sees the keys of its chunk, [c * size, (c + 1) * size), c = floor(p / size).
        chunk = _floor_div(pos, attention_chunk_size)  # [block_q]
        key_lo = jnp.maximum(key_lo, _floor_div(jnp.min(jnp.where(row_ok, pos, POS_LIMIT)),
                                                attention_chunk_size) * attention_chunk_size)
        if not causal:
            key_hi = jnp.minimum(key_hi, (_floor_div(
                jnp.max(jnp.where(row_ok, pos, -POS_LIMIT)), attention_chunk_size) + 1)
                * attention_chunk_size)

    # float32 operands as IEEE products (Triton's default for float32 dots is TF32);
    # bfloat16/float16 products are exact in float32 anyway.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    def body(block, carry):
        o, m, l_sum = carry
        j = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        # Slots outside [key_lo, key_hi) are never read: zeros, whatever they hold.
        slot_ok = (j >= key_lo) & (j < key_hi)
        kv_mask = slot_ok[:, None] & col_ok[None, :]
        keys = pl.ds(block * block_k, block_k)
        k = _compat.triton_load(k_ref, (keys, slice(None)), mask=kv_mask, other=0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # [block_q, block_k]
        s = s * scale
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        visible = jnp.broadcast_to(slot_ok[None, :], s.shape)
        if causal:
            visible &= j[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= j[None, :] > pos[:, None] - sliding_window
        if attention_chunk_size is not None:
            visible &= _floor_div(j, attention_chunk_size)[None, :] == chunk[:, None]
        s = jnp.where(visible, s, -jnp.inf)
        p, correction, m_next, l_sum = _common.online_softmax_step(s, m, l_sum)
        v = _compat.triton_load(v_ref, (keys, slice(None)), mask=kv_mask, other=0)
        # A zero probability does not hide a NaN/inf value (0 * NaN = NaN), and a slot in
        # [key_lo, key_hi) may still be hidden from some rows: non-finite values leave the
        # product, and (rarely, hence the cond) mark NaN the columns of the rows that see them.
        finite = jnp.isfinite(v)
        v = jnp.where(finite, v, jnp.zeros((), v.dtype))
        # Probabilities meet the values in the values' dtype (flash-attention practice).
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        o = correction[:, None] * o + pv

        def mark_nonfinite(o):
            hits = lax.dot_general(visible.astype(v.dtype), (~finite).astype(v.dtype),
                                   (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)  # [block_q, head_dim]
            return jnp.where(hits > 0, jnp.nan, o)

        any_nonfinite = jnp.max(jnp.where(finite, 0.0, 1.0)) > 0
        o = lax.cond(any_nonfinite, mark_nonfinite, lambda o: o, o)
        return o, m_next, l_sum

    init = (jnp.zeros((block_q, head_dim_pad), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    # key_lo >= 0; a negative key_hi (every row before key 0) gives an empty loop.
    first = lax.div(key_lo, block_k)
    last = lax.div(jnp.maximum(key_hi, 0) + block_k - 1, block_k)
    o, m, l_sum = lax.fori_loop(first, last, body, init)
    if has_sinks:
        # The sink joins the denominator and weighs no value (forge_jax.ops.attention).
        sink = _compat.triton_load(sink_ref, (rows_slice,), mask=row_ok, other=0)
        m_next = jnp.maximum(m, sink)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp(m - m_safe)
        o = correction[:, None] * o
        l_sum = correction * l_sum + jnp.exp(sink - m_safe)
    # A row that saw no key has l_sum == 0 and o == 0: zeros. NaN stays NaN.
    o = o / jnp.where(l_sum > 0, l_sum, 1.0)[:, None]
    _compat.triton_store(o_ref, (rows_slice, slice(None)), o.astype(o_ref.dtype), mask=q_mask)


def _forward(q, k, v, positions, lengths, sinks=None, *, scale, causal, sliding_window,
             logits_soft_cap, block_q, block_k, num_warps, num_stages, interpret,
             attention_chunk_size=None):
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows = q_len * group
    head_dim_pad = _common.dot_size(head_dim)
    qg = _attention_common.group_queries(q, kv_heads)  # [batch, kv_heads, rows, head_dim]
    row_pos = jnp.repeat(positions, group, axis=1)  # [batch, rows]
    kernel = functools.partial(
        _kernel, head_dim=head_dim, block_q=block_q, block_k=block_k, scale=scale,
        causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        attention_chunk_size=attention_chunk_size, has_sinks=sinks is not None)
    # Blocks of head_dim_pad columns over arrays of head_dim: every access is masked.
    rows_spec = pl.BlockSpec((None, None, rows, head_dim_pad), lambda b, h, i: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, kv_len, None, head_dim_pad), lambda b, h, i: (b, 0, h, 0))
    extra_specs, extra = [], []
    if sinks is not None:  # [kv_heads, rows]: row r of kv head h reads head h * group + r % group
        extra_specs = [pl.BlockSpec((None, rows), lambda b, h, i: (h, 0))]
        extra = [jnp.tile(sinks.reshape(kv_heads, 1, group), (1, q_len, 1)).reshape(
            kv_heads, rows)]
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, pl.cdiv(rows, block_q)),
        in_specs=[
            rows_spec, kv_spec, kv_spec,
            pl.BlockSpec((None, rows), lambda b, h, i: (b, 0)),
            pl.BlockSpec((1,), lambda b, h, i: (b,)),
            *extra_specs,
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=_compat.triton_compiler_params(num_warps=num_warps,
                                                      num_stages=num_stages),
        interpret=interpret,
        name="forge_jax_flash_attention",
        cost_estimate=_cost.attention(queries=batch * q_len * q_heads, keys=kv_len,
                                      head_dim=head_dim, causal=causal and q_len == kv_len,
                                      io=(qg, k, v, qg)),
    )(qg, k, v, row_pos, lengths, *extra)
    return _attention_common.ungroup_queries(out, q_len=q_len, q_heads=q_heads,
                                             head_dim=head_dim)


# The contract's positions and lengths around _forward; backward: the XLA reference's VJP.
_attention = _attention_common.flash_attention_call(_forward)


@functools.partial(jax.jit, static_argnames=(
    "scale", "causal", "sliding_window", "logits_soft_cap", "attention_chunk_size", "block_q",
    "block_k", "num_warps", "num_stages", "interpret"))
def flash_attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    attention_chunk_size=None, block_q=None, block_k=None,
                    num_warps=None, num_stages=None, interpret=False):
    """Flash attention (see :func:`forge_jax.attention` for the contract).

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``, float32/bfloat16/float16.
      k, v: ``[batch, kv_len, kv_heads, head_dim]`` in ``q.dtype``,
        ``q_heads % kv_heads == 0``; ``head_dim <= 256``, any value.
      scale, causal, q_positions, kv_lengths, sliding_window, logits_soft_cap, sinks,
        attention_chunk_size: as in the op.
      block_q: query rows per program, a power of two >= 16; a row is one (query, group
        head) pair. Default from the tuning table, at most the rows of one group.
      block_k: keys per step, a power of two >= 16 (default from the tuning table).
      num_warps, num_stages: Triton launch parameters (default from the tuning table).
      interpret: run in Pallas' interpreter (any platform).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; differentiable in q, k, v.
    """
    _compat.filter_triton_deprecation()
    _, q_len, q_heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    config = default_config({"q": q}, _common.device_kind(interpret))
    rows = q_len * (q_heads // kv_heads)
    block_q = block_q or min(config.block_q, _common.dot_size(rows))
    block_k = block_k or min(config.block_k, _common.dot_size(kv_len))
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value < _common.MIN_DOT or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= {_common.MIN_DOT} "
                             "(one dimension of a Triton dot)")
    if q.size == 0 or kv_len == 0:  # nothing to launch; a query with no keys gets zeros
        return jnp.zeros(q.shape, q.dtype)
    return _attention(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                      kv_lengths=kv_lengths, sliding_window=sliding_window,
                      logits_soft_cap=logits_soft_cap, sinks=sinks,
                      attention_chunk_size=attention_chunk_size, block_q=block_q, block_k=block_k,
                      num_warps=num_warps or config.num_warps,
                      num_stages=num_stages or config.num_stages, interpret=interpret)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these arguments, else why not."""
    q, k, v = args["q"], args["k"], args["v"]
    if jnp.dtype(q.dtype) not in _common.FLOAT_DTYPES:
        return f"q.dtype={jnp.dtype(q.dtype).name}: Triton dots take float32/16 and bfloat16"
    if jnp.dtype(k.dtype) != jnp.dtype(q.dtype) or jnp.dtype(v.dtype) != jnp.dtype(q.dtype):
        return (f"q.dtype={jnp.dtype(q.dtype).name}, k.dtype={jnp.dtype(k.dtype).name}, "
                f"v.dtype={jnp.dtype(v.dtype).name}: a Triton dot needs equal operand types")
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim={q.shape[-1]} > {MAX_HEAD_DIM} does not fit this kernel's tiles"
    return None


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults (a configuration that does
    not fit the device's shared memory fails to compile and is reported, not chosen)."""
    del args
    return [dict(block_q=q, block_k=k, num_warps=w, num_stages=2)
            for q in (32, 64, 128) for k in (32, 64) for w in (4, 8)]


_registration.register(
    "attention", flash_attention, backend="gpu", supports=supports, verified=VERIFIED,
    reads_sinks=True, reads_chunks=True,
    description="flash attention, GQA groups per program, XLA-VJP backward", configs=configs,
    interpret_configs=lambda args: [dict(block_q=16, block_k=16)])
