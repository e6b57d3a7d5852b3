"""Multi-head latent attention (MLA): attention through a compressed, shared key-value latent.

DeepSeek-V2/V3 (and Kimi K2) compress each token's keys and values into one latent vector
``c [kv_lora_rank]`` (the RMS-normalised output of ``kv_a_proj_with_mqa``), shared by every
head, beside a small RoPE key ``k_pe [rope_dim]`` also shared by the heads. Head ``h``'s key
and value are

    ``k[h] = concat(c @ w_uk[:, h], k_pe)``, ``v[h] = c @ w_uv[:, h]``

(``w_uk [kv_lora_rank, heads, nope_dim]`` and ``w_uv [kv_lora_rank, heads, v_dim]`` are
``kv_b_proj`` split by head), and the query of head ``h`` is ``concat(q_nope[h], q_pe[h])``.
So a cache needs only ``kv_lora_rank + rope_dim`` values per token (576 for DeepSeek-V3, for
128 heads whose expanded K and V would take ``128 * (192 + 128)``).

Two ops, one computation:

* :func:`mla_attention`, the prefill form over dense latents: the XLA implementation expands
  the latent to per-head keys and values, as the formula above reads.
* :func:`mla_paged_attention`, decode and mixed prefill/decode steps over a **paged latent
  pool** ``[num_pages, page_size, width]`` (token ``i`` of a sequence in page
  ``block_tables[b, i // page_size]`` at offset ``i % page_size``, the latent first, the RoPE
  key after it, then ``width - kv_lora_rank - rope_dim`` padding lanes, as
  :func:`mla_paged_write` stores them), for ragged batches laid out
  as :func:`forge_jax.ragged_paged_attention` takes them. It computes *weight-absorbed*:
  ``q_nope[h] . (c @ w_uk[:, h]) = (w_uk[:, h] @ q_nope[h]) . c``, so each query is
  multiplied into the latent space once (``q_latent [heads, kv_lora_rank]``), attention runs
  as one-KV-head attention over the stored ``[latent, k_pe]`` vectors with the latent as its
  value, and the latent output is up-projected per head by ``w_uv`` at the end. The pool is
  never expanded.

The pool's width may exceed ``kv_lora_rank + rope_dim``: on TPU the latent cache pads it to
whole 128-lane tiles (640 for DeepSeek-V3's 576), since XLA lays out a 576-wide pool with the
pages minor and a kernel reading pages row-major would copy the pool per step; the padding
lanes are never read.

The softmax scale
-----------------
``scale`` defaults to ``(nope_dim + rope_dim) ** -0.5``. DeepSeek-V3 with YaRN rope scaling
(``rope_scaling.type == "yarn"``, factor ``s > 1``) multiplies it by ``mscale ** 2`` where
``mscale = 0.1 * mscale_all_dim * ln(s) + 1`` (its ``yarn_get_mscale(s, mscale_all_dim)``):
``scale = qk_head_dim ** -0.5 * mscale ** 2``, passed by the caller. (The RoPE angles' own
YaRN attention factor is applied to cos/sin, not here.)

Masking follows the attention contract of :mod:`forge_jax.ops.attention` (bottom-right
positions, invisible slots never reach the output whatever they hold, visible NaN
propagates, a query that sees nothing returns zeros), and the paged index rules of
:mod:`forge_jax.ops.paged` and :func:`forge_jax.ragged_paged_attention`.

Implementations: ``"xla"`` below (the references); the Pallas kernels for the paged form,
``pallas_kernels/tpu/mla_paged_attention.py`` (Mosaic TPU) and
``pallas_kernels/gpu/mla_paged_attention.py`` (Triton lowering). Tests:
``tests/test_mla.py``, ``tests/test_mla_kernels.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.ops._attention_math import (
    check_dims,
    default_positions,
    exact_logits,
    finite_keys,
    masked_probs,
    visible_mask,
    weighted_values,
)
from forge_jax.ops.paged import check_slot_values
from forge_jax.ops.ragged import (
    check_num_seqs,
    check_ragged_values,
    ragged_paged_attention_xla,
    token_rows,
)
from forge_jax.ops.rope import yarn_mscale

_HIGHEST = jax.lax.Precision.HIGHEST


def yarn_softmax_scale(qk_head_dim: int, factor: float = 1.0,
                       mscale_all_dim: float = 0.0) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` with
    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when YaRN scales the RoPE
    (``factor > 1`` and ``mscale_all_dim`` nonzero), as its attention computes it."""
    qk_head_dim = _checks.positive_int("qk_head_dim", qk_head_dim)
    scale = qk_head_dim ** -0.5
    if mscale_all_dim:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


# ---------------------------------------------------------------------------------------
# Shared argument checks and the absorbed computation's two projections


def _check_weights(w_uk, w_uv, *, heads, nope_dim, kv_lora_rank):
    _checks.array("w_uk", w_uk, ndim=3)
    _checks.array("w_uv", w_uv, ndim=3)
    if tuple(w_uk.shape[:2]) != (kv_lora_rank, heads) or w_uk.shape[2] != nope_dim:
        raise ValueError(f"w_uk must be [kv_lora_rank, heads, nope_dim] = [{kv_lora_rank}, "
                         f"{heads}, {nope_dim}], got {w_uk.shape=}")
    if tuple(w_uv.shape[:2]) != (kv_lora_rank, heads):
        raise ValueError(f"w_uv must be [kv_lora_rank, heads, v_dim] = [{kv_lora_rank}, "
                         f"{heads}, v_dim], got {w_uv.shape=}")
    check_dims(**{"v_dim (w_uv.shape[2])": w_uv.shape[2]})


def _check_queries(q_nope, q_pe, ndim):
    _checks.array("q_nope", q_nope, ndim=ndim)
    _checks.array("q_pe", q_pe, ndim=ndim)
    _checks.same_dtype(("q_nope", q_nope), ("q_pe", q_pe))
    if tuple(q_nope.shape[:-1]) != tuple(q_pe.shape[:-1]):
        raise ValueError(f"q_nope and q_pe must agree on all but the last axis: "
                         f"{q_nope.shape=}, {q_pe.shape=}")
    check_dims(**{"heads": q_nope.shape[-2], "nope_dim (q_nope.shape[-1])": q_nope.shape[-1],
                  "rope_dim (q_pe.shape[-1])": q_pe.shape[-1]})


def absorb_queries(q_nope, q_pe, w_uk):
    """float32 ``[..., heads, kv_lora_rank + rope_dim]``: each head's query in the latent
    space, ``concat(w_uk[:, h] @ q_nope[..., h], q_pe[..., h])``, so that its dot product
    with a stored ``[c, k_pe]`` vector is the expanded ``q . k[h]``."""
    q_latent = jnp.einsum("...hd,chd->...hc", q_nope.astype(jnp.float32),
                          w_uk.astype(jnp.float32), precision=_HIGHEST)
    return jnp.concatenate([q_latent, q_pe.astype(jnp.float32)], axis=-1)


def up_project(out_latent, w_uv, dtype):
    """``[..., heads, v_dim]`` in ``dtype``: each head's latent output ``[..., heads,
    kv_lora_rank]`` (float32) times its ``w_uv[:, h]``, the value up-projection."""
    out = jnp.einsum("...hc,chd->...hd", out_latent.astype(jnp.float32),
                     w_uv.astype(jnp.float32), precision=_HIGHEST)
    return out.astype(dtype)


# ---------------------------------------------------------------------------------------
# mla_attention (dense latents: prefill)


def _mla_attention_args(q_nope, q_pe, latent, k_pe, w_uk, w_uv, *, scale=None, causal=True,
                        q_positions=None, kv_lengths=None):
    _check_queries(q_nope, q_pe, 4)
    _checks.array("latent", latent, ndim=3)
    _checks.array("k_pe", k_pe, ndim=3)
    _checks.same_dtype(("latent", latent), ("k_pe", k_pe))
    batch, q_len, heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[3]
    if latent.shape[0] != batch:
        raise ValueError(f"q_nope and latent disagree on batch: {q_nope.shape=}, "
                         f"{latent.shape=}")
    if tuple(k_pe.shape) != (batch, latent.shape[1], rope_dim):
        raise ValueError(f"k_pe must be [batch, kv_len, rope_dim] = "
                         f"{(batch, latent.shape[1], rope_dim)} (latent and q_pe), "
                         f"got {k_pe.shape=}")
    check_dims(**{"kv_lora_rank (latent.shape[2])": latent.shape[2]})
    _check_weights(w_uk, w_uv, heads=heads, nope_dim=nope_dim, kv_lora_rank=latent.shape[2])
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal=!r}")
    if q_positions is not None:
        _checks.array("q_positions", q_positions, ndim=2, kind="int")
        if tuple(q_positions.shape) != (batch, q_len):
            raise ValueError(f"q_positions must be [batch, q_len] = {(batch, q_len)}, "
                             f"got {q_positions.shape=}")
    if kv_lengths is not None:
        _checks.array("kv_lengths", kv_lengths, ndim=1, kind="int")
        if kv_lengths.shape[0] != batch:
            raise ValueError(f"kv_lengths must be [batch] = ({batch},), got {kv_lengths.shape=}")
        values, kv_len = _checks.concrete_ints(kv_lengths), latent.shape[1]
        if values is not None and ((values < 0) | (values > kv_len)).any():
            b = int(np.flatnonzero((values < 0) | (values > kv_len))[0])
            raise ValueError(f"kv_lengths[{b}]={values[b]} must lie in [0, kv_len={kv_len}] "
                             f"(latent.shape[1])")
    if scale is not None:
        scale = _checks.number("scale", scale)
    return dict(q_nope=q_nope, q_pe=q_pe, latent=latent, k_pe=k_pe, w_uk=w_uk, w_uv=w_uv,
                scale=scale, causal=bool(causal), q_positions=q_positions,
                kv_lengths=kv_lengths)


def mla_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, *, scale=None, causal=True,
                  q_positions=None, kv_lengths=None, implementation=None):
    """Multi-head latent attention over dense latents (prefill, or a whole sequence).

    ``out[b, t, h] = sum_j softmax_j(scale * (q_nope[b, t, h] . (latent[b, j] @ w_uk[:, h])
    + q_pe[b, t, h] . k_pe[b, j])) * (latent[b, j] @ w_uv[:, h])`` over the keys ``j`` the
    query sees, as :func:`forge_jax.attention` defines it (bottom-right positions: ``p =
    q_positions[b, t]``, else ``kv_lengths[b] - q_len + t``, else ``kv_len - q_len + t``;
    ``j <= p`` when ``causal``, ``j < kv_lengths[b]`` when given). Float32 math; invisible
    latent slots never reach the output, whatever they hold.

    Args:
      q_nope: ``[batch, q_len, heads, nope_dim]``, the queries' non-rotary part.
      q_pe: ``[batch, q_len, heads, rope_dim]``, the rotary part (RoPE applied); the dtype
        of ``q_nope``.
      latent: ``[batch, kv_len, kv_lora_rank]``, the normalised compressed KV (storage: any
        float dtype, shared with ``k_pe``).
      k_pe: ``[batch, kv_len, rope_dim]``, the RoPE key shared by the heads.
      w_uk: ``[kv_lora_rank, heads, nope_dim]``, the key up-projection (``kv_b_proj``'s key
        rows, by head); a parameter, any float dtype.
      w_uv: ``[kv_lora_rank, heads, v_dim]``, the value up-projection.
      scale: logit scale, default ``(nope_dim + rope_dim) ** -0.5`` (for DeepSeek with
        YaRN, :func:`yarn_softmax_scale`; see the module docstring).
      causal: whether query ``t`` sees only keys at or before its position.
      q_positions: optional int ``[batch, q_len]``.
      kv_lengths: optional int ``[batch]`` in ``[0, kv_len]``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[batch, q_len, heads, v_dim]`` in ``q_nope.dtype``.
    """
    args = _mla_attention_args(q_nope, q_pe, latent, k_pe, w_uk, w_uv, scale=scale,
                               causal=causal, q_positions=q_positions, kv_lengths=kv_lengths)
    return dispatch.call("mla_attention", args, implementation)


def _heads_spec(config, heads):
    return sharding.divisible(config, config.tp_name, heads)


def _mla_attention_partition(args, config):
    """Heads split over the tensor axis (the latent is shared, so replicated)."""
    h = _heads_spec(config, args["q_nope"].shape[2])
    q, w = P(None, None, h, None), P(None, h, None)
    specs = {"q_nope": q, "q_pe": q, "latent": P(), "k_pe": P(), "w_uk": w, "w_uv": w}
    for name in ("q_positions", "kv_lengths"):
        if args[name] is not None:
            specs[name] = P()
    return specs, q


dispatch.define("mla_attention", _mla_attention_args, partition=_mla_attention_partition)


@dispatch.register("mla_attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="latent expanded to per-head keys and values; masked float32 "
                               "softmax")
def mla_attention_xla(q_nope, q_pe, latent, k_pe, w_uk, w_uv, *, scale, causal, q_positions,
                      kv_lengths):
    batch, q_len, heads, nope_dim = q_nope.shape
    kv_len = latent.shape[1]
    if scale is None:
        scale = (nope_dim + q_pe.shape[3]) ** -0.5
    with jax.named_scope("mla_attention"):
        f32 = lambda x: jnp.asarray(x).astype(jnp.float32)  # noqa: E731
        # Hidden latent slots may hold NaN: zero the non-finite ones for the products and
        # make their logits NaN (visible ones propagate, hidden ones are masked).
        kv, bad = finite_keys(jnp.concatenate([f32(latent), f32(k_pe)], axis=-1))
        c, pe = kv[..., :latent.shape[2]], kv[..., latent.shape[2]:]
        k_nope = jnp.einsum("bsc,chd->bshd", c, f32(w_uk), precision=_HIGHEST)
        v = jnp.einsum("bsc,chd->bshd", c, f32(w_uv), precision=_HIGHEST)  # [b, s, h, v_dim]
        logits = (exact_logits("bthd,bshd->bhts", f32(q_nope), k_nope)
                  + exact_logits("bthd,bsd->bhts", f32(q_pe), pe))
        logits = jnp.where(bad[:, None, None, :], jnp.float32(jnp.nan), logits)
        lengths = None if kv_lengths is None else jnp.clip(
            jnp.asarray(kv_lengths).astype(jnp.int32), 0, kv_len)
        positions = (default_positions(batch, q_len, kv_len, lengths) if q_positions is None
                     else jnp.asarray(q_positions))
        mask = visible_mask(positions, kv_len, causal=causal, kv_lengths=lengths,
                            sliding_window=None)[:, None]  # [b, 1, t, s]
        probs = masked_probs(logits, mask, scale=scale, logits_soft_cap=None)
        out = weighted_values(
            lambda v: jnp.einsum("bhts,bshd->bthd", probs, v, precision=_HIGHEST),
            lambda flags: jnp.einsum("bhts,bshd->bthd", mask.astype(jnp.float32), flags),
            v)
        return out.astype(q_nope.dtype)


# ---------------------------------------------------------------------------------------
# mla_paged_write


def _check_pool(latent_pages):
    _checks.array("latent_pages", latent_pages, ndim=3)
    check_dims(**{f"{name} (latent_pages.shape[{i}])": latent_pages.shape[i]
                  for i, name in enumerate(("num_pages", "page_size", "latent_dim"))})


def _mla_paged_write_args(latent_pages, latent, k_pe, slots):
    _check_pool(latent_pages)
    _checks.array("latent", latent, ndim=2)
    _checks.array("k_pe", k_pe, ndim=2)
    _checks.same_dtype(("latent", latent), ("k_pe", k_pe))
    _checks.array("slots", slots, ndim=1, kind="int")
    tokens = latent.shape[0]
    if k_pe.shape[0] != tokens or slots.shape[0] != tokens:
        raise ValueError(f"latent, k_pe and slots must agree on tokens: {latent.shape=}, "
                         f"{k_pe.shape=}, {slots.shape=}")
    if latent.shape[1] + k_pe.shape[1] > latent_pages.shape[2]:
        raise ValueError(f"latent_pages' last axis must hold kv_lora_rank + rope_dim = "
                         f"{latent.shape[1]} + {k_pe.shape[1]}, got {latent_pages.shape=}")
    check_slot_values(slots, latent_pages.shape[0] * latent_pages.shape[1])
    return dict(latent_pages=latent_pages, latent=latent, k_pe=k_pe, slots=slots)


def mla_paged_write(latent_pages, latent, k_pe, slots, *, implementation=None):
    """Writes each token's ``[latent, k_pe]`` vector into the latent page pool.

    ``latent_pages[s // page_size, s % page_size] = concat(latent[t], k_pe[t], 0...)`` (zeros
    in the padding lanes of a wider pool) for every token ``t`` with slot ``s = slots[t] >=
    0``; a negative slot skips the token; a slot at
    or past ``num_pages * page_size`` raises ValueError when concrete and writes nothing
    when traced (:mod:`forge_jax.ops.paged`'s index contract). Stored in the pool's dtype.
    Donate the pool under ``jax.jit`` for an in-place scatter.

    Args:
      latent_pages: ``[num_pages, page_size, width]``, ``width >= kv_lora_rank + rope_dim``.
      latent: ``[tokens, kv_lora_rank]``; k_pe: ``[tokens, rope_dim]``, one float dtype.
      slots: int ``[tokens]``, ``page * page_size + offset`` or negative to skip.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      The updated pool, its shape and dtype.
    """
    args = _mla_paged_write_args(latent_pages, latent, k_pe, slots)
    return dispatch.call("mla_paged_write", args, implementation)


dispatch.define("mla_paged_write", _mla_paged_write_args,
                partition=lambda args, config: (dict.fromkeys(args, P()), P()))


@dispatch.register("mla_paged_write", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="scatter by (page, offset), mode='drop'")
def mla_paged_write_xla(latent_pages, latent, k_pe, slots):
    latent_pages = jnp.asarray(latent_pages)
    num_pages, page_size, _ = latent_pages.shape
    with jax.named_scope("mla_paged_write"):
        x = jnp.concatenate([jnp.asarray(latent), jnp.asarray(k_pe)], axis=-1)
        x = jnp.pad(x, ((0, 0), (0, latent_pages.shape[2] - x.shape[1])))
        slots = jnp.asarray(slots).astype(jnp.int32)
        # Negative slots go to page num_pages (out of bounds, dropped; .at[] would wrap).
        page = jnp.where(slots < 0, num_pages, slots // page_size)
        return latent_pages.at[page, slots % page_size].set(x.astype(latent_pages.dtype),
                                                            mode="drop")


# ---------------------------------------------------------------------------------------
# mla_paged_attention (paged latents: decode and mixed steps)


def _mla_paged_args(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                    cu_q_lens, num_seqs, *, scale=None):
    _check_queries(q_nope, q_pe, 3)
    _check_pool(latent_pages)
    total_tokens, heads, nope_dim = q_nope.shape
    rope_dim = q_pe.shape[2]
    _checks.array("w_uk", w_uk, ndim=3)
    kv_lora_rank = w_uk.shape[0]
    check_dims(**{"kv_lora_rank (w_uk.shape[0])": kv_lora_rank})
    if kv_lora_rank + rope_dim > latent_pages.shape[2]:
        raise ValueError(f"latent_pages' last axis must hold kv_lora_rank + rope_dim = "
                         f"{kv_lora_rank} (w_uk.shape[0]) + {rope_dim} (q_pe.shape[2]), got "
                         f"{latent_pages.shape=}")
    _check_weights(w_uk, w_uv, heads=heads, nope_dim=nope_dim, kv_lora_rank=kv_lora_rank)
    _checks.array("block_tables", block_tables, ndim=2, kind="int")
    _checks.array("kv_lengths", kv_lengths, ndim=1, kind="int")
    _checks.array("cu_q_lens", cu_q_lens, ndim=1, kind="int")
    max_seqs = block_tables.shape[0]
    if kv_lengths.shape[0] != max_seqs:
        raise ValueError(f"kv_lengths must be [max_seqs] = ({max_seqs},) to match block_tables "
                         f"[max_seqs, pages_per_seq], got {kv_lengths.shape=}, "
                         f"{block_tables.shape=}")
    if cu_q_lens.shape[0] != max_seqs + 1:
        raise ValueError(f"cu_q_lens must be [max_seqs + 1] = ({max_seqs + 1},) to match "
                         f"block_tables [max_seqs, pages_per_seq], got {cu_q_lens.shape=}, "
                         f"{block_tables.shape=}")
    num_seqs = check_num_seqs(num_seqs, max_seqs)
    if scale is not None:
        scale = _checks.number("scale", scale)
    check_ragged_values(block_tables, kv_lengths, cu_q_lens, num_seqs, total_tokens=total_tokens,
                  num_pages=latent_pages.shape[0], page_size=latent_pages.shape[1])
    return dict(q_nope=q_nope, q_pe=q_pe, latent_pages=latent_pages, w_uk=w_uk, w_uv=w_uv,
                block_tables=block_tables, kv_lengths=kv_lengths, cu_q_lens=cu_q_lens,
                num_seqs=num_seqs, scale=scale)


def mla_paged_attention(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                        cu_q_lens, num_seqs, *, scale=None, implementation=None):
    """Multi-head latent attention of a ragged batch of new tokens over a paged latent pool.

    The rows and sequences are laid out as :func:`forge_jax.ragged_paged_attention` takes
    them: sequence ``i < num_seqs`` owns the query rows ``cu_q_lens[i]:cu_q_lens[i + 1]``, its
    last tokens, whose latents are already in its pages, ``kv_lengths[i]`` tokens in all;
    row ``r`` sits at position ``p = kv_lengths[i] - (cu_q_lens[i + 1] - r)`` and sees the
    keys ``j <= p``. With ``[c_j, kpe_j] = latent_pages[block_tables[i, j // page_size], j %
    page_size]`` (``c_j`` its first ``kv_lora_rank`` values), it computes, weight-absorbed,

    ``q_lat[r, h] = w_uk[:, h] @ q_nope[r, h]``,
    ``o[r, h] = sum_j softmax_j(scale * (q_lat[r, h] . c_j + q_pe[r, h] . kpe_j)) * c_j``,
    ``out[r, h] = o[r, h] @ w_uv[:, h]``,

    which equals :func:`mla_attention` on the sequence's latents (the expanded form). Float32
    math. The masking, padding (rows from ``cu_q_lens[num_seqs]`` on return zeros; ignored
    sequences' entries are never read) and index rules are those of
    :func:`forge_jax.ragged_paged_attention`: whatever the slots a query does not see hold
    (NaN included) never reaches its output; concrete arguments are checked, traced ones
    clamped.

    Args:
      q_nope: ``[total_tokens, heads, nope_dim]``; q_pe: ``[total_tokens, heads, rope_dim]``,
        the same dtype (RoPE applied).
      latent_pages: ``[num_pages, page_size, width]``, ``width >= kv_lora_rank + rope_dim``
        (lanes past them are padding, never read), any float dtype (storage), written by
        :func:`mla_paged_write`.
      w_uk: ``[kv_lora_rank, heads, nope_dim]``; w_uv: ``[kv_lora_rank, heads, v_dim]``.
      block_tables: int ``[max_seqs, pages_per_seq]``.
      kv_lengths: int ``[max_seqs]``, tokens in the cache per sequence, new ones included.
      cu_q_lens: int ``[max_seqs + 1]``, starting at 0, non-decreasing.
      num_seqs: int scalar (Python int or int32 array, possibly traced).
      scale: logit scale, default ``(nope_dim + rope_dim) ** -0.5`` (YaRN: see the module
        docstring and :func:`yarn_softmax_scale`).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[total_tokens, heads, v_dim]`` in ``q_nope.dtype``.
    """
    args = _mla_paged_args(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                           cu_q_lens, num_seqs, scale=scale)
    return dispatch.call("mla_paged_attention", args, implementation)


def _mla_paged_partition(args, config):
    """Heads split over the tensor axis; the latent pool (shared by the heads) replicated."""
    h = _heads_spec(config, args["q_nope"].shape[1])
    q, w = P(None, h, None), P(None, h, None)
    specs = {"q_nope": q, "q_pe": q, "latent_pages": P(), "w_uk": w, "w_uv": w,
             "block_tables": P(), "kv_lengths": P(), "cu_q_lens": P()}
    if isinstance(args["num_seqs"], jax.Array | np.ndarray):
        specs["num_seqs"] = P()
    return specs, q


dispatch.define("mla_paged_attention", _mla_paged_args, partition=_mla_paged_partition)


def query_rows(block_tables, kv_lengths, cu_q_lens, num_seqs, *, total_tokens, num_pages,
               page_size):
    """Each query row of a ragged step as one decode row: ``(tables, seen)``.

    ``seen`` int32 ``[total_tokens]``: the keys row ``r`` sees are exactly the first
    ``seen[r]`` of its sequence (its position + 1; 0 for padding rows and rows at a
    negative position). ``tables`` int32 ``[total_tokens, pages_per_seq]``: its sequence's
    block table, ``-1`` in every entry the row does not use or that names no page of the
    pool (such slots are invisible). What the kernels read instead of the ragged layout.
    """
    capacity = block_tables.shape[1] * page_size
    seq, _, positions = token_rows(block_tables, kv_lengths, cu_q_lens, num_seqs,
                                   total_tokens, capacity)
    seen = jnp.clip(positions + 1, 0, capacity).astype(jnp.int32)
    tables = jnp.asarray(block_tables).astype(jnp.int32)[seq]  # [rows, pages_per_seq]
    entry = jnp.arange(tables.shape[1], dtype=jnp.int32)[None, :]
    named = (entry * page_size < seen[:, None]) & (tables >= 0) & (tables < num_pages)
    return jnp.where(named, tables, -1), seen


def default_scale(q_nope, q_pe, scale):
    """``scale``, or ``(nope_dim + rope_dim) ** -0.5`` when None."""
    return (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5 if scale is None else scale


@dispatch.register("mla_paged_attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="queries absorbed into the latent; one-KV-head ragged paged "
                               "attention over the pool; values up-projected")
def mla_paged_attention_xla(q_nope, q_pe, latent_pages, w_uk, w_uv, block_tables, kv_lengths,
                            cu_q_lens, num_seqs, *, scale):
    kv_lora_rank = w_uk.shape[0]
    with jax.named_scope("mla_paged_attention"):
        q = absorb_queries(q_nope, q_pe, w_uk)  # [tokens, heads, kv_lora_rank + rope_dim]
        # One KV head, the latent its own value; padding lanes dropped.
        pool = jnp.asarray(latent_pages)[None, :, :, :q.shape[-1]]
        out = ragged_paged_attention_xla(
            q, pool, pool, block_tables, kv_lengths, cu_q_lens, num_seqs,
            scale=default_scale(q_nope, q_pe, scale), sliding_window=None,
            logits_soft_cap=None)
        return up_project(out[..., :kv_lora_rank], w_uv, q_nope.dtype)
