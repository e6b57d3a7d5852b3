"""The paged KV cache: per layer one pool of pages shared by all sequences, and block tables."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _checks, targets
from forge_jax.kv_cache import _base
from forge_jax.kv_cache.spec import CacheSpec
from forge_jax.ops import kv_fold
from forge_jax.ops.paged import copy_pages, paged_attention, paged_write


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache(_base.KVCacheBase):
    """Per layer one pool of pages shared by all sequences, and a block table per sequence.

    Token ``i`` of sequence ``b`` lives in page ``block_tables[b, i // page_size]`` at
    offset ``i % page_size``: ``k_pages[layer][:, page, offset]``. Which pages a
    sequence owns is decided by :class:`BlockManager`; pass its
    ``block_tables(seq_ids, max_pages)`` to :meth:`with_block_tables`.

    Attributes:
      k_pages, v_pages: tuples (one entry per layer) of
        ``[kv_heads, num_pages, page_size, head_dim]`` arrays, or of int8/fp8
        ``QuantizedArray`` pools of that shape (:mod:`forge_jax.ops.kv_quant`), or of
        ``FoldedPages`` pools of that logical shape (:mod:`forge_jax.ops.kv_fold`: TPU,
        head_dim below 128).
      block_tables: int32 ``[batch, max_pages]``.
      lengths: int32 ``[batch]``, carried for the caller (see :meth:`with_lengths`).
      page_size: static.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, *, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
               head_dim: int, dtype: Any = jnp.float32, block_tables,
               lengths=None, quantize: str | None = None,
               fold: bool | None = None) -> PagedKVCache:
        """An empty pool (zeros) with the given block tables (int ``[batch, max_pages]``).

        ``lengths`` (int ``[batch]``) defaults to zeros. ``quantize``: ``"int8"`` or
        ``"fp8"`` for quantized pools with a scale per token and KV head, standing for
        ``dtype`` (:mod:`forge_jax.ops.kv_quant`); None for float pools of ``dtype``.
        ``fold``: store the pools folded, whole 128-lane rows of ``128 // head_dim`` tokens
        (:mod:`forge_jax.ops.kv_fold`); None (the default) decides by :func:`stores_folded`
        from the cache's spec and the platform: on TPU where the TPU kernel reads such
        pools, never on CPU or GPU.
        """
        num_layers, shape, dtype = _base.geometry(num_layers, dict(
            kv_heads=kv_heads, num_pages=num_pages, page_size=page_size, head_dim=head_dim),
            dtype)
        block_tables = _block_tables(block_tables)
        batch = block_tables.shape[0]
        lengths = (jnp.zeros((batch,), jnp.int32) if lengths is None
                   else _base.lengths_array("lengths", lengths, batch))
        if fold is None:
            spec = CacheSpec(kind="paged", page_size=shape[2], dtype=dtype, kv_dtype=quantize)
            fold = stores_folded(spec, head_dim=shape[3])
        elif fold:
            _check_fold(shape, quantize)
        if fold:
            pools = (tuple(kv_fold.fold(jnp.zeros(shape, dtype)) for _ in range(num_layers))
                     for _ in "kv")
        else:
            pools = (_base.zeros_per_layer(num_layers, shape, dtype, quantize) for _ in "kv")
        k_pages, v_pages = pools
        return cls(k_pages=k_pages, v_pages=v_pages, block_tables=block_tables,
                   lengths=lengths, page_size=shape[2])

    @property
    def folded(self) -> bool:
        """Whether the pools are stored folded (:mod:`forge_jax.ops.kv_fold`)."""
        return kv_fold.is_folded(self.k_pages[0])

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k_pages[0].shape[0]

    def slots(self, positions, valid) -> jax.Array:
        """int32 ``[batch, t]``: the slot of each token, ``-1`` where it is not to be written.

        A token is skipped when ``valid`` is False, its position is negative, or it lies
        beyond the block table (``position >= max_pages * page_size``).
        """
        positions = jnp.asarray(positions, jnp.int32)
        index = positions // self.page_size  # [batch, t] index into the block table
        keep = valid & (positions >= 0) & (index < self.max_pages)
        page = jnp.take_along_axis(jnp.asarray(self.block_tables, jnp.int32),
                                   jnp.clip(index, 0, self.max_pages - 1), axis=1)
        return jnp.where(keep, page * self.page_size + positions % self.page_size, -1)

    def _kv(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        return self.k_pages, self.v_pages

    def _with_kv(self, k, v) -> PagedKVCache:
        return dataclasses.replace(self, k_pages=k, v_pages=v)

    def _write_layer(self, layer, k, v, positions, valid) -> tuple[jax.Array, jax.Array]:
        batch, t = k.shape[:2]
        with jax.named_scope("kv_cache_write"):
            slots = self.slots(positions, valid).reshape(batch * t)
            new_k, new_v = paged_write(
                self.k_pages[layer], self.v_pages[layer],
                k.reshape(batch * t, self.kv_heads, self.head_dim),
                v.reshape(batch * t, self.kv_heads, self.head_dim), slots)
        return new_k, new_v

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None, sinks=None,
               attention_chunk_size=None):
        """:func:`forge_jax.paged_attention` of ``q`` over layer ``layer``'s pages.

        Same semantics as :meth:`ContiguousKVCache.attend`: query ``t`` of sequence
        ``b`` at ``q_positions[b, t]`` sees keys ``j <= q_positions[b, t]``,
        ``j < kv_lengths[b]``. The math is float32 whatever the cache dtype; the result
        is in ``q.dtype``.

        Args:
          layer: static layer index.
          q: ``[batch, t, q_heads, head_dim]``.
          q_positions: int ``[batch, t]``.
          kv_lengths: int ``[batch]``, valid tokens per sequence (the new ones included).
          scale, sliding_window, logits_soft_cap, implementation, sinks,
            attention_chunk_size: as in ``fj.paged_attention``.

        Returns:
          ``[batch, t, q_heads, head_dim]`` in ``q.dtype``.
        """
        layer = _base.layer_index(layer, self.num_layers)
        return paged_attention(q, self.k_pages[layer], self.v_pages[layer], self.block_tables,
                               kv_lengths, scale=scale, q_positions=q_positions,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               implementation=implementation, sinks=sinks,
                               attention_chunk_size=attention_chunk_size)

    def with_block_tables(self, block_tables) -> PagedKVCache:
        """The same cache with ``block_tables`` (int ``[batch, max_pages]``) replaced.

        The batch may change (e.g. after sequences finish); then pass matching
        ``lengths`` with :meth:`with_lengths` (lengths are kept only when the batch is).
        """
        block_tables = _block_tables(block_tables)
        lengths = self.lengths
        if block_tables.shape[0] != lengths.shape[0]:
            lengths = jnp.zeros((block_tables.shape[0],), jnp.int32)
        return dataclasses.replace(self, block_tables=block_tables, lengths=lengths)

    def copy_pages(self, copies) -> PagedKVCache:
        """Applies page copies (int ``[n, 2]`` rows ``(src, dst)``, e.g.
        :meth:`BlockManager.take_pending_copies`) to every layer; negative ``src`` rows
        are skipped. Apply them before writing the slots handed out with them."""
        copies = jnp.asarray(copies, jnp.int32).reshape(-1, 2)
        if copies.shape[0] == 0:
            return self
        pairs = [copy_pages(k, v, copies) for k, v in zip(self.k_pages, self.v_pages,
                                                          strict=True)]
        return dataclasses.replace(self, k_pages=tuple(k for k, _ in pairs),
                                   v_pages=tuple(v for _, v in pairs))


def _check_fold(shape, quantize) -> None:
    _, _, page_size, head_dim = shape
    if quantize is not None:
        raise ValueError(f"fold=True with quantize={quantize!r}: quantized pools are not folded")
    if kv_fold.fold_factor(head_dim, page_size) == 1:
        raise ValueError(f"fold=True needs head_dim < 128 dividing 128 and page_size a multiple "
                         f"of 128 // head_dim, got {head_dim=}, {page_size=}")


def stores_folded(spec: CacheSpec, *, head_dim: int, platform: str | None = None) -> bool:
    """Whether a paged cache of ``spec`` with heads of ``head_dim`` stores its pools folded
    by default (:mod:`forge_jax.ops.kv_fold`), on ``platform`` (None: the current target's
    or JAX's, :func:`forge_jax.targets.platform`).

    Folded exactly when all hold: the platform is TPU (elsewhere XLA's layout of a narrow
    pool needs no folding); the values are float32 or bfloat16 (``spec.kv_dtype`` None:
    quantized pools are never folded, and the TPU kernel reads no float16); ``head_dim``
    divides 128 and is less, and ``spec.page_size`` is a multiple of ``fold = 128 //
    head_dim`` (:func:`forge_jax.ops.kv_fold.fold_factor`) giving a multiple of 8 stored rows
    per page (what the TPU paged kernel reads in place). Every implementation takes a folded
    pool (XLA's through a reshape), so the choice is a layout, never a correctness, one.
    ``spec.dtype`` None stands for float32.
    """
    platform = targets.platform() if platform is None else platform
    dtype = jnp.dtype(jnp.float32 if spec.dtype is None else spec.dtype)
    fold = kv_fold.fold_factor(_checks.positive_int("head_dim", head_dim), spec.page_size)
    return (platform == "tpu" and spec.kv_dtype is None and fold > 1
            and dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
            and (spec.page_size // fold) % 8 == 0)


def _block_tables(block_tables) -> jax.Array:
    block_tables = jnp.asarray(block_tables)
    _checks.array("block_tables", block_tables, ndim=2, kind="int")
    return block_tables.astype(jnp.int32)
