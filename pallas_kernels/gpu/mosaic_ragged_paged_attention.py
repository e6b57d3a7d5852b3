"""Mosaic GPU kernel (Hopper+): ragged paged attention, a mixed prefill + decode batch in one
launch.

The packed rows are cut into *items*: up to ``block_q = 64 // group`` consecutive rows of
one sequence (a decode token is an item of one row; a prefill chunk of ``n`` rows is
``ceil(n / block_q)`` items). XLA finds the items from ``cu_q_lens`` before the launch
(a static bound of ``min(total_tokens, ceil(total_tokens / block_q) + max_seqs)`` of them;
the unused ones see no key), gathers each item's GQA rows, positions, key range and
block-table row, and the paged kernel of
:mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention` runs all of them
in one launch, ``(items, kv_heads, splits)``: pages read in place through the tables, a
group's query heads together, split-K merged with logsumexp weights. Rows go back to their
place in the packed output; rows of no item (padding, a decreasing ``cu_q_lens``) are zero.

An item of one row sits at one position (the kernel's decode path: values outside its key
range zeroed on the boundary blocks only); an item of several rows takes the path that
keeps a non-finite value any of its rows does not see out of that row (see the paged
kernel's docstring). Lengths are clamped to the block table, positions follow them, and an
entry a sequence uses that names no page of the pool reads nothing (the index contract of
:mod:`forge_jax.ops.paged`).

Constraints: those of the paged kernel (:func:`supports`: compute capability 9.x, bfloat16
or float16 queries and pages of one dtype, ``head_dim`` 64 or 128 (its several-positions
limit: past 128 ptxas spills registers), page sizes of whole 8-row tiles that tile 64-key
blocks), and its int8/fp8 pages with their scales.

Op: :func:`forge_jax.ops.ragged.ragged_paged_attention`; reference: its XLA implementation
:func:`forge_jax.ops.ragged.ragged_paged_attention_xla`. Registered (bottom of this module)
as ``"mosaic_gpu"`` on GPU, by name until :data:`VERIFIED` names a GPU, and
``"mosaic_gpu_interpret"``. Tests: ``tests/test_pallas_mgpu_ragged.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax.pallas_kernels import _attention_common, _registration
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as paged

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked in
# the Mosaic GPU interpreter and lowered for H100 without a device; no GPU has run it).
VERIFIED: dict[str, str] = {}


def items_of(cu_q_lens, kv_lengths, num_seqs, *, total_tokens: int, block_q: int,
             capacity: int):
    """The items of a ragged step (``min(total_tokens, ceil(total_tokens / block_q) +
    max_seqs)``: each used one holds a row): int32 ``[items]`` each of ``(seq, first_row,
    rows, length, seq_end)``, the item's sequence, its first packed row and row count, the
    sequence's length (``kv_lengths`` clamped to ``[0, capacity]``) and the end of its rows.
    An unused item has 0 rows and length 0."""
    max_seqs = kv_lengths.shape[0]
    items = min(total_tokens, -(-total_tokens // block_q) + max_seqs)  # >= 1 row each
    cu = jnp.asarray(cu_q_lens).astype(jnp.int32)
    n = jnp.clip(jnp.asarray(num_seqs).astype(jnp.int32), 0, max_seqs)
    active = jnp.arange(max_seqs) < n
    # Rows past the packed array do not exist; a decreasing cu_q_lens gives no rows.
    start = jnp.clip(cu[:-1], 0, total_tokens)
    end = jnp.clip(cu[1:], start, total_tokens)
    q_lens = jnp.where(active, end - start, 0)
    chunks = -(-q_lens // block_q)  # [max_seqs]
    chunk_end = jnp.cumsum(chunks)
    w = jnp.arange(items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(chunk_end, w, side="right").astype(jnp.int32),
                      max_seqs - 1)
    used = w < chunk_end[-1]
    chunk = w - (chunk_end[seq] - chunks[seq])
    first = start[seq] + chunk * block_q
    rows = jnp.where(used, jnp.clip(end[seq] - first, 0, block_q), 0)
    lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, capacity)
    return seq, first, rows, jnp.where(used, lengths[seq], 0), end[seq]


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "block_kv", "stages", "num_splits",
    "interpret", "attention_chunk_size"))
def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens, num_seqs,
                           *, scale=None, sliding_window=None, logits_soft_cap=None,
                           block_kv=None, stages=None, num_splits=None, interpret=False,
                           k_scales=None, v_scales=None, sinks=None,
                           attention_chunk_size=None):
    """Ragged paged attention (see :func:`forge_jax.ragged_paged_attention` for the contract).

    Args:
      q: ``[total_tokens, q_heads, head_dim]``, the sequences' new tokens, packed.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, ``q``'s dtype; or
        the int8/fp8 values of quantized pools (:mod:`forge_jax.ops.kv_quant`) with
      k_scales, v_scales: float32 ``[kv_heads, num_pages, page_size, 1]``, a scale per slot.
      block_tables: int ``[max_seqs, pages_per_seq]``.
      kv_lengths: int ``[max_seqs]``; cu_q_lens: int ``[max_seqs + 1]``; num_seqs: int
        scalar (may be traced).
      scale, sliding_window, logits_soft_cap, sinks, attention_chunk_size: as in the op
        (the sinks join in the merge of the splits; each row's chunk is masked in the
        kernel, the item's first chunk starts its key range).
      block_kv, stages, num_splits: the paged kernel's launch knobs.
      interpret: run in the Mosaic GPU interpreter (any platform).

    Returns:
      ``[total_tokens, q_heads, head_dim]`` in ``q.dtype``.
    """
    total_tokens, q_heads, head_dim = q.shape
    kv_heads, num_pages, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = block_tables.shape
    if total_tokens == 0 or max_seqs == 0:
        return jnp.zeros(q.shape, q.dtype)
    group = q_heads // kv_heads
    block_q = paged.ROWS // group
    if scale is None:
        scale = head_dim ** -0.5
    with jax.named_scope("ragged_paged_attention"):
        seq, first, rows, lengths, end = items_of(
            cu_q_lens, kv_lengths, num_seqs, total_tokens=total_tokens, block_q=block_q,
            capacity=pages_per_seq * page_size)
        j = jnp.arange(block_q, dtype=jnp.int32)
        valid = j[None, :] < rows[:, None]  # [items, block_q]
        token = jnp.where(valid, first[:, None] + j[None, :], total_tokens)
        positions = lengths[:, None] - (end[:, None] - token)
        # A row past the item's rows repeats its first position (it changes no key range)
        # and is then marked padding (-1, it sees no key).
        positions = jnp.where(valid, positions, positions[:, :1])
        positions = jnp.where(rows[:, None] > 0, positions, -1)
        window, key_lo, key_hi, row_pos, tables = _attention_common.paged_ranges(
            positions, lengths, block_tables[seq], q_len=block_q, group=group,
            rows_pad=paged.ROWS, page_size=page_size, num_pages=num_pages,
            sliding_window=sliding_window, table_width=pages_per_seq,
            attention_chunk_size=attention_chunk_size)
        row_valid = jnp.pad(jnp.repeat(valid, group, axis=1),
                            ((0, 0), (0, paged.ROWS - block_q * group)))
        row_pos = jnp.where(row_valid, row_pos, -1)
        one_position = (rows == 1).astype(jnp.int32)
        ranges = jnp.stack([key_lo, key_hi, one_position, jnp.zeros_like(key_lo)], axis=1)
        compute = q.dtype if k_scales is not None else k_pages.dtype
        q_items = jnp.take(q.astype(compute), token, axis=0, mode="fill",
                           fill_value=0)  # [items, block_q, q_heads, head_dim]
        qg = _attention_common.group_queries(q_items, kv_heads, rows_pad=paged.ROWS)
        out_rows = -(-block_q * group // 8) * 8
        extras = {}
        if sinks is not None:  # [kv_heads, ROWS]: row r of every item is head h * group + r % group
            extras["sinks"] = jnp.pad(
                jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, 1, group),
                         (1, block_q, 1)).reshape(kv_heads, block_q * group),
                ((0, 0), (0, paged.ROWS - block_q * group)))
        out = paged.attend(qg, row_pos, ranges, tables, k_pages, v_pages, scale=scale,
                           sliding_window=window, logits_soft_cap=logits_soft_cap,
                           out_rows=out_rows, block_kv=block_kv, stages=stages,
                           num_splits=num_splits, interpret=interpret, k_scales=k_scales,
                           v_scales=v_scales, attention_chunk_size=attention_chunk_size,
                           **extras)
        out = _attention_common.ungroup_queries(out, q_len=block_q, q_heads=q_heads,
                                                head_dim=head_dim)
        # Each packed row belongs to one item at most; rows of none stay zero.
        packed = jnp.zeros((total_tokens, q_heads, head_dim), jnp.float32)
        packed = packed.at[token.reshape(-1)].set(out.reshape(-1, q_heads, head_dim),
                                                  mode="drop")
    return packed.astype(q.dtype)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel compiles for these arguments (compute capability 9.0+) without
    register spills, else why not (the launch compiles the several-positions path whatever
    the step holds)."""
    q, k_pages = args["q"], args["k_pages"]
    if (reason := _mosaic.wgmma_reason()) is not None:
        return reason
    group = q.shape[1] // k_pages.shape[0]
    if group > paged.ROWS:
        return (f"q_heads // kv_heads = {group} > {paged.ROWS}: one program holds one WGMMA "
                "tile of a group's rows")
    quantized = args.get("k_scales") is not None
    return paged.layout_reason(q_dtype=q.dtype, kv_dtype=k_pages.dtype, head_dim=q.shape[-1],
                               page_size=k_pages.shape[2], quantized=quantized) or \
        paged.register_reason(head_dim=q.shape[-1], quantized=quantized,
                              several_positions=True)


_registration.register(
    "ragged_paged_attention", ragged_paged_attention, backend="mosaic_gpu", supports=supports,
    verified=VERIFIED, reads_sinks=True, reads_chunks=True,
    description="per-sequence query blocks of a mixed batch in one launch of the paged "
                "Mosaic kernel")
