"""Pallas TPU kernel (Mosaic): multi-head latent attention over a paged latent pool.

The weight absorption stays in XLA (two small einsums, :func:`forge_jax.ops.mla.absorb_queries`
and :func:`forge_jax.ops.mla.up_project`); the kernel is the part that reads the cache: one
KV "head" of ``[latent, k_pe]`` vectors shared by every query head, the latent its own value.

Grid ``(rows, key_blocks)``: each program takes all heads of one query row (a decode token
or one row of a prefill chunk: :func:`forge_jax.ops.mla.query_rows` turns the ragged layout
into each row's block table and the count of keys it sees, scalar-prefetched into SMEM) and
one block of ``pages_per_block`` pages, each page its own input block whose index map reads
the row's block table, so Pallas' pipeline double-buffers the page copies. An online softmax
in float32 runs across the key blocks in VMEM scratch; the output block (the row's latent
output ``[heads, kv_lora_rank]``) is written at the last one. Blocks past the keys a row
sees map to the row's last page (no new copy) and compute nothing.

Logits are ``q_latent . c + q_pe . k_pe``, two products of the lanes split in VMEM. The pool
is read as stored: at 576 lanes XLA lays it out pages-minor and the call copies it first,
so the latent cache stores it 640 wide on TPU (:func:`forge_jax.kv_cache.latent.pool_width`).
Every row sees exactly its first ``seen`` keys: keys past them and slots on an entry that
names no page (``-1``) are hidden by ``where`` and their latent rows zeroed before ``p @ c``
(a zero probability does not hide NaN), so whatever the pool holds there never reaches the
output. A row that sees nothing returns zeros.

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
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and compiled deviceless for v5e/v6e; no TPU has run it).
VERIFIED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch parameter: keys per grid step (``block_k // page_size`` pages,
    at least one, at most the block table's width)."""

    block_k: int


# Untuned, pending TPU measurements: a block of 128 keys of 576 bfloat16 values is 144 KiB,
# twice buffered, beside the row's queries and float32 accumulator.
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_k=128), v5p=dict(block_k=256), v6e=dict(block_k=256),
    default=dict(block_k=128))


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tuned launch parameter on ``device_kind`` (the same for any arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def _kernel(tables_ref, seen_ref,  # scalar prefetch (SMEM)
            q_ref, *refs, pages_per_block, table_width, kv_lora_rank, rope_dim, scale):
    # tables_ref [rows * table_width]: each row's pages, -1 for an entry it does not use or
    # that names no page; seen_ref [rows]: the row sees its first seen keys.
    # q_ref [heads, kv_lora_rank + rope_dim] float32 absorbed queries; page refs:
    # pages_per_block x [page_size, width] (padding lanes past kv_lora_rank + rope_dim);
    # o_ref [heads, kv_lora_rank];
    # scratch m_ref, l_ref [heads, 1], acc_ref [heads, kv_lora_rank] float32.
    *page_refs, o_ref, m_ref, l_ref, acc_ref = refs
    r, b = pl.program_id(0), pl.program_id(1)
    page_size = page_refs[0].shape[0]
    block_k = pages_per_block * page_size
    seen = seen_ref[r]

    @pl.when(b == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(b * block_k < seen)
    def _():
        q = q_ref[...]
        q_lat, q_pe = q[:, :kv_lora_rank], q[:, kv_lora_rank:]
        for i, page_ref in enumerate(page_refs):
            entry = b * pages_per_block + i
            page = tables_ref[r * table_width + entry]
            kv = page_ref[...].astype(jnp.float32)  # [page_size, width]
            c, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:kv_lora_rank + rope_dim]
            s = (lax.dot_general(q_lat, c, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
                 + lax.dot_general(q_pe, k_pe, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)) * scale
            key = entry * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            visible = (key < seen) & (page >= 0)
            # where, not a bias: keys the row does not see can hold NaN or inf.
            s = jnp.where(visible, s, -jnp.inf)
            m = m_ref[...]
            m_next = jnp.maximum(m, s.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # nothing seen yet
            p = jnp.exp(s - m_safe)
            correction = jnp.exp(m - m_safe)
            l_ref[...] = correction * l_ref[...] + p.sum(axis=1, keepdims=True)
            row = entry * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
            c = jnp.where((row < seen) & (page >= 0), c, 0.0)
            acc_ref[...] = correction * acc_ref[...] + lax.dot_general(
                p, c, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            m_ref[...] = m_next

    @pl.when(b == pl.num_programs(1) - 1)
    def _():
        l_sum = l_ref[...]
        o_ref[...] = jnp.where(l_sum == 0, 0.0, acc_ref[...] / jnp.where(l_sum == 0, 1.0,
                                                                          l_sum))


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret"))
def mla_paged_attention(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                        cu_q_lens, num_seqs, *, scale=None, pages_per_block=None,
                        interpret=False):
    """Multi-head latent attention over a paged latent pool (see
    :func:`forge_jax.mla_paged_attention` for the contract and the shapes).

    Args:
      q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths, cu_q_lens,
        num_seqs, scale: as in the op.
      pages_per_block: pages per grid step (default from :data:`TUNED`).
      interpret: run in the TPU interpreter (any platform).

    Returns:
      ``[total_tokens, heads, v_dim]`` in ``q_nope.dtype``.
    """
    total_tokens, heads, _ = q_nope.shape
    num_pages, page_size, width = latent_pages.shape
    kv_lora_rank = w_uk.shape[0]
    pages_per_seq = block_tables.shape[1]
    if pages_per_block is None:
        config = default_config({}, _common.device_kind(interpret))
        pages_per_block = max(1, min(pages_per_seq, config.block_k // page_size))
    if pages_per_block < 1:
        raise ValueError(f"{pages_per_block=} must be positive")
    num_blocks = -(-pages_per_seq // pages_per_block)
    table_width = num_blocks * pages_per_block
    scale = mla.default_scale(q_nope, q_pe, scale)

    with jax.named_scope("mla_paged_attention"):
        # Small bookkeeping and the absorption in XLA; the pool is only read by the kernel.
        tables, seen = mla.query_rows(block_tables, kv_lengths, cu_q_lens, num_seqs,
                                      total_tokens=total_tokens, num_pages=num_pages,
                                      page_size=page_size)
        tables = jnp.pad(tables, ((0, 0), (0, table_width - pages_per_seq)),
                         constant_values=-1)
        q = mla.absorb_queries(q_nope, q_pe, w_uk)  # [rows, heads, rank + rope] float32

        def page_spec(i):
            def index(r, b, tables, seen):
                # Blocks past the row's keys stay on its last page: no new copy.
                last = jnp.maximum(pl.cdiv(seen[r], page_size) - 1, 0)
                entry = jnp.minimum(b * pages_per_block + i, last)
                return jnp.maximum(tables[r * table_width + entry], 0), 0, 0

            return pl.BlockSpec((None, page_size, width), index)

        kernel = functools.partial(_kernel, pages_per_block=pages_per_block,
                                   table_width=table_width, kv_lora_rank=kv_lora_rank,
                                   rope_dim=q_pe.shape[2], scale=float(scale))
        out = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=(total_tokens, num_blocks),
                in_specs=[pl.BlockSpec((None, heads, q.shape[2]), lambda r, b, *_: (r, 0, 0)),
                          *(page_spec(i) for i in range(pages_per_block))],
                out_specs=pl.BlockSpec((None, heads, kv_lora_rank), lambda r, b, *_: (r, 0, 0)),
                scratch_shapes=[pltpu.VMEM((heads, 1), jnp.float32),
                                pltpu.VMEM((heads, 1), jnp.float32),
                                pltpu.VMEM((heads, kv_lora_rank), jnp.float32)],
            ),
            out_shape=jax.ShapeDtypeStruct((total_tokens, heads, kv_lora_rank), jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary")),
            interpret=_compat.tpu_interpret_params() if interpret else False,
            name="forge_jax_tpu_mla_paged_attention",
            cost_estimate=_cost.attention(
                queries=total_tokens * heads, keys=pages_per_seq * page_size,
                head_dim=width, io=(q, tables),
                kv_bytes=total_tokens * pages_per_seq * page_size * width
                * latent_pages.dtype.itemsize + 4 * total_tokens * heads * kv_lora_rank),
        )(tables.reshape(-1), seen, q, *(latent_pages,) * pages_per_block)
        return mla.up_project(out, w_uv, q_nope.dtype)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel lowers for these :func:`forge_jax.mla_paged_attention`
    arguments, else why not."""
    pool = args["latent_pages"]  # (the queries reach the kernel absorbed, in float32)
    if jnp.dtype(pool.dtype) not in _common.FLOAT_DTYPES:
        return (f"latent_pages.dtype={jnp.dtype(pool.dtype).name}: the kernel reads "
                "float32/bfloat16 (TPUs have no float16 vector unit)")
    # Any kv_lora_rank (96 compiles: the latent lanes are sliced in VMEM) and any page size
    # (pages of 4 float32 or 8 bfloat16 rows compile) for v5e (forge_jax.aot, libtpu
    # 0.0.42.1, JAX 0.10.2, 2026-11-28); float16 fails there ("Invalid vector type for
    # load").
    return None


_registration.register(
    "mla_paged_attention", mla_paged_attention, backend="tpu", supports=supports,
    verified=VERIFIED,
    description="each query row over its block table, pages as pipelined blocks, online "
                "softmax in the latent space")
