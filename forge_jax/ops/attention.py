"""Scaled dot-product attention with bottom-right causal alignment.

The attention contract
----------------------
Dense :func:`attention`, :func:`forge_jax.paged_attention` and every kernel registered for
them compute the same thing; this is the one place it is written down.

* **Logits.** ``s = scale * q . k`` in float32 (``scale`` defaults to ``head_dim ** -0.5``),
  soft-capped to ``cap * tanh(s / cap)`` when ``logits_soft_cap`` is given; softmax over the
  visible keys in float32; ``out = sum_j p_j v_j`` in float32, returned in ``q.dtype``.
  Query head ``h`` reads kv head ``h // (q_heads // kv_heads)`` (GQA/MQA).
* **Sinks** (``sinks=``, float ``[q_heads]``, gpt-oss): the logit ``sinks[h]`` joins the
  softmax denominator of every query of head ``h``, as it is (neither scaled nor
  capped), and weighs no value: ``p_j = exp(s_j) / (exp(sinks[h]) + sum_visible exp(s))``.
  A sink is visible to every query: NaN in it gives NaN in its head's outputs, ``+inf``
  too (as a ``+inf`` logit does); ``-inf`` is no sink. A query that sees no key still
  returns zeros.
* **Positions: bottom-right, per sequence.** Query ``t`` of ``q_len`` sits at position
  ``p = q_positions[b, t]`` when positions are given; otherwise
  ``p = kv_lengths[b] - q_len + t`` when the sequence length is given (dense
  ``kv_lengths``, paged ``lengths``), else ``p = kv_len - q_len + t``. The last query sits
  at the last key of its sequence: decode (``q_len == 1``) sees the whole sequence and
  chunked prefill continues where the cache ends. (``jax.nn.dot_product_attention``
  aligns top-left: a decode query there sees key 0 only.)
* **Visibility.** Key ``j`` is visible to the query at ``p`` iff ``(not causal or j <= p)``
  and ``j < kv_lengths[b]`` (when given) and ``j > p - sliding_window`` (when given) and
  ``j // attention_chunk_size == p // attention_chunk_size`` (chunked attention, Llama 4,
  when given: a query sees only the keys of its own chunk). Paged attention is always
  causal.
* **Invisible keys never influence the output, whatever they hold.** Slots past the
  length of a sequence, hidden by the causal mask or outside the window or chunk may hold NaN or
  inf (uninitialised or recycled cache memory): the output is the same finite result.
  Masking the logits is not enough (``0 * NaN = NaN``), so the values are masked too.
* **Visible non-finite data propagates.** A NaN in a visible query, key or value, or
  ``scale=nan``, gives NaN in the outputs that read it; it is never treated as masked. A
  ``+inf`` logit (after the soft cap, which bounds finite and infinite logits alike) gives
  NaN for its query: unlike :func:`forge_jax.softmax`, attention does not share the row
  among ``+inf`` logits, since they only arise from non-finite queries or keys. A visible
  ``inf`` value gives a non-finite output (``inf`` or NaN) in the columns that read it.
  Only the mask, and ``-inf`` logits (a key made invisible, as in
  :func:`forge_jax.softmax`), hide a key.
* **Gradients** follow the same rule: a slot a query does not see contributes nothing to
  any gradient, even when it holds NaN or inf.
* **A query that sees no key returns zeros** (so does its gradient).
* **Lengths and page indices.** ``kv_lengths[b]`` lies in ``[0, kv_len]``, paged
  ``lengths[b]`` in ``[0, max_pages * page_size]``, and every block-table entry a sequence
  uses (the first ``ceil(lengths[b] / page_size)``) names a page of the pool; entries past
  them may hold anything (garbage, ``-1`` padding) and are never read. Concrete arguments
  (NumPy arrays, JAX arrays outside ``jax.jit``) that break this raise ValueError naming
  the argument and the value, before any work. Traced ones cannot be checked at trace
  time, and are defined: a length is clamped into its range, and the default positions
  follow the clamped length (``kv_lengths=[40]`` with 16 keys is ``kv_lengths=[16]``;
  ``-3`` is ``0``); a used entry that names no page of the pool reads nothing, its slots
  invisible as if masked, never another page. Every implementation gives these results.
  Inside :func:`forge_jax.debug_checks` the ops emit the same checks for traced values as
  ``jax.experimental.checkify`` checks (reported by ``checkify.checkify``). The index
  rules of all paged ops (writes and copies too) are in :mod:`forge_jax.ops.paged`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.ops._attention_math import (
    all_finite,
    check_dims,
    check_extras,
    check_heads,
    check_masking,
    default_positions,
    exact_logits,
    finite_keys,
    hide_from_decode,
    masked_probs,
    sink_step,
    softmax_step,
    visible_mask,
    weighted_values,
)


def _attention_args(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    attention_chunk_size=None):
    _checks.array("q", q, ndim=4)
    _checks.array("k", k, ndim=4)
    _checks.array("v", v, ndim=4)
    check_dims(**{"head_dim (q.shape[3])": q.shape[3], "q_heads (q.shape[2])": q.shape[2],
                  "kv_heads (k.shape[2])": k.shape[2]})
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape: {k.shape=}, {v.shape=}")
    _checks.same_dtype(("k", k), ("v", v))
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k disagree on batch: {q.shape=}, {k.shape=}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k disagree on head_dim: {q.shape=}, {k.shape=}")
    check_heads(q.shape[2], k.shape[2], q.shape, k.shape)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal=!r}")
    causal = bool(causal)
    batch, q_len = q.shape[:2]
    if q_positions is not None:
        _checks.array("q_positions", q_positions, ndim=2, kind="int")
        if tuple(q_positions.shape) != (batch, q_len):
            raise ValueError(
                f"q_positions must be [batch, q_len] = {(batch, q_len)}, got {q_positions.shape=}")
    if kv_lengths is not None:
        _checks.array("kv_lengths", kv_lengths, ndim=1, kind="int")
        if kv_lengths.shape[0] != batch:
            raise ValueError(f"kv_lengths must be [batch] = ({batch},), got {kv_lengths.shape=}")
        _check_kv_length_values(kv_lengths, k.shape[1])
    scale, sliding_window, logits_soft_cap = check_masking(
        scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    extras = check_extras(sinks=sinks, attention_chunk_size=attention_chunk_size,
                          q_heads=q.shape[2])
    return dict(q=q, k=k, v=v, scale=scale, causal=causal, q_positions=q_positions,
                kv_lengths=kv_lengths, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap, **extras)


def _check_kv_length_values(kv_lengths, kv_len):
    rule = f"must lie in [0, kv_len={kv_len}] (k.shape[1])"
    values = _checks.concrete_ints(kv_lengths)
    if values is not None:
        bad = np.flatnonzero((values < 0) | (values > kv_len))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"kv_lengths[{b}]={values[b]} {rule}")
    elif _checks.debug_checks_enabled():
        values = jnp.asarray(kv_lengths)
        bad = (values < 0) | (values > kv_len)
        b = _checks.first_bad(bad)
        _checks.traced_check(~jnp.any(bad), f"kv_lengths[{{b}}]={{n}} {rule}", b=b, n=values[b])


def attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
              sliding_window=None, logits_soft_cap=None, sinks=None, attention_chunk_size=None,
              implementation=None):
    """Multi-head scaled dot-product attention (MHA, GQA and MQA).

    ``out[b, t, h] = sum_j p[b, h, t, j] * v[b, j, h // g]`` with
    ``p = softmax_j(cap(scale * q[b, t, h] . k[b, j, h // g]))`` over the visible keys,
    ``g = q_heads // kv_heads`` and ``cap(x) = logits_soft_cap * tanh(x / logits_soft_cap)``
    when a soft cap is given. Logits, softmax and the weighted sum are float32.

    Masking follows the attention contract in the docstring of :mod:`forge_jax.ops.attention`:
    a query at position ``p`` sees key ``j`` iff ``(not causal or j <= p)``,
    ``j < kv_lengths[b]`` (when given) and ``j > p - sliding_window`` (when given).
    Positions default to bottom-right alignment *per sequence*: ``p = kv_lengths[b] -
    q_len + t`` with ``kv_lengths``, else ``p = kv_len - q_len + t``, so the last query
    sits at the last key of its sequence (what decode and chunked prefill need). Keys a
    query may not see never influence its output, even when they hold NaN or inf; NaN
    in visible data propagates. A query that sees no key returns zeros.

    Implementations (``fj.explain("attention", ...)`` says which runs): ``"xla"``,
    :func:`attention_xla` below, the reference; the Pallas flash kernels
    ``pallas_kernels/gpu/attention.py`` and ``pallas_kernels/tpu/attention.py``; ``"cudnn"``
    in ``pallas_kernels/gpu/jax_nn_attention.py``. Partition rule:
    :func:`_attention_partition` below. Tests: ``tests/test_ops.py``,
    ``tests/test_attention_contract.py``, ``tests/cases/attention_base.py`` (the cases every
    kernel runs), ``tests/test_pallas_{gpu,tpu}_attention.py``, ``tests/test_jax_nn_attention.py``.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, ``q_heads % kv_heads == 0``, one
        dtype, which may differ from ``q``'s (a KV cache stored in its own dtype; the math
        is float32 either way). A k/v mix raises TypeError (the dtype rule of
        :mod:`forge_jax.ops`).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      causal: apply the causal mask.
      q_positions: optional int ``[batch, q_len]``, each query's position among the keys.
      kv_lengths: optional int ``[batch]`` in ``[0, kv_len]``, the number of valid keys of
        each sequence; the default positions align the queries of each sequence to its own
        last key. Concrete values outside ``[0, kv_len]`` raise ValueError; traced ones are
        clamped into it, default positions included (the attention contract).
      sliding_window: optional positive int, keys further back than this are hidden
        (a query sees itself and the ``sliding_window - 1`` keys before it).
      logits_soft_cap: optional positive float.
      sinks: optional float ``[q_heads]`` (attention sinks, gpt-oss): a logit per query
        head that joins every query's softmax denominator, neither scaled nor capped, and
        weighs no value (see the contract).
      attention_chunk_size: optional positive int (chunked attention, Llama 4): a query
        at ``p`` sees only keys of its own chunk, ``j // size == p // size``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``.
    """
    args = _attention_args(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                           kv_lengths=kv_lengths, sliding_window=sliding_window,
                           logits_soft_cap=logits_soft_cap, sinks=sinks,
                           attention_chunk_size=attention_chunk_size)
    if q.shape[1] == 0:  # no queries, an empty result (as for an empty batch)
        return jnp.zeros(q.shape, q.dtype)
    return dispatch.call("attention", args, implementation)


def _attention_partition(args, config):
    """How ``attention`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    q, k = args["q"], args["k"]  # [batch, len, heads, head_dim]
    b = sharding.divisible(config, config.dp_name, q.shape[0])
    h = sharding.heads_axis(config, q.shape[2], k.shape[2])
    qs, ks = P(b, None, h, None), P(b, None, h, None)
    specs = {"q": qs, "k": ks, "v": ks}
    if args["q_positions"] is not None:
        specs["q_positions"] = P(b, None)
    if args["kv_lengths"] is not None:
        specs["kv_lengths"] = P(b)
    if args.get("sinks") is not None:
        specs["sinks"] = P(h)
    return specs, qs


dispatch.define("attention", _attention_args, partition=_attention_partition)


# The plain path for several queries (see _attend_blocks): queries per block, blocks per
# scan when the causal key bound is static, and keys per span of the online softmax where
# no mask is needed. Measured on a 2-core CPU (SmolLM2-135M's heads, 2048 queries).
Q_BLOCK = 128
BLOCKS_PER_SCAN = 2
KV_BLOCK = 512


def _attend_blocks(q, k, v, *, q_positions, causal, kv_lengths, sliding_window, scale,
                   logits_soft_cap, key_bounds, sinks=None, attention_chunk_size=None):
    """Attention of several queries over finite keys and values, one block of
    ``Q_BLOCK`` queries at a time, head-major: ``[b, k, g * block, s]`` logits straight
    from the product (no relayout of the logits), an online softmax over spans of keys
    (:func:`softmax_step`) and the division applied to the ``[.., head_dim]`` output.

    A block's logits stay small enough for the CPU's caches. The blocks run inside
    ``lax.scan``: XLA:CPU then reuses one set of buffers for all of them (as separate ops
    it kept every block's logits alive at once, hundreds of MB at 2048 queries, and ran
    ~1.7x slower). ``key_bounds(start, stop)``, given with the default bottom-right
    alignment of causal attention, is ``(seen, keys)`` for the queries ``start ..
    stop - 1`` (static): every one of them sees the first ``seen`` keys, taken by spans
    of ``KV_BLOCK`` with no mask, and none sees past the first ``keys``. The blocks then
    go by scans of ``BLOCKS_PER_SCAN`` that read only their prefix of the keys, so that a
    prefill computes little more than half of the ``[q_len, kv_len]`` square. Without it
    (``None``), one scan reads all keys through the mask, in one span.

    Returns:
      float32 ``[batch, q_len, kv_heads, groups, head_dim]``.
    """
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    qh = jnp.transpose(q.reshape(batch, q_len, kv_heads, groups, head_dim),
                       (0, 2, 3, 1, 4))  # [b, k, g, t, h]
    if qh.dtype == jnp.float32:
        # The scale goes into the queries (q_len x head_dim products) rather than the
        # logits (q_len x kv_len): one pass over every span of logits fewer.
        qh, scale = qh * jnp.asarray(scale, jnp.float32), 1.0
    if sinks is not None:
        sinks = jnp.asarray(sinks).reshape(kv_heads, groups)[None, :, :, None, None]
    kh = jnp.transpose(k, (0, 2, 1, 3))  # [b, k, s, h]
    vh = jnp.transpose(v, (0, 2, 1, 3)).astype(jnp.float32)
    positions = q_positions.astype(jnp.int32)

    def block(qb, positions, spans):
        """qb ``[b, k, g, n, h]`` at ``positions`` ``[b, n]`` over the keys of ``spans``,
        ``(lo, hi, k [b, k, hi - lo, h], v, masked)``, with an online softmax."""
        n = qb.shape[3]
        q2 = qb.reshape(batch, kv_heads, groups * n, head_dim)
        row_max = total = out = None
        for lo, hi, k_span, v_span, masked in spans:
            mask = None
            if masked:  # keys lo .. hi - 1: the mask of keys 0 .. hi - lo - 1, shifted
                # (the chunk mask compares absolute indices: shifted back by lo)
                span_keys = jnp.arange(lo, hi, dtype=jnp.int32)
                mask = visible_mask(
                    positions - lo, hi - lo, causal=causal, sliding_window=sliding_window,
                    kv_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32) - lo,
                )
                if attention_chunk_size is not None:
                    mask &= ((span_keys[None, None, :] // attention_chunk_size)
                             == (positions[:, :, None] // attention_chunk_size))
                mask = mask[:, None, None]  # [b, 1, 1, n, hi - lo]
            logits = exact_logits("bkqh,bksh->bkqs", q2, k_span)
            e, row_max, rescale = softmax_step(
                logits.reshape(batch, kv_heads, groups, n, hi - lo), mask, row_max,
                scale=scale, logits_soft_cap=logits_soft_cap)  # e [b, k, g, n, hi - lo]
            span_sum = jnp.sum(e, axis=-1, keepdims=True)
            span_out = jnp.einsum(
                "bkqs,bksh->bkqh", e.reshape(batch, kv_heads, groups * n, hi - lo), v_span,
                preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
            ).reshape(batch, kv_heads, groups, n, head_dim)
            if rescale is None:
                total, out = span_sum, span_out
            else:
                total, out = total * rescale + span_sum, out * rescale + span_out
        if sinks is not None:
            e_sink, rescale = sink_step(sinks, row_max)
            total, out = total * rescale + e_sink, out * rescale
        return out / jnp.where(total == 0, jnp.float32(1), total)

    def scanned(start, count, spans):
        """``count`` whole blocks from query ``start``: ``[b, k, g, count * Q_BLOCK, h]``."""
        stop = start + count * Q_BLOCK
        qs = qh[:, :, :, start:stop].reshape(batch, kv_heads, groups, count, Q_BLOCK, head_dim)
        ps = positions[:, start:stop].reshape(batch, count, Q_BLOCK)
        _, out = jax.lax.scan(lambda _, x: (None, block(*x, spans)), None,
                              (jnp.moveaxis(qs, 3, 0), jnp.moveaxis(ps, 1, 0)))
        return jnp.moveaxis(out, 0, 3).reshape(batch, kv_heads, groups, stop - start, head_dim)

    span = Q_BLOCK * (BLOCKS_PER_SCAN if key_bounds else max(1, q_len // Q_BLOCK))
    outs = []
    for start in range(0, q_len, span):
        stop = min(q_len, start + span)
        count = (stop - start) // Q_BLOCK
        seen, keys = key_bounds(start, stop) if key_bounds else (0, kv_len)
        # The keys every query of these blocks sees (no mask) by spans of KV_BLOCK, then
        # the masked ones; sliced here, once for the scan.
        bounds = [(lo, min(seen, lo + KV_BLOCK), False) for lo in range(0, seen, KV_BLOCK)]
        bounds.append((seen, keys, True))
        spans = [(lo, hi, kh[:, :, lo:hi], vh[:, :, lo:hi], masked)
                 for lo, hi, masked in bounds]
        if count >= 2:
            outs.append(scanned(start, count, spans))
        elif count == 1:
            outs.append(block(qh[:, :, :, start:start + Q_BLOCK],
                              positions[:, start:start + Q_BLOCK], spans))
        tail = start + count * Q_BLOCK
        if tail < stop:  # a last, partial block
            outs.append(block(qh[:, :, :, tail:stop], positions[:, tail:stop], spans))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def attention_reference(q, k, v, *, scale, causal, q_positions, kv_lengths, sliding_window,
                        logits_soft_cap, sinks=None, attention_chunk_size=None):
    """The XLA implementation: materialises the ``[batch, heads, q_len, kv_len]`` logits
    (several queries with finite keys and values: per block of queries, see
    :func:`_attend_blocks`)."""
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    if scale is None:
        scale = head_dim ** -0.5
    static_positions = q_positions is None and kv_lengths is None
    if kv_lengths is not None:  # traced lengths outside [0, kv_len] act clamped (the contract)
        kv_lengths = jnp.clip(jnp.asarray(kv_lengths).astype(jnp.int32), 0, kv_len)
    if q_positions is None:
        q_positions = default_positions(batch, q_len, kv_len, kv_lengths)

    def attend(k, v, exact):
        # exact: some K/V entry is non-finite, so hidden slots must be kept out explicitly.
        # (The mask is made inside the branch: the plain path of a prefill never needs it.)
        mask = visible_mask(q_positions, kv_len, causal=causal, kv_lengths=kv_lengths,
                            sliding_window=sliding_window,
                            attention_chunk_size=attention_chunk_size)  # [b, t, s]
        bad_keys = None
        if exact and q_len == 1:
            k, v = hide_from_decode(k, v, mask[:, 0, :, None, None])
        elif exact:
            k, bad_keys = finite_keys(k)  # [b, s, k]
        # (q is reshaped here, in the branch: a reshape outside would hand the two
        # branches of the cond below differently shaped queries, and XLA would compute
        # the queries' producer, RoPE, once for each.)
        qg = q.reshape(batch, q_len, kv_heads, groups, head_dim)
        logits = exact_logits("btkgh,bskh->bkgts", qg, k)
        if bad_keys is not None:
            logits = jnp.where(jnp.transpose(bad_keys, (0, 2, 1))[:, :, None, None, :],
                               jnp.float32(jnp.nan), logits)
        probs = masked_probs(
            logits, mask[:, None, None, :, :], scale=scale, logits_soft_cap=logits_soft_cap,
            sinks=None if sinks is None else jnp.asarray(sinks).reshape(
                kv_heads, groups)[None, :, :, None, None])  # [b, k, g, t, s]
        product = lambda values: jnp.einsum("bkgts,bskh->btkgh", probs, values,
                                            preferred_element_type=jnp.float32,
                                            precision=jax.lax.Precision.HIGHEST)
        if not exact or q_len == 1:
            return product(v.astype(jnp.float32))
        return weighted_values(
            product,
            lambda flags: jnp.einsum("bts,bskh->btkh", mask.astype(jnp.float32), flags,
                                     precision=jax.lax.Precision.HIGHEST)[:, :, :, None, :],
            v)  # [b, t, k, g, h]

    key_bounds = None  # (seen by all, seen by any) queries of a block, when static
    if causal and static_positions:
        # Query t sits at kv_len - q_len + t and sees the keys up to it. Keys that all of a
        # block's queries see skip the mask, unless a window hides old keys or the scale
        # (not a positive number) reverses the order of the logits.
        unmasked = (sliding_window is None and attention_chunk_size is None
                    and isinstance(scale, float) and scale > 0)

        def key_bounds(start, stop):
            keys = min(kv_len, max(1, kv_len - q_len + stop))
            # Rounded down to whole key blocks: spans of odd sizes (257 keys, then 255
            # masked ones) cost the products their vector alignment.
            seen = min(keys, max(0, kv_len - q_len + start + 1)) if unmasked else 0
            seen -= seen % Q_BLOCK
            return seen, keys

    if q_len == 1:  # decode: the cache is read in place (no head-major copy of K/V)
        plain = lambda: attend(k, v, False)  # noqa: E731
    else:
        plain = lambda: _attend_blocks(  # noqa: E731
            q, k, v, q_positions=q_positions, causal=causal, kv_lengths=kv_lengths,
            sliding_window=sliding_window, scale=scale, logits_soft_cap=logits_soft_cap,
            key_bounds=key_bounds, sinks=sinks, attention_chunk_size=attention_chunk_size)
    # One fused check picks the plain step for finite K/V (the usual case) and returns only
    # the output, so nothing the size of K/V is copied for the check.
    out = jax.lax.cond(all_finite(k, v), plain, lambda: attend(k, v, True))
    return out.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype)


@dispatch.register("attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="einsum + masked float32 softmax")
def attention_xla(q, k, v, **kw):
    with jax.named_scope("attention"):
        return attention_reference(q, k, v, **kw)
