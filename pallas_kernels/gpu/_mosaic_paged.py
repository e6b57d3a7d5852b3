"""What the Mosaic GPU paged-attention kernels share: Hopper's WGMMA kernel
(:mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention`) and Blackwell's tcgen05 decode
kernel (:mod:`forge_jax.pallas_kernels.gpu.mosaic_paged_attention_sm100`).

Both launch ``(items, kv_heads, splits)``: a program takes one GQA group's query rows of one
item and walks its split's key blocks (``block_kv`` keys, whole pages, each page copied in
place from the pool by its own TMA copy), then writes its unnormalised rows with their
running max and sum, which XLA merges with logsumexp weights. Here: the launch parameters
(:class:`Config`, :data:`TUNED`, :func:`config_for`), the split of the keys
(:func:`split_launch`), the program's key blocks and table entries (:func:`key_blocks`), the
pages they name (:func:`named_keys`, :func:`fetch_pages`), the masked logits
(:func:`masked_logits`), the split's write-back (:func:`write_split`) and the launch itself
(:func:`launch`). What each kernel multiplies with, and its limits, stay in its own module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from forge_jax import _compat
from forge_jax.pallas_kernels import _attention_common, _cost
from forge_jax.pallas_kernels.gpu import _common, _mosaic


@dataclasses.dataclass(frozen=True)
class Config:
    """A paged kernel's launch parameters: keys per block (whole pages, a multiple of 64),
    blocks in flight (the shared-memory ring) and the most splits of one item's keys
    (fewer when it has fewer blocks, or when the launch already fills the GPU)."""

    block_kv: int
    stages: int
    max_splits: int


# The Hopper kernel's launch parameters per device kind (:func:`_common.kind_row`), by head
# dim. Not measured (no GPU has run the kernels): a ring of four 64-key blocks (32 KiB of K
# and V each at head_dim 128) keeps ~96 KiB in flight per SM while one block is consumed,
# about what covers HBM latency at the H100's ~25 GB/s per SM; the splits fill the 132 SMs.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        # 128-key blocks at head_dim 64 took 255 registers and spilled 108 bytes (ptxas,
        # SmolLM2's decode, JAX 0.10.2); 64-key blocks: 220 then, 163 now, no spill.
        64: dict(block_kv=64, stages=4, max_splits=16),
        128: dict(block_kv=64, stages=4, max_splits=16),
        256: dict(block_kv=64, stages=2, max_splits=16),
    },
}

# The interpreter's: the smallest ring (its time goes into tracing every copy).
INTERPRET = dict(block_kv=64, stages=2, max_splits=2)


def config_for(tuned: Mapping[str, Any], interpret_row: Mapping[str, int],
               args: Mapping[str, Any], device_kind: str | None) -> Config:
    """The :class:`Config` of ``tuned`` (a kernel's table by device kind and head dim) for
    ``args["q"]`` on ``device_kind``; ``"interpret"``: ``interpret_row``."""
    if device_kind == "interpret":
        return Config(**interpret_row)
    return Config(**_common.tuned(tuned, device_kind, args["q"].shape[-1]))


def split_launch(tables, *, items: int, kv_heads: int, page_size: int, block_kv: int,
                 max_splits: int, target_programs: int, num_splits: int | None):
    """How the keys of each item split: ``(num_splits, blocks_per_split, tables)``, the
    tables padded with -1 to the pages of ``num_splits * blocks_per_split`` blocks. Without
    ``num_splits``: enough programs for ``target_programs``, at most ``max_splits``."""
    max_pages = tables.shape[1]
    num_blocks = max(1, -(-max_pages * page_size // block_kv))
    if num_splits is None:
        num_splits = max(1, min(max_splits, target_programs // max(items * kv_heads, 1)))
    num_splits = min(num_splits, num_blocks)
    blocks_per_split = -(-num_blocks // num_splits)
    width = num_splits * blocks_per_split * (block_kv // page_size)
    tables = jnp.pad(tables, ((0, 0), (0, width - max_pages)), constant_values=-1)
    return num_splits, blocks_per_split, tables


def key_blocks(range_ref, tables_ref, *, blocks_per_split: int, block_kv: int,
               page_size: int):
    """Kernel code: the program's ``(item, head, split)``, its item's keys ``[key_lo,
    key_hi)``, the first of its split's key blocks and their count, and ``entry(block,
    p)``, the table entry of the ``p``-th page of a block: ``(item, head, split, key_lo,
    key_hi, first, steps, entry)``."""
    pl = _compat.pallas()
    item, head, split = lax.axis_index("item"), lax.axis_index("head"), lax.axis_index("split")
    key_lo, key_hi = range_ref[item, 0], range_ref[item, 1]
    first = jnp.maximum(split * blocks_per_split, lax.div(key_lo, block_kv))
    last = jnp.minimum((split + 1) * blocks_per_split, pl.cdiv(key_hi, block_kv))
    pages_per_block = block_kv // page_size

    def entry(block, p):
        return tables_ref[item, block * pages_per_block + p]

    return item, head, split, key_lo, key_hi, first, jnp.maximum(last - first, 0), entry


def named_keys(key, entries: Sequence[Any], start, *, page_size: int, block_kv: int):
    """Kernel code: whether each key of the block at ``start`` lies on a page its entry
    names (an entry of -1 hides its page's keys). Comparisons of the keys with scalar
    bounds (no vector of scalar booleans)."""
    named = None
    for p, page in enumerate(entries):
        lo = start + p * page_size
        hidden_lo = jnp.where(page >= 0, start + block_kv, lo)
        outside = (key < hidden_lo) | (key >= lo + page_size)
        named = outside if named is None else named & outside
    return named


def masked_logits(s, pos, *, start, key_lo, key_hi, entries: Sequence[Any], layout,
                  sliding_window: int | None, logits_soft_cap: float | None, page_size: int,
                  block_kv: int, interpret: bool, attention_chunk_size: int | None = None):
    """Kernel code: the scaled logits ``s [rows, block_kv]`` of the key block at ``start``
    capped (``logits_soft_cap``) and hidden (``-inf``) where a row does not see the key:
    past its position ``pos [rows]``, outside ``[key_lo, key_hi)``, the window or the pages
    the block's ``entries`` name, or (``attention_chunk_size``) before its chunk. Returns
    ``(s, visible)``."""
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    rows = s.shape[0]
    key = start + _mosaic.iota(jnp.int32, (rows, block_kv), 1, layout, interpret=interpret)
    row_pos = lax.broadcast_in_dim(pos, (rows, block_kv), [0])
    visible = (key <= row_pos) & (key >= key_lo) & (key < key_hi)
    if sliding_window is not None:
        visible &= key > row_pos - sliding_window
    if attention_chunk_size is not None:  # causal: the chunk's end is past the row's key
        rem = lax.rem(pos, attention_chunk_size)  # truncates: floor(pos / size) * size below
        first = pos - jnp.where(rem < 0, rem + attention_chunk_size, rem)
        visible &= key >= lax.broadcast_in_dim(first, (rows, block_kv), [0])
    visible &= named_keys(key, entries, start, page_size=page_size, block_kv=block_kv)
    return jnp.where(visible, s, -jnp.inf), visible


def fetch_pages(entry: Callable[[int], Any], copies: Sequence[tuple[Any, Any, Any]], *,
                pages: int, head, slot, page_size: int) -> None:
    """Kernel code: one TMA copy per page of a key block (``entry(p)``: its ``p``-th entry
    of ``pages``) and per ``(pool, ring, barriers)`` of ``copies``: the entry's page (-1, no
    page: page 0, hidden by :func:`named_keys`) of ``pool[head]`` into its rows of
    ``ring[slot]``."""
    pl, plgpu = _compat.pallas(), _compat.pallas_mosaic_gpu()
    for p in range(pages):
        page = jnp.maximum(entry(p), 0)
        rows = pl.ds(p * page_size, page_size)
        for pool, ring, barriers in copies:
            plgpu.copy_gmem_to_smem(pool.at[head, page], ring.at[slot, rows], barriers.at[slot])


def write_split(m, l_sum, o_smem, ml_smem, outs, *, at, out_rows: int) -> None:
    """Kernel code: the split's rows (staged in ``o_smem``), running max ``m`` and sum
    ``l_sum`` copied to the outputs ``outs = (o_ref, m_ref, l_ref)`` at ``at = (item, head,
    split)``."""
    pl, plgpu = _compat.pallas(), _compat.pallas_mosaic_gpu()
    o_ref, m_ref, l_ref = outs
    ml_smem[0] = m
    ml_smem[1] = l_sum
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_rows)], o_ref.at[at])
    plgpu.copy_smem_to_gmem(ml_smem.at[0, pl.ds(0, out_rows)], m_ref.at[at])
    plgpu.copy_smem_to_gmem(ml_smem.at[1, pl.ds(0, out_rows)], l_ref.at[at])
    plgpu.wait_smem_to_gmem(0)


def launch(kernel, qg, row_pos, ranges, tables, k_pages, v_pages, *extra, name: str,
           num_splits: int, out_rows: int, keys: int, kv_bytes: int, interpret: bool,
           sinks=None):
    """Runs ``kernel`` over ``(items, kv_heads, num_splits)`` and merges its splits:
    ``[items, kv_heads, out_rows, head_dim]`` float32, normalised. ``extra``: more inputs
    after the pools; ``keys``: the keys of the unpadded tables; ``kv_bytes``: what the
    programs read of the pools; ``sinks``: float32 ``[kv_heads, rows >= out_rows]``, each
    row's sink logit, joined in the merge (:func:`_attention_common.merge_splits`)."""
    items, kv_heads, _, head_dim = qg.shape
    f32 = jnp.float32
    out_shape = (jax.ShapeDtypeStruct((items, kv_heads, num_splits, out_rows, head_dim), f32),
                 jax.ShapeDtypeStruct((items, kv_heads, num_splits, out_rows), f32),
                 jax.ShapeDtypeStruct((items, kv_heads, num_splits, out_rows), f32))
    call = _mosaic.mesh_kernel(
        kernel, out_shape=out_shape, grid=(items, kv_heads, num_splits),
        grid_names=("item", "head", "split"), name=name,
        cost_estimate=_cost.attention(
            queries=items * kv_heads * out_rows, keys=keys,
            head_dim=head_dim, io=(qg, row_pos, ranges, tables, *out_shape),
            kv_bytes=kv_bytes),
        compiler_params=_compat.pallas_mosaic_gpu().CompilerParams(approx_math=True),
        interpret=interpret)
    o, m, l_sum = call(qg, row_pos, ranges, tables, k_pages, v_pages, *extra)
    if sinks is not None:
        sinks = sinks[None, :, :out_rows]
    return _attention_common.merge_splits(o, m, l_sum, sinks)

