"""Folded page pools: pages of narrow heads stored with whole 128-lane rows, for TPU.

Why
---
On TPU, XLA lays out a pool ``[kv_heads, num_pages, page_size, head_dim]`` whose
``head_dim`` is less than a 128-lane tile (64: SmolLM2, Llama-3.2-1B) pages-minor
(``{1,3,2,0}``, so that no row is padded to 128 lanes), while the Pallas TPU paged kernel
reads pages row-major: a compiled decode step copied every layer's pool per step (found
by :func:`forge_jax.aot.compile`). A folded pool has whole-tile rows, so XLA's
default layout is the row-major one the kernel reads.

Representation
--------------
A :class:`FoldedPages` holds ``data [kv_heads, num_pages, page_size // fold, fold *
head_dim]`` with ``fold = 128 // head_dim``: row ``t`` of a page holds the ``fold``
consecutive tokens ``fold * t + r`` side by side, token ``fold * t + r`` in lanes ``[r *
head_dim, (r + 1) * head_dim)`` (the row-major reshape of the logical page, so
:func:`unfold` is a reshape). Its ``shape`` and ``dtype`` are the logical pool's, so the
ops validate it as any pool; ``head_dim`` is static, so a folded pool is never mistaken for
a logical one of another shape.

The ops (:func:`forge_jax.paged_write`, :func:`forge_jax.paged_attention`,
:func:`forge_jax.ragged_paged_attention`, :func:`forge_jax.paged_gather`,
:func:`forge_jax.copy_pages`) take a folded pool wherever they take a float one (K and V
both folded alike) and keep their logical contract. They hand implementations the stored
``data`` as ``k_pages``/``v_pages`` and ``fold=<fold>`` beside them (nothing for an
unfolded pool, so implementations that never see folded pools keep their signatures); an
implementation registered without ``reads_folded`` refuses such a call in its
``supports``. The XLA implementations read the logical view (:func:`unfold`); the TPU paged
kernel reads the folded rows in place. Quantized pools are never folded.

:meth:`forge_jax.kv_cache.PagedKVCache.create` folds only where the implementation of
``paged_attention`` that dispatch would choose reads folded pools in place (a TPU kernel):
default behaviour on CPU and GPU is unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LANES = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FoldedPages:
    """A page pool stored folded (see the module docstring).

    Attributes:
      data: ``[kv_heads, num_pages, page_size // fold, fold * head_dim]``, float.
      head_dim: static, the logical head_dim (``fold = data.shape[3] // head_dim``).
    """

    data: Any
    head_dim: int = dataclasses.field(metadata=dict(static=True))

    @property
    def fold(self) -> int:
        return self.data.shape[3] // self.head_dim

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical pool's shape, ``[kv_heads, num_pages, page_size, head_dim]``."""
        h, n, rows, _ = self.data.shape
        return (h, n, rows * self.fold, self.head_dim)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.data.dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"FoldedPages(shape={self.shape}, fold={self.fold}, dtype={self.dtype.name})"


def is_folded(pool: Any) -> bool:
    return isinstance(pool, FoldedPages)


def fold_factor(head_dim: int, page_size: int) -> int:
    """Tokens per 128-lane row for pages of ``page_size`` tokens of ``head_dim``: ``128 //
    head_dim`` where ``head_dim`` divides 128 (and is less) and ``page_size`` is a multiple
    of that, else 1 (not foldable)."""
    if head_dim >= LANES or LANES % head_dim:
        return 1
    fold = LANES // head_dim
    return fold if page_size % fold == 0 else 1


def fold(pages: jax.Array) -> FoldedPages:
    """Logical ``pages [kv_heads, num_pages, page_size, head_dim]`` as a folded pool; a
    ValueError naming the shape where it cannot fold (:func:`fold_factor`)."""
    if not hasattr(pages, "reshape"):
        raise ValueError(f"only float pools fold, got a {type(pages).__name__} (quantized "
                         "pools keep the logical layout)")
    h, n, page_size, head_dim = pages.shape
    f = fold_factor(head_dim, page_size)
    if f == 1:
        raise ValueError(f"a pool of {pages.shape=} cannot fold: head_dim must be less than "
                         f"and divide {LANES}, and page_size a multiple of {LANES} // head_dim")
    return FoldedPages(jnp.reshape(pages, (h, n, page_size // f, f * head_dim)), head_dim)


def unfold(data: jax.Array, fold: int) -> jax.Array:
    """Stored ``data [kv_heads, num_pages, rows, fold * head_dim]`` as the logical pool
    ``[kv_heads, num_pages, rows * fold, head_dim]`` (a reshape)."""
    h, n, rows, lanes = data.shape
    return jnp.reshape(data, (h, n, rows * fold, lanes // fold))


def logical(pool: Any) -> Any:
    """The logical pool of ``pool`` (``pool`` itself unless folded)."""
    return unfold(pool.data, pool.fold) if is_folded(pool) else pool


def pool_parts(k_pool: Any, v_pool: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``(k, v, extra)``: the stored arrays and the implementations' extra arguments
    (``{"fold": fold}`` for folded pools, ``{}`` else). Both folded alike, or neither."""
    kf, vf = is_folded(k_pool), is_folded(v_pool)
    if not kf and not vf:
        return k_pool, v_pool, {}
    if kf != vf or k_pool.data.shape != v_pool.data.shape or k_pool.fold != v_pool.fold:
        raise ValueError(f"k_pages and v_pages must both be folded alike or neither, got "
                         f"{k_pool!r} and {v_pool!r}")
    return k_pool.data, v_pool.data, dict(fold=k_pool.fold)


def repack(k_like: Any, v_like: Any, out: tuple) -> tuple:
    """An implementation's ``(k, v)`` result as the caller's pools: folded where they are."""
    if not is_folded(k_like):
        return out
    k, v = out
    return FoldedPages(k, k_like.head_dim), FoldedPages(v, v_like.head_dim)


def write_rows(data: jax.Array, x: jax.Array, slots: jax.Array, fold: int) -> jax.Array:
    """``x [tokens, kv_heads, head_dim]`` written into folded ``data`` at logical ``slots``
    (negative or past the pool: dropped): a scatter of ``head_dim``-wide windows, one per
    token and head, at row ``offset // fold``, lane ``(offset % fold) * head_dim`` of the
    page; never a copy of the pool. (A window spanning the heads too made XLA's TPU scatter
    relayout the pool, a copy per write: found by :func:`forge_jax.aot.compile`.)"""
    kv_heads, num_pages, rows, _ = data.shape
    tokens, _, head_dim = x.shape
    page_size = rows * fold
    slots = slots.astype(jnp.int32)
    page = jnp.where(slots < 0, num_pages, slots // page_size)  # out of bounds: dropped
    offset = slots % page_size
    per_head = lambda v: jnp.broadcast_to(v[:, None], (tokens, kv_heads))  # noqa: E731
    heads = jnp.broadcast_to(jnp.arange(kv_heads, dtype=jnp.int32)[None, :], (tokens, kv_heads))
    index = jnp.stack([heads, per_head(page), per_head(offset // fold),
                       per_head((offset % fold) * head_dim)], axis=2)  # [tokens, kv_heads, 4]
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(2,), inserted_window_dims=(0, 1, 2),
        scatter_dims_to_operand_dims=(0, 1, 2, 3))
    return jax.lax.scatter(data, index, x.astype(data.dtype), numbers,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def stored(pool: Any) -> Any:
    """The array an implementation receives for ``pool``: a folded pool's ``data``."""
    return pool.data if is_folded(pool) else pool
