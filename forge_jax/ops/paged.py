"""Paged KV-cache ops: write tokens into pages, gather pages, attend over pages, copy pages.

A paged cache keeps each layer's keys (and values) in one pool of fixed-size pages,
``[kv_heads, num_pages, page_size, head_dim]`` (the layout of JAX's Pallas
``paged_attention``: a page of one head is a contiguous ``[page_size, head_dim]`` tile).
Sequence ``b`` owns the pages its block table names, in order: its token at position
``i`` lives in page ``block_tables[b, i // page_size]`` at offset ``i % page_size``, i.e.
in *slot* ``page * page_size + offset`` of the flattened pool. Which pages a sequence
owns is decided on the host by :class:`forge_jax.kv_cache.BlockManager`.

Indices and lengths (every paged op, every implementation, and
:func:`forge_jax.ragged_paged_attention`)
------------------------------------------------------------------------------------------
A sequence of length ``n`` *uses* the first ``ceil(n / page_size)`` entries of its block
table row; ``0 <= n <= max_pages * page_size`` (keys beyond the table do not exist). The
entries it uses must name pages of the pool, ``[0, num_pages)``; the entries past them may
hold anything (garbage, ``-1`` padding) and are never read. A write slot is
``page * page_size + offset`` in ``[0, num_pages * page_size)`` or negative (padding: the
token is skipped); a copy row is ``(src, dst)`` of pages in ``[0, num_pages)``, or has a
negative ``src`` (padding: skipped, whatever ``dst`` holds).

* **Concrete values** (NumPy arrays, JAX arrays outside ``jax.jit``) are checked before
  any work: a used entry outside the pool, a length outside ``[0, max_pages *
  page_size]``, a slot at or past ``num_pages * page_size`` or a non-padding copy row
  outside the pool raises ValueError naming the argument, the index and the value.
* **Traced values** cannot be checked at trace time, and never read or write a page the
  arguments do not name: a used entry outside the pool reads nothing (its slots are
  invisible to attention, exactly as if hidden by the mask, and zero in
  :func:`paged_gather`; never another page); a length is clamped into ``[0, max_pages *
  page_size]`` (the default positions follow the clamped length); an out-of-range slot
  writes nothing and an out-of-range copy row copies nothing.
* **Debug checks**: inside :func:`forge_jax.debug_checks`, traced values get the same
  checks as ``jax.experimental.checkify`` checks; ``checkify.checkify`` the jitted
  function to have them reported (see :func:`forge_jax.debug_checks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.ops import kv_fold, kv_quant
from forge_jax.ops._attention_math import (
    all_finite,
    check_dims,
    check_extras,
    check_heads,
    check_masking,
    check_table_values,
    check_tables,
    clamp_lengths,
    exact_logits,
    finite_keys,
    hide_from_decode,
    masked_probs,
    named_pages,
    pool_args,
    visible_mask,
    weighted_values,
)

# ---------------------------------------------------------------------------------------
# paged_write


def _paged_write_args(k_pages, v_pages, k, v, slots):
    k_pages, v_pages, scales = pool_args(k_pages, v_pages)
    _checks.array("k", k, ndim=3)
    _checks.array("v", v, ndim=3)
    _checks.array("slots", slots, ndim=1, kind="int")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape [tokens, kv_heads, head_dim]: "
                         f"{k.shape=}, {v.shape=}")
    _checks.same_dtype(("k", k), ("v", v))
    kv_heads, _, _, head_dim = k_pages.shape
    if tuple(k.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(
            f"k must be [tokens, kv_heads, head_dim] = [tokens, {kv_heads}, {head_dim}] to match "
            f"k_pages [kv_heads, num_pages, page_size, head_dim], got {k.shape=}, "
            f"{k_pages.shape=}")
    if slots.shape[0] != k.shape[0]:
        raise ValueError(f"slots must be [tokens] = ({k.shape[0]},), got {slots.shape=}")
    _check_slot_values(slots, k_pages.shape[1] * k_pages.shape[2])
    return dict(k_pages=kv_fold.stored(k_pages), v_pages=kv_fold.stored(v_pages), k=k, v=v,
                slots=slots, **scales)


def _check_slot_values(slots, capacity):
    rule = f"is past the pool (num_pages * page_size = {capacity} slots; negative = skip)"
    values = _checks.concrete_ints(slots)
    if values is not None:
        bad = np.flatnonzero(values >= capacity)
        if bad.size:
            t = int(bad[0])
            raise ValueError(f"slots[{t}]={values[t]} {rule}")
    elif _checks.debug_checks_enabled():
        bad = jnp.asarray(slots) >= capacity
        t = _checks.first_bad(bad)
        _checks.traced_check(~jnp.any(bad), f"slots[{{t}}]={{slot}} {rule}", t=t,
                             slot=jnp.asarray(slots)[t])


def paged_write(k_pages, v_pages, k, v, slots, *, implementation=None):
    """Writes one key/value vector per token into the page pools.

    ``k_pages[h, s // page_size, s % page_size] = k[t, h]`` for every token ``t`` with
    slot ``s = slots[t] >= 0`` (the same for ``v``). A negative slot means "skip this
    token" (padding). A slot at or beyond ``num_pages * page_size`` raises ValueError
    when ``slots`` is concrete and writes nothing when it is traced (the index contract
    in the docstring of :mod:`forge_jax.ops.paged`). If two tokens name the same slot,
    which one lands is unspecified. ``k`` and ``v`` are cast to the pages' dtype; into
    quantized pools (:mod:`forge_jax.ops.kv_quant`) each vector ``k[t, h]`` is quantized
    on its own and its scale written beside it.

    The op is pure; under ``jax.jit`` with the pages donated
    (``donate_argnames=("k_pages", "v_pages")`` or a donated cache pytree) XLA performs
    the scatter in place, so a write costs O(tokens), not a copy of the pool.

    Args:
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, same dtype, or
        both int8 or fp8 ``QuantizedArray`` pools (:mod:`forge_jax.ops.kv_quant`), or both
        ``FoldedPages`` (:mod:`forge_jax.ops.kv_fold`), written in their folded rows.
      k, v: ``[tokens, kv_heads, head_dim]``, one float dtype (any: they are stored in the
        pages' dtype, the cache's storage dtype; a k/v mix raises TypeError).
      slots: int ``[tokens]``, ``page * page_size + offset`` or negative to skip.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``(k_pages, v_pages)``, updated, with the input shapes and dtypes.
    """
    args = _paged_write_args(k_pages, v_pages, k, v, slots)
    out = dispatch.call("paged_write", args, implementation)
    return kv_fold.repack(k_pages, v_pages, kv_quant.repack(k_pages, v_pages, out))


def _paged_write_partition(args, config):
    """How ``paged_write`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    # Every replica of the pool (over the data axis) writes every token, so replicas
    # stay identical: the tokens are gathered over the data axis, split by head.
    h = sharding.divisible(config, config.tp_name, args["k_pages"].shape[0])
    ps, ts = P(h, None, None, None), P(None, h, None)
    specs = {"k_pages": ps, "v_pages": ps, "k": ts, "v": ts, "slots": P()}
    return _with_scale_specs(specs, args, ps), (ps,) * (4 if "k_scales" in args else 2)


def _with_scale_specs(specs, args, spec):
    """``specs`` with the scales of quantized pools split as their pages are."""
    if "k_scales" in args:
        specs = dict(specs, k_scales=spec, v_scales=spec)
    return specs


dispatch.define("paged_write", _paged_write_args, partition=_paged_write_partition)


def _scatter_tokens(pages, x, slots):
    kv_heads, num_pages, page_size, head_dim = pages.shape
    slots = slots.astype(jnp.int32)
    # Scatter into the 4-D pool by (page, offset): scattering into the pool reshaped to
    # [kv_heads, capacity, head_dim] made XLA on CPU copy the whole pool, several times,
    # whenever the step also read the pool (attention after the write).
    # Negative slots (skipped tokens) go out of bounds and are dropped: .at[] would wrap
    # them around. Slots past the pool land on pages >= num_pages, dropped too.
    page = jnp.where(slots < 0, num_pages, slots // page_size)
    x = jnp.swapaxes(x.astype(pages.dtype), 0, 1)  # [kv_heads, tokens, head_dim]
    return pages.at[:, page, slots % page_size].set(x, mode="drop")


@dispatch.register("paged_write", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="scatter by (page, offset), mode='drop'")
def paged_write_xla(k_pages, v_pages, k, v, slots, k_scales=None, v_scales=None, fold=1):
    k_pages, v_pages, k, v, slots = map(jnp.asarray, (k_pages, v_pages, k, v, slots))
    with jax.named_scope("paged_write"):
        if fold > 1:  # folded pools (kv_fold): head_dim-wide windows of 128-lane rows
            return (kv_fold.write_rows(k_pages, k, slots, fold),
                    kv_fold.write_rows(v_pages, v, slots, fold))
        if k_scales is None:
            return _scatter_tokens(k_pages, k, slots), _scatter_tokens(v_pages, v, slots)
        format = kv_quant.format_of(k_pages)
        (kq, ks), (vq, vs) = (kv_quant.quantize_vectors(x, format) for x in (k, v))
        return (_scatter_tokens(k_pages, kq, slots), _scatter_tokens(v_pages, vq, slots),
                _scatter_tokens(k_scales, ks, slots), _scatter_tokens(v_scales, vs, slots))


# ---------------------------------------------------------------------------------------
# paged_gather


def _paged_gather_args(pages, block_tables, lengths):
    scales = {}
    if kv_fold.is_folded(pages):
        _checks.array("pages", pages, ndim=4)
        check_tables(block_tables, lengths)
        check_table_values(block_tables, lengths, num_pages=pages.shape[1],
                           page_size=pages.shape[2])
        return dict(pages=pages.data, block_tables=block_tables, lengths=lengths,
                    fold=pages.fold)
    if kv_quant.is_quantized(pages):
        kv_quant.check_pool("pages", pages)
        pages, scales = pages.values, dict(scales=pages.scales)
    _checks.array("pages", pages, ndim=4, kind="any" if scales else "float")
    check_tables(block_tables, lengths)
    check_table_values(block_tables, lengths, num_pages=pages.shape[1],
                       page_size=pages.shape[2])
    return dict(pages=pages, block_tables=block_tables, lengths=lengths, **scales)


def paged_gather(pages, block_tables, lengths, *, implementation=None):
    """Gathers each sequence's pages into a dense ``[batch, seq, kv_heads, head_dim]`` array.

    ``out[b, i, h] = pages[h, block_tables[b, i // page_size], i % page_size]`` for
    ``i < lengths[b]`` and ``0`` for ``i >= lengths[b]``: whatever the unused tail of the
    last page or the unused block-table entries hold never reaches the result (unused
    entries may hold any value, even out of range). Only the pages the block tables name
    are read. The entries a sequence uses must name pages of the pool and
    ``0 <= lengths[b] <= max_pages * page_size``: concrete values that break this raise
    ValueError; traced ones give zeros for the slots of an out-of-range entry and clamp
    the lengths (the index contract in the docstring of :mod:`forge_jax.ops.paged`).

    Args:
      pages: ``[kv_heads, num_pages, page_size, head_dim]``, or an int8/fp8
        ``QuantizedArray`` pool (:mod:`forge_jax.ops.kv_quant`), gathered dequantized; or
        a ``FoldedPages`` pool (:mod:`forge_jax.ops.kv_fold`).
      block_tables: int ``[batch, max_pages]``, page indices in sequence order.
      lengths: int ``[batch]``, tokens of each sequence.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[batch, max_pages * page_size, kv_heads, head_dim]`` in ``pages.dtype``.
    """
    args = _paged_gather_args(pages, block_tables, lengths)
    return dispatch.call("paged_gather", args, implementation).astype(pages.dtype)


dispatch.define("paged_gather", _paged_gather_args)


def gather_pages(pages, block_tables, lengths, scales=None):
    """The XLA gather: ``[batch, max_pages * page_size, kv_heads, head_dim]``, zero past lengths
    (float32 dequantized values for a quantized pool's ``pages`` and ``scales``)."""
    pages = jnp.asarray(pages)
    lengths = clamp_lengths(lengths, block_tables.shape[1] * pages.shape[2])
    named, valid = named_pages(pages, block_tables, lengths)  # [h, b, s, d], [b, s]
    if scales is not None:
        named = kv_quant.dequantize_vectors(named, named_pages(scales, block_tables, lengths)[0])
    dense = jnp.transpose(named, (1, 2, 0, 3))  # [b, s, h, d]
    return jnp.where(valid[:, :, None, None], dense, jnp.zeros((), dense.dtype))


@dispatch.register("paged_gather", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp.take of the named pages, zeroed past lengths")
def paged_gather_xla(pages, block_tables, lengths, scales=None, fold=1):
    with jax.named_scope("paged_gather"):
        if fold > 1:
            pages = kv_fold.unfold(jnp.asarray(pages), fold)
        return gather_pages(pages, block_tables, lengths, scales)


# ---------------------------------------------------------------------------------------
# paged_attention


def _paged_attention_args(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                          q_positions=None, sliding_window=None, logits_soft_cap=None,
                          sinks=None, attention_chunk_size=None):
    _checks.array("q", q, ndim=(3, 4))
    k_pages, v_pages, scales = pool_args(k_pages, v_pages)
    check_tables(block_tables, lengths)
    batch = q.shape[0]
    q_len = 1 if q.ndim == 3 else q.shape[1]
    q_heads, head_dim = q.shape[-2:]
    check_dims(**{f"q_heads (q.shape[{q.ndim - 2}])": q_heads})
    kv_heads = k_pages.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"q and block_tables disagree on batch: {q.shape=}, "
                         f"{block_tables.shape=}")
    if head_dim != k_pages.shape[3]:
        raise ValueError(f"q and k_pages disagree on head_dim: {q.shape=}, {k_pages.shape=}")
    check_heads(q_heads, kv_heads, q.shape, k_pages.shape)
    check_table_values(block_tables, lengths, num_pages=k_pages.shape[1],
                       page_size=k_pages.shape[2])
    if q_positions is not None:
        _checks.array("q_positions", q_positions, ndim=(1, 2) if q.ndim == 3 else 2, kind="int")
        if q_positions.ndim == 1:
            q_positions = q_positions[:, None]
        if tuple(q_positions.shape) != (batch, q_len):
            raise ValueError(
                f"q_positions must be [batch, q_len] = {(batch, q_len)}, got {q_positions.shape=}")
    scale, sliding_window, logits_soft_cap = check_masking(
        scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    extras = check_extras(sinks=sinks, attention_chunk_size=attention_chunk_size,
                          q_heads=q_heads)
    return dict(q=q, k_pages=kv_fold.stored(k_pages), v_pages=kv_fold.stored(v_pages),
                block_tables=block_tables, lengths=lengths, scale=scale, q_positions=q_positions,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, **scales,
                **extras)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, q_positions=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    attention_chunk_size=None, implementation=None):
    """Attention of new queries over a paged KV cache (decode and chunked prefill).

    The same computation as :func:`forge_jax.attention` on the keys and values that
    :func:`paged_gather` would return, with ``kv_lengths=lengths`` (the attention
    contract in the docstring of :mod:`forge_jax.ops.attention`, which also defines the
    alignment, the NaN rules and what a kernel must do): query ``t`` of
    sequence ``b`` at absolute position ``p`` sees key ``j`` iff ``j <= p``,
    ``j < lengths[b]``, ``j > p - sliding_window`` (when given) and ``j // c == p // c``
    (``c = attention_chunk_size``, when given); logits are
    ``scale * q . k`` (soft-capped to ``cap * tanh(x / cap)`` when ``logits_soft_cap``
    is given), softmax and the weighted sum of values run in float32; query head ``h``
    reads kv head ``h // (q_heads // kv_heads)`` (GQA/MQA).

    ``lengths[b]`` counts the tokens in the cache *including* the new ones, so with
    the default positions the new queries are the last ``q_len`` tokens:
    ``p = lengths[b] - q_len + t`` (bottom-right alignment, per sequence). Only the
    first ``lengths[b]`` slots of a sequence are ever attended, whatever the rest of its
    last page or its unused block-table entries hold, and a slot hidden from a query (by
    the causal mask, the window or the length) never reaches its output even when it
    holds NaN or inf. A query that sees no key (e.g. ``lengths[b] == 0``) returns zeros.

    The entries a sequence uses must name pages of the pool and ``0 <= lengths[b] <=
    max_pages * page_size``. Concrete values that break this raise ValueError before any
    work; traced ones never read a page the table does not name: an out-of-range entry's
    slots are invisible (as if masked), and a length is clamped into range, positions
    included (the index contract in the docstring of :mod:`forge_jax.ops.paged`;
    :func:`forge_jax.debug_checks` reports traced violations through checkify).

    The pages may be stored in another dtype than ``q`` (e.g. a bfloat16 cache with
    float32 queries: a KV cache is storage under the dtype rule of :mod:`forge_jax.ops`);
    the math is float32 either way. They may be quantized, int8 or fp8 values with a scale
    per token and KV head (:mod:`forge_jax.ops.kv_quant`): the slots are dequantized as they
    are read, and a hidden slot's scale (NaN, say) is as invisible as its values.

    Implementations (``fj.explain("paged_attention", ...)`` says which runs): ``"xla"``,
    :func:`paged_attention_xla` below, the reference; the Pallas kernels
    ``pallas_kernels/gpu/paged_attention.py`` (Triton lowering),
    ``pallas_kernels/gpu/mosaic_paged_attention.py`` (Mosaic GPU, Hopper) and
    ``pallas_kernels/tpu/paged_attention.py`` (Mosaic), each with its ``Config``, tuned
    table and ``default_config``. Partition rule: :func:`_paged_attention_partition` below.
    Tests: ``tests/test_paged.py`` (this op), ``tests/cases/paged_base.py`` (the cases every
    kernel runs), ``tests/test_pallas_{gpu,mgpu,tpu}_paged.py`` (each kernel).

    Args:
      q: ``[batch, q_heads, head_dim]`` (decode: one new token per sequence) or
        ``[batch, q_len, q_heads, head_dim]``.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``,
        ``q_heads % kv_heads == 0``; or both int8/fp8 ``QuantizedArray`` pools, or both
        ``FoldedPages`` of that logical shape (:mod:`forge_jax.ops.kv_fold`).
      block_tables: int ``[batch, max_pages]``, each sequence's pages in order.
      lengths: int ``[batch]``, tokens in the cache per sequence, new ones included;
        in ``[0, max_pages * page_size]`` (keys beyond the block table do not exist).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      q_positions: optional int ``[batch, q_len]`` (``[batch]`` also accepted for 3-D
        ``q``), each query's absolute position; default ``lengths[b] - q_len + t``.
      sliding_window: optional positive int; a query sees itself and the
        ``sliding_window - 1`` keys before it.
      logits_soft_cap: optional positive float.
      sinks: optional float ``[q_heads]``, attention sinks (as :func:`forge_jax.attention`).
      attention_chunk_size: optional positive int, chunked attention (as
        :func:`forge_jax.attention`).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      The shape of ``q``, in ``q.dtype``.
    """
    args = _paged_attention_args(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                 q_positions=q_positions, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, sinks=sinks,
                                 attention_chunk_size=attention_chunk_size)
    return dispatch.call("paged_attention", args, implementation)


def _paged_attention_partition(args, config):
    """How ``paged_attention`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    q, pages = args["q"], args["k_pages"]  # q [batch, (len,) heads, dim]; pages [heads, ...]
    b = sharding.divisible(config, config.dp_name, q.shape[0])
    h = sharding.heads_axis(config, q.shape[-2], pages.shape[0])
    qs = P(b, *([None] * (q.ndim - 3)), h, None)
    ps = P(h, None, None, None)  # the pool is shared by all sequences: never split by batch
    specs = {"q": qs, "k_pages": ps, "v_pages": ps, "block_tables": P(b, None),
             "lengths": P(b)}
    if args["q_positions"] is not None:
        specs["q_positions"] = P(b, None)
    if args.get("sinks") is not None:
        specs["sinks"] = P(h)
    return _with_scale_specs(specs, args, ps), qs


dispatch.define("paged_attention", _paged_attention_args, partition=_paged_attention_partition)


@dispatch.register("paged_attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="gather the named pages, then dense masked attention")
def paged_attention_xla(q, k_pages, v_pages, block_tables, lengths, *, scale, q_positions,
                        sliding_window, logits_soft_cap, k_scales=None, v_scales=None, fold=1,
                        sinks=None, attention_chunk_size=None):
    q, lengths = jnp.asarray(q), jnp.asarray(lengths)
    if fold > 1:  # folded pools (kv_fold): read the logical view
        k_pages, v_pages = (kv_fold.unfold(jnp.asarray(x), fold) for x in (k_pages, v_pages))
    decode = q.ndim == 3
    if decode:
        q = q[:, None]
    batch, q_len = q.shape[:2]
    lengths = clamp_lengths(lengths, block_tables.shape[1] * k_pages.shape[2])
    if q_positions is None:
        q_positions = lengths[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    q_positions = jnp.asarray(q_positions)
    with jax.named_scope("paged_attention"):
        out = _attend_pages(q, (k_pages, k_scales), (v_pages, v_scales), block_tables,
                            lengths, scale=scale, q_positions=q_positions,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                            sinks=sinks, attention_chunk_size=attention_chunk_size)
    return out[:, 0] if decode else out


def _attend_pages(q, k_pool, v_pool, block_tables, lengths, *, scale, q_positions,
                  sliding_window, logits_soft_cap, sinks=None, attention_chunk_size=None):
    """:func:`attention_reference` over the pages the block tables name, kept head-major.
    ``k_pool``, ``v_pool``: ``(pages, scales)``, the scales None for a float pool.

    The gathered pages stay in the pool's layout, ``[kv_heads, batch, seq, head_dim]``,
    which is also the layout the per-head products want: going through the dense
    ``[batch, seq, kv_heads, head_dim]`` of :func:`gather_pages` cost two transposed
    copies of every layer's keys and values per decode step on CPU.
    """
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k_pool[0].shape[0]
    groups = q_heads // kv_heads
    if scale is None:
        scale = head_dim ** -0.5
    k, named = named_pages(k_pool[0], block_tables, lengths)  # [k, b, s, h], [b, s]
    v, _ = named_pages(v_pool[0], block_tables, lengths)
    if k_pool[1] is not None:  # quantized: dequantize the named slots only
        k = kv_quant.dequantize_vectors(k, named_pages(k_pool[1], block_tables, lengths)[0])
        v = kv_quant.dequantize_vectors(v, named_pages(v_pool[1], block_tables, lengths)[0])
    seq = k.shape[2]
    # Slots past the length or on an entry that names no page are invisible to every query.
    mask = visible_mask(q_positions, seq, causal=True, kv_lengths=None,
                        sliding_window=sliding_window,
                        attention_chunk_size=attention_chunk_size) & named[:, None, :]  # [b, t, s]
    if sinks is not None:
        sinks = jnp.asarray(sinks).reshape(kv_heads, 1, groups, 1, 1)
    qg = jnp.transpose(q.reshape(batch, q_len, kv_heads, groups, head_dim), (2, 0, 3, 1, 4))
    qg = qg.reshape(kv_heads, batch, groups * q_len, head_dim)

    def attend(k, v, exact):
        # exact: some named K/V entry is non-finite; several queries per sequence, so a slot
        # one query hides may be visible to another.
        bad_keys = None
        if exact:
            k, bad_keys = finite_keys(k)  # [k, b, s]
        logits = exact_logits("kbqh,kbsh->kbqs", qg, k)
        logits = logits.reshape(kv_heads, batch, groups, q_len, seq)
        if bad_keys is not None:
            logits = jnp.where(bad_keys[:, :, None, None, :], jnp.float32(jnp.nan), logits)
        probs = masked_probs(logits, mask[None, :, None], scale=scale,
                             logits_soft_cap=logits_soft_cap, sinks=sinks)  # [k, b, g, t, s]
        product = lambda values: jnp.einsum(
            "kbqs,kbsh->kbqh", probs.reshape(kv_heads, batch, groups * q_len, seq), values,
            preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST,
        ).reshape(kv_heads, batch, groups, q_len, head_dim)
        if not exact:
            return product(v.astype(jnp.float32))
        return weighted_values(
            product,
            lambda flags: jnp.einsum("bts,kbsh->kbth", mask.astype(jnp.float32), flags,
                                     precision=jax.lax.Precision.HIGHEST)[:, :, None],
            v)  # [k, b, g, t, h]

    if q_len == 1:
        # Decode: per-sequence hiding is exact, and the where fuses into the page gather.
        out = attend(*hide_from_decode(k, v, mask[None, :, 0, :, None]), False)
    else:
        out = jax.lax.cond(all_finite(k, v), lambda: attend(k, v, False),
                           lambda: attend(k, v, True))
    out = jnp.transpose(out, (1, 3, 0, 2, 4))
    return out.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------------------------------
# copy_pages


def _copy_pages_args(k_pages, v_pages, copies):
    k_pages, v_pages, scales = pool_args(k_pages, v_pages)
    _checks.array("copies", copies, ndim=2, kind="int")
    if copies.shape[1] != 2:
        raise ValueError(f"copies must be [n, 2] rows of (src, dst), got {copies.shape=}")
    _check_copy_values(copies, k_pages.shape[1])
    return dict(k_pages=kv_fold.stored(k_pages), v_pages=kv_fold.stored(v_pages),
                copies=copies, **scales)


def _check_copy_values(copies, num_pages):
    rule = f"names no page of the pool (num_pages={num_pages}; a row with src < 0 is padding)"
    values = _checks.concrete_ints(copies)
    if values is not None:
        # Rows with a negative src are padding, whatever their dst holds.
        bad = np.argwhere((values[:, :1] >= 0) & ((values < 0) | (values >= num_pages)))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise ValueError(f"copies[{i}, {j}]={values[i, j]} {rule}")
    elif _checks.debug_checks_enabled():
        copies = jnp.asarray(copies)
        bad = (copies[:, :1] >= 0) & ((copies < 0) | (copies >= num_pages))
        flat = _checks.first_bad(bad)
        i, j = flat // 2, flat % 2
        _checks.traced_check(~jnp.any(bad), f"copies[{{i}}, {{j}}]={{page}} {rule}", i=i, j=j,
                             page=copies[i, j])


def copy_pages(k_pages, v_pages, copies, *, implementation=None):
    """Copies whole pages, for copy-on-write of shared pages.

    ``k_pages[:, dst] = k_pages[:, src]`` (and the same for ``v_pages``) for every row
    ``(src, dst)`` of ``copies`` with ``src >= 0``; rows with a negative ``src`` are
    padding and skipped, so callers can pad ``copies`` to a fixed shape. In the other
    rows ``src`` and ``dst`` must name pages of the pool: concrete rows that do not raise
    ValueError, traced ones copy nothing (the index contract in the docstring of
    :mod:`forge_jax.ops.paged`). All sources are read before any destination is written;
    each destination should appear at most once (:class:`forge_jax.kv_cache.BlockManager`
    guarantees both). With the pages donated under ``jax.jit`` the copy is in place.

    Args:
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, same dtype; or both
        int8/fp8 ``QuantizedArray`` pools, whose scales are copied with their values; or
        both ``FoldedPages`` (:mod:`forge_jax.ops.kv_fold`).
      copies: int ``[n, 2]``, rows ``(src, dst)`` of page indices.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``(k_pages, v_pages)`` with the copies applied.
    """
    args = _copy_pages_args(k_pages, v_pages, copies)
    out = dispatch.call("copy_pages", args, implementation)
    return kv_fold.repack(k_pages, v_pages, kv_quant.repack(k_pages, v_pages, out))


def _copy_pages_partition(args, config):
    """How ``copy_pages`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    h = sharding.divisible(config, config.tp_name, args["k_pages"].shape[0])
    ps = P(h, None, None, None)
    return (_with_scale_specs({"k_pages": ps, "v_pages": ps, "copies": P()}, args, ps),
            (ps,) * (4 if "k_scales" in args else 2))


dispatch.define("copy_pages", _copy_pages_args, partition=_copy_pages_partition)


def _copy(pages, src, dst):
    rows = jnp.take(pages, src, axis=1, mode="clip")  # [kv_heads, n, page_size, head_dim]
    return pages.at[:, dst].set(rows, mode="drop")


@dispatch.register("copy_pages", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="gather the source pages, scatter to the destinations")
def copy_pages_xla(k_pages, v_pages, copies, k_scales=None, v_scales=None, fold=1):
    del fold  # a folded pool's pages are whole along axis 1 too: copied as stored
    k_pages, v_pages, copies = map(jnp.asarray, (k_pages, v_pages, copies))
    num_pages = k_pages.shape[1]
    copies = copies.astype(jnp.int32)
    src, dst = copies[:, 0], copies[:, 1]
    skip = (src < 0) | (src >= num_pages) | (dst < 0)
    # Skipped rows write out of bounds (dropped); .at[] would wrap a negative dst around.
    dst = jnp.where(skip, num_pages, dst)
    src = jnp.where(skip, 0, src)
    with jax.named_scope("copy_pages"):
        pools = (k_pages, v_pages) if k_scales is None else (k_pages, v_pages, k_scales, v_scales)
        return tuple(_copy(jnp.asarray(pool), src, dst) for pool in pools)


# The write-slot check, shared with the other ops that write pages (forge_jax.ops.mla).
check_slot_values = _check_slot_values
