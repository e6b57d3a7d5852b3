"""The masking math of attention, shared by the dense, paged and ragged ops (and the
kernels' XLA-side bookkeeping): argument checks, visibility masks, default positions,
NaN-safe probabilities and value products, and the page-table reads of a paged KV pool.

Private to ``forge_jax.ops``: the public contract is :mod:`forge_jax.ops.attention`'s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks
from forge_jax.ops import kv_fold, kv_quant
from forge_jax.ops.activation import safe_softmax_f32

# ---------------------------------------------------------------------------------------
# Argument checks


def check_masking(*, scale, sliding_window, logits_soft_cap):
    """Validates the static masking arguments shared by dense and paged attention."""
    if scale is not None:
        scale = _checks.number("scale", scale)
        if not math.isfinite(scale):  # would make every output NaN
            raise ValueError(f"scale must be a finite number (or None: 1/sqrt(head_dim)), "
                             f"got {scale=}")
    sliding_window = _checks.positive_int("sliding_window", sliding_window, allow_none=True)
    logits_soft_cap = _checks.positive_float("logits_soft_cap", logits_soft_cap, allow_none=True)
    return scale, sliding_window, logits_soft_cap


def check_extras(*, sinks, attention_chunk_size, q_heads):
    """Validates the optional sinks (float ``[q_heads]``) and chunk size (positive int);
    returns the ``{"sinks": ..., "attention_chunk_size": ...}`` entries of an op's
    arguments that are given. (Absent entries keep the arguments of calls without them
    as they were, so that a kernel that does not read them sees no new keys.)"""
    extras = {}
    if sinks is not None:
        _checks.array("sinks", sinks, ndim=1, kind="float")
        if tuple(sinks.shape) != (q_heads,):
            raise ValueError(f"sinks must be [q_heads] = ({q_heads},), got {sinks.shape=}")
        extras["sinks"] = sinks
    if attention_chunk_size is not None:
        extras["attention_chunk_size"] = _checks.positive_int(
            "attention_chunk_size", attention_chunk_size)
    return extras


def extras_reason(args, *, sinks: bool = False, chunks: bool = False) -> str | None:
    """Why an implementation that reads sinks only if ``sinks`` and the chunked mask only
    if ``chunks`` cannot serve ``args``; None if it can."""
    if not sinks and args.get("sinks") is not None:
        return "sinks= (attention sinks) are not implemented in this kernel"
    if not chunks and args.get("attention_chunk_size") is not None:
        return "attention_chunk_size= (chunked attention) is not implemented in this kernel"
    return None


def check_heads(q_heads, kv_heads, q_shape, kv_shape):
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}): "
            f"q.shape={tuple(q_shape)}, k.shape={tuple(kv_shape)}")


def check_dims(**dims):
    """Rejects degenerate sizes (a zero head_dim would divide by zero in the default scale)."""
    for name, value in dims.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {name}={value}")


def check_pages(k_pages, v_pages, *, quantized=False):
    """Validates a K/V page pool pair ``[kv_heads, num_pages, page_size, head_dim]`` (the
    ``values`` of quantized pools when ``quantized``: int8 or fp8, checked by
    :func:`forge_jax.ops.kv_quant.pool_parts`)."""
    kind = "any" if quantized else "float"
    _checks.array("k_pages", k_pages, ndim=4, kind=kind)
    _checks.array("v_pages", v_pages, ndim=4, kind=kind)
    if tuple(k_pages.shape) != tuple(v_pages.shape):
        raise ValueError(
            f"k_pages and v_pages must have the same shape [kv_heads, num_pages, page_size, "
            f"head_dim]: {k_pages.shape=}, {v_pages.shape=}")
    _checks.same_dtype(("k_pages", k_pages), ("v_pages", v_pages))
    check_dims(**{f"{name} (k_pages.shape[{i}])": k_pages.shape[i]
                  for i, name in enumerate(("kv_heads", "num_pages", "page_size", "head_dim"))})


def pool_args(k_pages, v_pages):
    """``(k_values, v_values, scales)`` of a K/V pool pair, float or quantized (checked, with
    :func:`check_pages`): ``scales`` is ``{}`` for float pools, ``{"k_scales": ...,
    "v_scales": ...}`` for quantized ones (the representation of
    :mod:`forge_jax.ops.kv_quant`), the implementations' extra arguments. Folded pools
    (:mod:`forge_jax.ops.kv_fold`) come back as they are, with ``{"fold": fold}``."""
    if kv_fold.is_folded(k_pages) or kv_fold.is_folded(v_pages):
        # Folded pools (never quantized) are checked by their logical shape; the args
        # functions hand implementations their stored arrays (kv_fold.stored).
        _, _, fold = kv_fold.pool_parts(k_pages, v_pages)
        check_pages(k_pages, v_pages)
        return k_pages, v_pages, fold
    k_values, v_values, k_scales, v_scales = kv_quant.pool_parts("k_pages", k_pages,
                                                                 "v_pages", v_pages)
    check_pages(k_values, v_values, quantized=k_scales is not None)
    return k_values, v_values, kv_quant.scale_args(k_scales, v_scales)


def check_tables(block_tables, lengths):
    """Validates int ``block_tables [batch, max_pages]`` against int ``lengths [batch]``."""
    _checks.array("block_tables", block_tables, ndim=2, kind="int")
    _checks.array("lengths", lengths, ndim=1, kind="int")
    if lengths.shape[0] != block_tables.shape[0]:
        raise ValueError(f"lengths must be [batch] = ({block_tables.shape[0]},) to match "
                         f"block_tables [batch, max_pages], got {lengths.shape=}, "
                         f"{block_tables.shape=}")


def check_table_values(block_tables, lengths, *, num_pages, page_size,
                       lengths_name="lengths"):
    """The value checks of a paged call (the contract of :mod:`forge_jax.ops.paged`):
    ``0 <= lengths[b] <= max_pages * page_size``, and every entry sequence ``b`` uses (the
    first ``ceil(lengths[b] / page_size)``) names a page of the pool. Raises ValueError
    where the values are concrete; emits checkify checks for traced ones inside
    :func:`forge_jax.debug_checks`."""
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    lengths_rule = (f"must lie in [0, {capacity}] (max_pages * page_size = {max_pages} * "
                    f"{page_size}: keys beyond the block table do not exist)")
    n, tables = _checks.concrete_ints(lengths), _checks.concrete_ints(block_tables)
    if n is not None:
        bad = np.flatnonzero((n < 0) | (n > capacity))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"{lengths_name}[{b}]={n[b]} {lengths_rule}")
    if n is not None and tables is not None:
        used = np.arange(max_pages)[None, :] * page_size < n[:, None]
        bad = np.argwhere(used & ((tables < 0) | (tables >= num_pages)))
        if bad.size:
            b, j = (int(i) for i in bad[0])
            raise ValueError(
                f"block_tables[{b}, {j}]={tables[b, j]} names no page of the pool "
                f"(num_pages={num_pages}); sequence {b} uses its first {used[b].sum()} "
                f"entries ({lengths_name}[{b}]={n[b]}, page_size={page_size})")
        return
    if not _checks.debug_checks_enabled():
        return
    n = jnp.asarray(lengths)
    bad = (n < 0) | (n > capacity)
    b = _checks.first_bad(bad)
    _checks.traced_check(~jnp.any(bad), f"{lengths_name}[{{b}}]={{n}} {lengths_rule}",
                         b=b, n=n[b])
    tables = jnp.asarray(block_tables)
    used = (jnp.arange(max_pages)[None, :] * page_size
            < jnp.clip(n, 0, capacity).astype(jnp.int32)[:, None])
    bad = used & ((tables < 0) | (tables >= num_pages))
    i = _checks.first_bad(bad)
    b, j = i // max_pages, i % max_pages
    _checks.traced_check(
        ~jnp.any(bad), f"block_tables[{{b}}, {{j}}]={{entry}} names no page of the pool "
        f"(num_pages={num_pages}), and sequence {{b}} uses it ({lengths_name}[{{b}}]={{n}}, "
        f"page_size={page_size})", b=b, j=j, entry=tables[b, j], n=n[b])


def clamp_lengths(lengths, capacity):
    """int32 ``lengths`` clamped to ``[0, capacity]``: how a traced length outside the
    table acts (the contract of :mod:`forge_jax.ops.paged`)."""
    return jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, capacity)


# ---------------------------------------------------------------------------------------
# Masks and NaN-safe products


def exact_logits(subscripts, q, k):
    """``einsum(subscripts, q, k)`` in float32 at full precision: the attention logits.

    Products of two bfloat16/float16 values are exact in float32, so equal low-precision
    operands stay as they are; mixed ones meet in float32, and float32 ones ask for full
    precision, since GPUs default to TF32 and TPUs to bfloat16 passes for float32 dots.
    """
    if q.dtype != k.dtype:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    return jnp.einsum(subscripts, q, k, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)


def visible_mask(q_positions, kv_len, *, causal, kv_lengths, sliding_window,
                 attention_chunk_size=None):
    """Boolean ``[batch, q_len, kv_len]``: which keys each query may see."""
    j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    p = q_positions.astype(jnp.int32)[:, :, None]
    mask = jnp.ones((q_positions.shape[0], q_positions.shape[1], kv_len), jnp.bool_)
    if causal:
        mask &= j <= p
    if kv_lengths is not None:
        mask &= j < kv_lengths.astype(jnp.int32)[:, None, None]
    if sliding_window is not None:
        # A window wider than any int32 position distance hides nothing; clamping it keeps
        # `p - window` inside int32 (positions are assumed to lie in [-2**30, 2**30)).
        mask &= j > p - min(sliding_window, 2**30)
    if attention_chunk_size is not None:
        # The query's own chunk (floor division: a position below 0 sits in no key's chunk).
        mask &= (j // attention_chunk_size) == (p // attention_chunk_size)
    return mask


def default_positions(batch, q_len, kv_len, kv_lengths):
    """Bottom-right positions ``[batch, q_len]`` int32: ``kv_lengths[b] - q_len + t`` when
    the lengths are given, else ``kv_len - q_len + t`` (the attention contract)."""
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    if kv_lengths is None:
        return jnp.broadcast_to(kv_len - q_len + t, (batch, q_len))
    return jnp.asarray(kv_lengths).astype(jnp.int32)[:, None] - q_len + t


def all_finite(*arrays):
    """Whether every entry of ``arrays`` is finite, as a float32 sum: a NaN or inf entry
    makes it non-finite. (A sum that overflows from finite entries answers False too,
    which only sends the caller down its exact path. The sum runs ~4x faster than an
    ``all(isfinite)`` reduction on CPU.)"""
    total = sum(jnp.sum(a, dtype=jnp.float32) for a in arrays)
    return jnp.isfinite(jax.lax.stop_gradient(total))


def hide_from_decode(k, v, seen):
    """Decode (one query per sequence): zero the key and value slots it does not see.

    With a single query, per-sequence hiding is per-query hiding, so this ``where`` keeps
    hidden NaN/inf out of the output and every gradient; ``seen`` broadcasts to ``k``.
    """
    zero = jnp.zeros((), k.dtype)
    return jnp.where(seen, k, zero), jnp.where(seen, v, zero)


def finite_keys(k):
    """``(k', bad)``: ``k`` with non-finite entries zeroed, and which key slots held one
    (``k.shape[:-1]``). For several queries per sequence, where a slot one query hides may
    be visible to another: the caller sets the logits of bad slots to NaN, so a visible
    one still propagates while a hidden one is masked and reaches no gradient (``dq``
    reads ``k'``)."""
    finite = jnp.isfinite(k)
    return (jnp.where(finite, k, jnp.zeros((), k.dtype)),
            jnp.logical_not(jnp.all(finite, axis=-1)))


def weighted_values(product, mask_product, v):
    """``probs @ v`` in float32 such that values a query does not see never reach it.

    Args:
      product: ``product(values) -> out``, the einsum of the (already masked, float32)
        probabilities with float32 values shaped like ``v``.
      mask_product: ``mask_product(flags) -> counts`` broadcastable to ``out``: the einsum
        of the float32 visibility mask with float32 per-value flags shaped like ``v``.
      v: the values, any float dtype.

    A zero probability times a NaN value is NaN, so non-finite entries are zeroed for the
    product and put back as NaN in exactly the outputs whose query sees them.
    """
    finite = jnp.isfinite(v)
    out = product(jnp.where(finite, v, jnp.zeros((), v.dtype)).astype(jnp.float32))
    hits = mask_product(jnp.logical_not(finite).astype(jnp.float32))
    return jnp.where(hits > 0, jnp.float32(jnp.nan), out)


def sink_logits(sinks, shape):
    """float32 sink logits broadcast to ``shape`` (``[..., 1]``, the rows of the logits);
    ``sinks`` already shaped to broadcast (the query heads on their axis). A ``+inf`` sink
    is NaN data, as a ``+inf`` logit is; ``-inf`` is no sink."""
    sink = jnp.broadcast_to(jnp.asarray(sinks).astype(jnp.float32), shape)
    return jnp.where(jnp.isposinf(sink), jnp.float32(jnp.nan), sink)


def masked_probs(logits, mask, *, scale, logits_soft_cap, sinks=None):
    """float32 attention probabilities: ``softmax(cap(scale * logits))`` over the visible keys
    (the last axis), zeros for a query that sees none. ``mask`` broadcasts to ``logits``.

    ``sinks``, broadcastable to ``logits.shape[:-1] + (1,)``: a logit per row that joins
    the denominator (neither scaled nor capped) and weighs no value, so the probabilities
    of a row sum to less than one; a row that sees no key keeps zeros."""
    logits = logits * jnp.asarray(scale, jnp.float32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    # A +inf logit (non-finite q or k) is NaN data in attention, not a winner (see the
    # contract); a hidden one is masked like any hidden logit.
    logits = jnp.where(jnp.isposinf(logits), jnp.float32(jnp.nan), logits)
    if sinks is None:
        return safe_softmax_f32(logits, -1, mask, posinf_wins=False)
    x = jnp.where(jnp.broadcast_to(mask, logits.shape), logits, -jnp.inf)
    sink = sink_logits(sinks, logits.shape[:-1] + (1,))
    m = jnp.maximum(jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf), sink)
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.exp(x - shift)
    total = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - shift)
    return e / jnp.where(total == 0, 1.0, total)


def sink_step(sinks, row_max):
    """The sink's term of an online softmax (:func:`softmax_step`), after the last span of
    keys: ``(e_sink, rescale)`` with ``total = total * rescale + e_sink`` and ``out = out *
    rescale`` (a sink weighs no value). ``sinks`` broadcasts to ``row_max`` ``[..., 1]``."""
    sink = sink_logits(sinks, row_max.shape)
    m = jax.lax.stop_gradient(jnp.maximum(row_max, sink))
    shift = jnp.where(m == -jnp.inf, jnp.float32(0), m)
    return jnp.exp(sink - shift), jnp.exp(row_max - shift)


def softmax_step(logits, mask, previous_max, *, scale, logits_soft_cap):
    """One span of keys of :func:`masked_probs` taken span by span and left unnormalised
    (an online softmax), so that a caller can keep each span's logits small and divide
    the ``[..., q, head_dim]`` output instead of the ``[..., q, kv]`` probabilities.

    With ``e, m, rescale = softmax_step(...)`` per span, a caller accumulates
    ``total = total * rescale + sum(e)`` and ``out = out * rescale + e @ v``; after the
    last span ``out / where(total == 0, 1, total)`` is :func:`masked_probs`' result times
    ``v``, up to rounding:

    * hidden keys get ``e = 0`` (their logit is replaced by ``-inf`` before the exp, so
      neither a hidden value nor its gradient is ever read);
    * a visible ``+inf`` logit makes the row's max ``+inf`` and its own term
      ``exp(inf - inf) = NaN``: NaN for the query, as the contract asks; visible NaN
      propagates through the max;
    * a row that sees no key (or only ``-inf`` logits) ends with ``total = 0``: zeros.

    Args:
      logits: float32 ``[..., span]``, the raw ``q . k`` of these keys.
      mask: broadcasts to ``logits``; or None when every query sees every key of the
        span, whose row max is then read off the logits (no masked copy written): this
        needs ``scale > 0``, so that the capped, scaled logits grow with the logits.
      previous_max: the running row max ``[..., 1]`` of the spans before, or None.
      scale, logits_soft_cap: the logits are ``cap(scale * logits)``.

    Returns:
      ``(e, row_max, rescale)``: float32 ``e`` like ``logits``; the running row max
      including this span (for the next call); ``exp(previous_max - row_max)`` for what
      the earlier spans accumulated (None for the first span).
    """
    def capped(x):
        x = x * jnp.asarray(scale, jnp.float32)
        if logits_soft_cap is not None:
            x = logits_soft_cap * jnp.tanh(x / logits_soft_cap)
        return x

    # initial=-inf: an empty span (zero keys) is one that no query sees.
    if mask is None:
        x = None
        m = capped(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
    else:
        x = jnp.where(mask, capped(logits), -jnp.inf)
        m = jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf)
    if previous_max is not None:
        m = jnp.maximum(previous_max, m)  # NaN propagates
    # The max only shifts the exponents (softmax does not depend on it): no gradient.
    m = jax.lax.stop_gradient(m)
    shift = jnp.where(m == -jnp.inf, jnp.float32(0), m)  # a row that has seen nothing yet
    e = jnp.exp((capped(logits) if x is None else x) - shift)
    rescale = None if previous_max is None else jnp.exp(previous_max - shift)
    return e, m, rescale


# ---------------------------------------------------------------------------------------
# Paged KV pools


def named_pages(pages, block_tables, lengths):
    """The pages the block tables name, head-major ``[kv_heads, batch, seq, head_dim]``
    with ``seq = max_pages * page_size``, and which of those slots are valid
    (``[batch, seq]``: slot < length, on an entry that names a page of the pool).
    ``lengths`` must lie in ``[0, seq]`` (:func:`clamp_lengths`). Invalid slots hold
    anything: they are to be hidden (an out-of-range entry reads nothing)."""
    kv_heads, num_pages, page_size, head_dim = pages.shape
    batch, max_pages = block_tables.shape
    table = jnp.asarray(block_tables).astype(jnp.int32)
    used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size < lengths[:, None]
    named = used & (table >= 0) & (table < num_pages)  # [batch, max_pages]
    # Unused entries may hold garbage, and a used entry may name no page (traced tables
    # cannot be checked): read page 0 for them, hidden by `valid`.
    table = jnp.where(named, table, 0)
    seq = max_pages * page_size
    gathered = jnp.take(pages, table, axis=1, mode="clip").reshape(
        kv_heads, batch, seq, head_dim)
    valid = ((jnp.arange(seq, dtype=jnp.int32)[None, :] < lengths[:, None])
             & jnp.repeat(named, page_size, axis=1))
    return gathered, valid
