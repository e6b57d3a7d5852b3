"""The paged latent cache of multi-head latent attention (DeepSeek-V3, Kimi K2).

Per layer one pool of pages ``[num_pages, page_size, width]`` shared by all sequences and
heads (:mod:`forge_jax.ops.mla`; ``width`` is ``kv_lora_rank + rope_dim``, padded to whole
128-lane tiles on TPU, :func:`pool_width`): token ``i`` of sequence ``b`` is the vector
``[latent, k_pe]`` in page ``block_tables[b, i // page_size]`` at offset ``i %
page_size``. Pages are handed out by the same host-side
:class:`~forge_jax.kv_cache.BlockManager` as a K/V pool's (allocation, prefix sharing by
:meth:`~forge_jax.kv_cache.BlockManager.fork` and copy-on-write through
:meth:`PagedLatentCache.copy_pages`): a page id means the same tokens in either kind of pool.

Per token it stores ``kv_lora_rank + rope_dim`` values per layer, against ``2 * kv_heads *
head_dim`` for a K/V cache of the expanded heads (:func:`bytes_per_token` gives both).

The KV-cache contract (:mod:`forge_jax.kv_cache.contract`) for a latent cache: the one
shared "KV head" of the absorbed computation is the latent.

* ``write(layer, k, v, positions, valid)``: ``k`` is the latent ``[batch, t, 1,
  kv_lora_rank]`` (normalised ``kv_a_proj_with_mqa`` output), ``v`` the RoPE key ``[batch,
  t, 1, rope_dim]`` (rotated); stored side by side through :func:`forge_jax.mla_paged_write`.
* ``attend(layer, q, ..., up_proj=(w_uk, w_uv))``: ``q`` is ``concat(q_nope, q_pe)``
  ``[batch, t, heads, nope_dim + rope_dim]`` (DeepSeek's query, RoPE applied to its last
  ``rope_dim`` values), ``up_proj`` the heads' key and value up-projections ``w_uk
  [kv_lora_rank, heads, nope_dim]``, ``w_uv [kv_lora_rank, heads, v_dim]``; returns
  ``[batch, t, heads, v_dim]`` through :func:`forge_jax.mla_paged_attention`
  (weight-absorbed). Query ``t`` of row ``b`` sees positions ``j <= q_positions[b, t]``,
  ``j < kv_lengths[b]``, as every cache's attend.
* ``as_stored(x)``: ``x`` rounded to the pool's dtype (what attend reads), for a prefill
  that attends its own new latents with :func:`forge_jax.mla_attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _checks, targets
from forge_jax.kv_cache import _base
from forge_jax.ops.mla import mla_paged_attention, mla_paged_write
from forge_jax.ops.paged import copy_pages


def bytes_per_token(*, num_layers: int, kv_lora_rank: int, rope_dim: int, heads: int,
                    qk_head_dim: int, v_dim: int, dtype: Any = jnp.bfloat16) -> dict[str, int]:
    """Cache bytes per token of an MLA model, ``{"latent": ..., "expanded": ...}``: its
    latent pool (``kv_lora_rank + rope_dim`` values per layer) against a K/V cache of the
    same model's expanded heads (``heads * (qk_head_dim + v_dim)`` per layer)."""
    size = jnp.dtype(dtype).itemsize
    return {"latent": num_layers * (kv_lora_rank + rope_dim) * size,
            "expanded": num_layers * heads * (qk_head_dim + v_dim) * size}


def pool_width(kv_lora_rank: int, rope_dim: int, *, platform: str | None = None) -> int:
    """The last axis of a latent pool on ``platform`` (None: the current target's or JAX's):
    ``kv_lora_rank + rope_dim`` rounded up to whole 128-lane tiles on TPU (640 for
    DeepSeek-V3's 576: XLA lays a narrower pool out pages-minor, and the TPU kernel reading
    pages row-major would copy the pool per step), exact elsewhere."""
    platform = targets.platform() if platform is None else platform
    width = kv_lora_rank + rope_dim
    return -(-width // 128) * 128 if platform == "tpu" else width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """Per layer one latent page pool shared by all sequences, and a block table per sequence.

    Attributes:
      pages: tuple (one entry per layer) of ``[num_pages, page_size, width]`` arrays,
        ``width >= kv_lora_rank + rope_dim`` (:func:`pool_width`).
      block_tables: int32 ``[batch, max_pages]``.
      lengths: int32 ``[batch]``, tokens in each sequence before this step.
      kv_lora_rank, rope_dim: static, the widths of the latent and of the RoPE key after
        it in each stored vector.
    """

    pages: tuple[jax.Array, ...]
    block_tables: jax.Array
    lengths: jax.Array
    kv_lora_rank: int = dataclasses.field(metadata=dict(static=True))
    rope_dim: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(cls, *, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
               rope_dim: int, dtype: Any = jnp.float32, block_tables,
               lengths=None, width: int | None = None) -> PagedLatentCache:
        """An empty pool (zeros) with the given block tables (int ``[batch, max_pages]``);
        ``lengths`` (int ``[batch]``) defaults to zeros. ``width``: the pool's last axis,
        at least ``kv_lora_rank + rope_dim``; None decides by :func:`pool_width` (padded to
        whole 128-lane tiles on TPU)."""
        num_layers, shape, dtype = _base.geometry(num_layers, dict(
            num_pages=num_pages, page_size=page_size, kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim), dtype)
        num_pages, page_size, kv_lora_rank, rope_dim = shape
        if width is None:
            width = pool_width(kv_lora_rank, rope_dim)
        elif _checks.positive_int("width", width) < kv_lora_rank + rope_dim:
            raise ValueError(f"width must hold kv_lora_rank + rope_dim = {kv_lora_rank} + "
                             f"{rope_dim}, got {width=}")
        block_tables = _block_tables(block_tables)
        batch = block_tables.shape[0]
        lengths = (jnp.zeros((batch,), jnp.int32) if lengths is None
                   else _base.lengths_array("lengths", lengths, batch))
        pages = _base.zeros_per_layer(num_layers, (num_pages, page_size, width), dtype)
        return cls(pages=pages, block_tables=block_tables, lengths=lengths,
                   kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def num_pages(self) -> int:
        return self.pages[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.pages[0].shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.pages[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the pools, measured from the arrays."""
        return sum(int(p.nbytes) for p in self.pages)

    def slots(self, positions, valid) -> jax.Array:
        """int32 ``[batch, t]``: each token's slot, ``-1`` where it is not to be written
        (``valid`` False, a negative position, or beyond the block table)."""
        positions = jnp.asarray(positions, jnp.int32)
        index = positions // self.page_size
        keep = valid & (positions >= 0) & (index < self.max_pages)
        page = jnp.take_along_axis(self.block_tables, jnp.clip(index, 0, self.max_pages - 1),
                                   axis=1)
        return jnp.where(keep, page * self.page_size + positions % self.page_size, -1)

    def write(self, layer: int, k, v, positions, valid) -> PagedLatentCache:
        """Stores the latents ``k [batch, t, 1, kv_lora_rank]`` and RoPE keys ``v [batch, t,
        1, rope_dim]`` at ``positions [batch, t]`` of layer ``layer`` (tokens with ``valid``
        False, a negative position or one beyond the block table are skipped)."""
        layer = _base.layer_index(layer, self.num_layers)
        _checks.array("k", k, ndim=4)
        _checks.array("v", v, ndim=4)
        batch, t = k.shape[:2]
        if (batch, 1, self.kv_lora_rank) != (self.batch, *k.shape[2:]):
            raise ValueError(f"k (the latent) must be [batch, t, 1, kv_lora_rank] = "
                             f"[{self.batch}, t, 1, {self.kv_lora_rank}], got {k.shape=}")
        if tuple(v.shape) != (batch, t, 1, self.rope_dim):
            raise ValueError(f"v (the RoPE key) must be [batch, t, 1, rope_dim] = "
                             f"[{batch}, {t}, 1, {self.rope_dim}], got {v.shape=}")
        _checks.array("positions", positions, ndim=2, kind="int")
        _checks.array("valid", valid, ndim=2, kind="bool")
        if tuple(positions.shape) != (batch, t) or tuple(valid.shape) != (batch, t):
            raise ValueError(f"positions and valid must be [batch, t] = {(batch, t)}, got "
                             f"{positions.shape=}, {valid.shape=}")
        with jax.named_scope("kv_cache_write"):
            slots = self.slots(positions, valid).reshape(batch * t)
            pool = mla_paged_write(self.pages[layer], k.reshape(batch * t, -1),
                                   v.reshape(batch * t, -1).astype(k.dtype), slots)
        return dataclasses.replace(self, pages=_base.replace_layer(self.pages, layer, pool))

    def attend(self, layer: int, q, *, q_positions, kv_lengths, scale=None,
               sliding_window=None, logits_soft_cap=None, implementation=None,
               up_proj=None) -> jax.Array:
        """Multi-head latent attention of ``q = concat(q_nope, q_pe)`` ``[batch, t, heads,
        nope_dim + rope_dim]`` over layer ``layer``'s latents, weight-absorbed
        (:func:`forge_jax.mla_paged_attention`).

        Query ``t`` of row ``b`` at ``q_positions[b, t]`` sees the positions ``j <=
        q_positions[b, t]``, ``j < kv_lengths[b]``; a query at a negative position (or
        whose row is empty) returns zeros. Each query is one row of the ragged op, over its
        own row's block table and ``min(q_positions + 1, kv_lengths)`` tokens.

        Args:
          layer: static layer index.
          q: ``[batch, t, heads, nope_dim + rope_dim]``, RoPE applied to the last
            ``rope_dim`` values.
          q_positions: int ``[batch, t]``; kv_lengths: int ``[batch]``.
          scale: logit scale (default ``(nope_dim + rope_dim) ** -0.5``; DeepSeek with
            YaRN: :func:`forge_jax.ops.mla.yarn_softmax_scale`).
          sliding_window, logits_soft_cap: must be None (MLA models use neither).
          implementation: as in :func:`forge_jax.mla_paged_attention`.
          up_proj: ``(w_uk [kv_lora_rank, heads, nope_dim], w_uv [kv_lora_rank, heads,
            v_dim])``, required.

        Returns:
          ``[batch, t, heads, v_dim]`` in ``q.dtype``.
        """
        layer = _base.layer_index(layer, self.num_layers)
        check_attend_options(sliding_window, logits_soft_cap, up_proj)
        _checks.array("q", q, ndim=4)
        batch, t, heads, width = q.shape
        if batch != self.batch or width <= self.rope_dim:
            raise ValueError(f"q must be [batch, t, heads, nope_dim + rope_dim] with batch="
                             f"{self.batch} and rope_dim={self.rope_dim}, got {q.shape=}")
        _checks.array("q_positions", q_positions, ndim=2, kind="int")
        if tuple(q_positions.shape) != (batch, t):
            raise ValueError(f"q_positions must be [batch, t] = {(batch, t)}, "
                             f"got {q_positions.shape=}")
        kv = _base.lengths_array("kv_lengths", kv_lengths, batch)
        rows = batch * t
        # One ragged sequence per query: it sees exactly the first min(p + 1, kv) tokens
        # of its row, the causal mask of the contract.
        seen = jnp.clip(jnp.minimum(jnp.asarray(q_positions, jnp.int32) + 1, kv[:, None]),
                        0, self.max_pages * self.page_size).reshape(rows)
        # A row that sees nothing reads one key of page 0 (whatever its table holds), and
        # its output is zeroed below.
        tables = jnp.where((seen > 0)[:, None], jnp.repeat(self.block_tables, t, axis=0), 0)
        w_uk, w_uv = up_proj
        out = mla_paged_attention(
            q[..., :width - self.rope_dim].reshape(rows, heads, -1),
            q[..., width - self.rope_dim:].reshape(rows, heads, -1), self.pages[layer],
            w_uk, w_uv, tables, jnp.maximum(seen, 1), jnp.arange(rows + 1, dtype=jnp.int32),
            rows, scale=scale, implementation=implementation)
        # A query that sees nothing was given one key to keep the ragged layout valid.
        out = jnp.where((seen > 0)[:, None, None], out, jnp.zeros((), out.dtype))
        return out.reshape(batch, t, heads, -1)

    def as_stored(self, x: jax.Array) -> jax.Array:
        """``x`` rounded to the pool's dtype (what :meth:`attend` reads)."""
        return x.astype(self.dtype)

    def with_lengths(self, lengths) -> PagedLatentCache:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=_base.lengths_array("lengths", lengths,
                                                                     self.batch))

    def with_block_tables(self, block_tables) -> PagedLatentCache:
        """The same cache with ``block_tables`` replaced (lengths kept when the batch is)."""
        block_tables = _block_tables(block_tables)
        lengths = self.lengths
        if block_tables.shape[0] != lengths.shape[0]:
            lengths = jnp.zeros((block_tables.shape[0],), jnp.int32)
        return dataclasses.replace(self, block_tables=block_tables, lengths=lengths)

    def copy_pages(self, copies) -> PagedLatentCache:
        """Applies page copies (int ``[n, 2]`` rows ``(src, dst)``, e.g.
        :meth:`BlockManager.take_pending_copies`) to every layer's pool; negative ``src``
        rows are skipped. Apply them before writing the slots handed out with them."""
        copies = jnp.asarray(copies, jnp.int32).reshape(-1, 2)
        if copies.shape[0] == 0:
            return self
        # A latent pool is one [1, num_pages, page_size, width] "head": the layers go
        # through fj.copy_pages two by two (its K and V pools).
        pools = list(self.pages) + ([self.pages[-1]] if self.num_layers % 2 else [])
        copied = []
        for a, b in zip(pools[::2], pools[1::2], strict=True):
            new_a, new_b = copy_pages(a[None], b[None], copies)
            copied += [new_a[0], new_b[0]]
        return dataclasses.replace(self, pages=tuple(copied[:self.num_layers]))


def check_attend_options(sliding_window, logits_soft_cap, up_proj) -> None:
    """Refuses the options a latent cache's ``attend`` cannot honour, and a missing ``up_proj``."""
    if sliding_window is not None or logits_soft_cap is not None:
        raise ValueError(f"a latent cache takes no sliding_window or logits_soft_cap, got "
                         f"{sliding_window=}, {logits_soft_cap=}")
    if up_proj is None or len(up_proj) != 2:
        raise ValueError("a latent cache's attend needs up_proj=(w_uk, w_uv), the heads' "
                         f"key and value up-projections, got {up_proj=!r:.80}")


def _block_tables(block_tables) -> jax.Array:
    block_tables = jnp.asarray(block_tables)
    _checks.array("block_tables", block_tables, ndim=2, kind="int")
    return block_tables.astype(jnp.int32)
