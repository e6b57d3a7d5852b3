"""Pallas GPU kernel (Triton lowering): multi-head latent attention over a paged latent pool.

The weight absorption stays in XLA (:func:`forge_jax.ops.mla.absorb_queries` and
:func:`forge_jax.ops.mla.up_project`); the kernel reads the cache: one KV "head" of
``[latent, k_pe]`` vectors shared by every query head, the latent its own value.

Grid ``(rows, head_blocks)``: each program takes ``block_h`` heads of one query row (a decode
token or a row of a prefill chunk: :func:`forge_jax.ops.mla.query_rows` gives each row its
block table and the count of keys it sees) and walks the row's pages straight from the pool,
``pages_per_block`` pages at a time, as two gathers per block (the ``kv_lora_rank`` latent
lanes and the ``rope_dim`` RoPE lanes of each slot: Triton's operands are powers of two, 576
is not), with an online softmax in float32. Keys past the row's count and slots on a ``-1``
entry are hidden by ``where`` and their latent rows zeroed before ``p @ c`` (a zero
probability does not hide NaN), so whatever the pool holds there never reaches the output.

Why Triton and not Mosaic GPU: WGMMA multiplies 64-row tiles, and a query row holds the
heads of one tensor-parallel shard (DeepSeek-V3's 128 heads over 8 GPUs are 16), so the
``[heads, 576] x [576, keys]`` products are too short for it; Triton's ``mma`` takes 16
rows.

Op: :func:`forge_jax.ops.mla.mla_paged_attention`; reference: its XLA implementation.
Tests: ``tests/test_mla_kernels.py``.
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
from forge_jax.ops import mla
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in Pallas' interpreter and compiled deviceless for an H100; no GPU has run it).
VERIFIED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch parameters: ``block_k`` keys per compute block (a power of two
    >= 16: whole pages or a part of one), ``block_h`` heads per program (a power of two >=
    16), Triton's warps and stages."""

    block_k: int
    block_h: int
    num_warps: int
    num_stages: int


# By device kind, then by the pool's bytes per value (the smallest bucket >= it). Untuned,
# pending GPU measurements; sized by the H100 compile (forge_jax.aot, JAX 0.10.2,
# 2026-11-28): a [block_k, 512] latent block per stage beside the [block_h, 512] float32
# accumulator. Float32 pools with 32-key blocks or two stages asked for more shared memory
# than the H100 has (331,796 of 232,448 bytes) or spilled.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        2: dict(block_k=32, block_h=16, num_warps=8, num_stages=2),
        4: dict(block_k=16, block_h=16, num_warps=8, num_stages=1),
    },
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch parameters for ``args["latent_pages"]`` (its dtype) on ``device_kind``."""
    return Config(**_common.tuned(TUNED, device_kind,
                                  jnp.dtype(args["latent_pages"].dtype).itemsize))


def _kernel(q_lat_ref, q_pe_ref, seen_ref, tables_ref, pool_ref, o_ref, *, block_k,
            page_size, kv_lora_rank, rope_dim, scale, precision):
    # q_lat_ref [block_h, kv_lora_rank], q_pe_ref [block_h, rope_dim]: absorbed queries;
    # seen_ref [1]: the row sees its first seen keys; tables_ref [table_width], -1 for an
    # entry the row does not use or that names no page; pool_ref [num_pages, page_size,
    # width] (the whole pool, read in place); o_ref [block_h, kv_lora_rank].
    block_h = q_lat_ref.shape[0]
    q_lat, q_pe = q_lat_ref[...], q_pe_ref[...]
    seen = seen_ref[0]

    def body(block, carry):
        o, m, l_sum = carry
        # A block is block_k keys: whole pages or a part of one.
        key = block * block_k + jnp.arange(block_k, dtype=jnp.int32)
        entries = _compat.triton_load(tables_ref, (key // page_size,))
        slots = (jnp.maximum(entries, 0)[:, None], (key % page_size)[:, None])

        def load(start, size):  # `size` lanes from `start` of each key's slot
            lanes = start + jnp.arange(size, dtype=jnp.int32)[None, :]
            return _compat.triton_load(pool_ref, (*slots, lanes)).astype(q_lat.dtype)

        visible = (key < seen) & (entries >= 0)  # every head of the row sees the same keys
        c = load(0, kv_lora_rank)  # [block_k, kv_lora_rank]
        k_pe = load(kv_lora_rank, rope_dim)
        s = (lax.dot_general(q_lat, c, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
             + lax.dot_general(q_pe, k_pe, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)) * scale
        # where, not a bias: keys the row does not see can hold NaN or inf.
        s = jnp.where(visible[None, :], s, -jnp.inf)
        p, correction, m_next, l_sum = _common.online_softmax_step(s, m, l_sum)
        c = jnp.where(visible[:, None], c, jnp.zeros((), c.dtype))
        pv = lax.dot_general(p.astype(c.dtype), c, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return correction[:, None] * o + pv, m_next, l_sum

    init = (jnp.zeros((block_h, kv_lora_rank), jnp.float32),
            jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32))
    o, _, l_sum = lax.fori_loop(0, pl.cdiv(seen, block_k), body, init)
    o_ref[...] = jnp.where(l_sum[:, None] == 0, 0.0,
                           o / jnp.where(l_sum == 0, 1.0, l_sum)[:, None])


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_k", "block_h", "num_warps", "num_stages", "interpret"))
def mla_paged_attention(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                        cu_q_lens, num_seqs, *, scale=None, block_k=None, block_h=None,
                        num_warps=None, num_stages=None, interpret=False):
    """Multi-head latent attention over a paged latent pool (see
    :func:`forge_jax.mla_paged_attention` for the contract and the shapes).

    Args:
      q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths, cu_q_lens,
        num_seqs, scale: as in the op.
      block_k: keys per compute block, a power of two >= 16 (default from :data:`TUNED`).
      block_h: heads per program, a power of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).

    Returns:
      ``[total_tokens, heads, v_dim]`` in ``q_nope.dtype``.
    """
    _compat.filter_triton_deprecation()
    total_tokens, heads, _ = q_nope.shape
    num_pages, page_size, width = latent_pages.shape
    kv_lora_rank, rope_dim = w_uk.shape[0], q_pe.shape[2]
    config = default_config({"latent_pages": latent_pages}, _common.device_kind(interpret))
    block_k = block_k or config.block_k
    block_h = block_h or config.block_h
    for name, value in (("block_k", block_k), ("block_h", block_h)):
        if value < _common.MIN_DOT or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= {_common.MIN_DOT} "
                             "(a Triton dot operand)")
    head_blocks = -(-heads // block_h)
    heads_pad = head_blocks * block_h
    # Room for the last block's keys: whole blocks of entries, a power of two.
    keys = -(-block_tables.shape[1] * page_size // block_k) * block_k
    table_width = _common.next_pow2(-(-keys // page_size))
    scale = mla.default_scale(q_nope, q_pe, scale)
    # bfloat16/float16 pools meet queries of their dtype (the MMA's inputs); float32 ones
    # multiply as IEEE float32 (Triton's default is TF32).
    dtype = latent_pages.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT

    with jax.named_scope("mla_paged_attention"):
        tables, seen = mla.query_rows(block_tables, kv_lengths, cu_q_lens, num_seqs,
                                      total_tokens=total_tokens, num_pages=num_pages,
                                      page_size=page_size)
        tables = jnp.pad(tables, ((0, 0), (0, table_width - tables.shape[1])),
                         constant_values=-1)
        q = mla.absorb_queries(q_nope, q_pe, w_uk).astype(dtype)
        q = jnp.pad(q, ((0, 0), (0, heads_pad - heads), (0, 0)))
        q_lat, q_rope = q[..., :kv_lora_rank], q[..., kv_lora_rank:]

        kernel = functools.partial(
            _kernel, block_k=block_k, page_size=page_size, kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim, scale=float(scale), precision=precision)
        out = pl.pallas_call(
            kernel,
            grid=(total_tokens, head_blocks),
            in_specs=[
                pl.BlockSpec((None, block_h, kv_lora_rank), lambda r, h: (r, h, 0)),
                pl.BlockSpec((None, block_h, rope_dim), lambda r, h: (r, h, 0)),
                pl.BlockSpec((1,), lambda r, h: (r,)),
                pl.BlockSpec((None, table_width), lambda r, h: (r, 0)),
                pl.BlockSpec((num_pages, page_size, width), lambda r, h: (0, 0, 0)),
            ],
            out_specs=pl.BlockSpec((None, block_h, kv_lora_rank), lambda r, h: (r, h, 0)),
            out_shape=jax.ShapeDtypeStruct((total_tokens, heads_pad, kv_lora_rank),
                                           jnp.float32),
            compiler_params=_compat.triton_compiler_params(
                num_warps=num_warps or config.num_warps,
                num_stages=num_stages or config.num_stages),
            interpret=interpret,
            name="forge_jax_mla_paged_attention",
            cost_estimate=_cost.attention(
                queries=total_tokens * heads, keys=block_tables.shape[1] * page_size,
                head_dim=kv_lora_rank + rope_dim, io=(q, tables),
                kv_bytes=total_tokens * head_blocks * block_tables.shape[1] * page_size
                * (kv_lora_rank + rope_dim) * dtype.itemsize
                + 4 * total_tokens * heads_pad * kv_lora_rank),
        )(q_lat, q_rope, seen, tables, latent_pages)
        return mla.up_project(out[:, :heads], w_uv, q_nope.dtype)


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these :func:`forge_jax.mla_paged_attention`
    arguments, else why not."""
    q_nope, q_pe, pool = args["q_nope"], args["q_pe"], args["latent_pages"]
    kv_lora_rank, rope_dim = args["w_uk"].shape[0], q_pe.shape[2]
    for name, x in (("q_nope", q_nope), ("latent_pages", pool)):
        if jnp.dtype(x.dtype) not in _common.FLOAT_DTYPES:
            return f"{name}.dtype={jnp.dtype(x.dtype).name}: the kernel reads float dtypes"
    for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if not _pow2(value):
            # The H100 compile (forge_jax.aot, JAX 0.10.2, 2026-11-28) of kv_lora_rank 96:
            # "The Pallas Triton lowering currently requires that all operations have array
            # arguments and results whose size is a power of 2". Page sizes need not be
            # (24 compiles), nor float16 avoided (it compiles).
            return (f"{name}={value} is not a power of two: a block's latent and RoPE lanes "
                    "are Triton arrays, whose sizes must be")
    return None


_registration.register(
    "mla_paged_attention", mla_paged_attention, backend="gpu", supports=supports,
    verified=VERIFIED,
    description="each query row's heads over its block table, latent and RoPE lanes "
                "gathered from the pool, online softmax in the latent space")
