"""Ragged paged attention: one call attends the new tokens of a mix of sequences.

A serving step packs the new tokens of every scheduled sequence (prefill chunks and
decode tokens alike) into one ``[total_tokens, q_heads, head_dim]`` array, sequence
after sequence, as ``cu_q_lens`` (cumulative query lengths) describes. All shapes are
static, so one compiled step serves any mix: ``num_seqs``, ``cu_q_lens``,
``kv_lengths`` and the block tables are data. The pages are laid out as in
:mod:`forge_jax.ops.paged`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.ops import kv_fold, kv_quant
from forge_jax.ops._attention_math import (
    check_extras,
    check_heads,
    check_masking,
    clamp_lengths,
    exact_logits,
    masked_probs,
    named_pages,
    pool_args,
    visible_mask,
)
from forge_jax.ops.paged import paged_attention_xla

# The XLA implementation's forward goes sequence by sequence: the rows of a sequence with
# several new tokens (a prefill chunk) by blocks of _SEQ_BLOCK rows, each block one dense
# attention over its sequence's pages (gathered once per block); the rows of sequences with
# one new token (decode) by groups of _DECODE_ROWS, each row over its own pages. Both loops
# run only over the blocks and groups the step has (a traced count).
_SEQ_BLOCK = 32
_DECODE_ROWS = 32
# Rows per step of the differentiable formulation (every row gathers its own sequence's
# pages, so scratch grows as rows x pages_per_seq x page_size x kv_heads x head_dim).
_ROWS_PER_STEP = 256


def _check_num_seqs(num_seqs, max_seqs):
    if isinstance(num_seqs, (bool, np.bool_)):
        raise TypeError(f"num_seqs must be an int or an int32 scalar array, got {num_seqs=!r}")
    if isinstance(num_seqs, numbers.Integral):
        return int(num_seqs)
    if not hasattr(num_seqs, "shape") or not hasattr(num_seqs, "dtype"):
        raise TypeError(f"num_seqs must be an int or an int32 scalar array, "
                        f"got {type(num_seqs).__name__}: {num_seqs!r:.80}")
    if tuple(num_seqs.shape) != ():
        raise ValueError(f"num_seqs must be a scalar, got num_seqs.shape={tuple(num_seqs.shape)}")
    if not jnp.issubdtype(num_seqs.dtype, jnp.integer):
        raise TypeError(f"num_seqs must be an integer scalar, "
                        f"got num_seqs.dtype={jnp.dtype(num_seqs.dtype).name}")
    return num_seqs


_concrete = _checks.concrete_ints


def _check_values(block_tables, kv_lengths, cu_q_lens, num_seqs, *, total_tokens, num_pages,
                  page_size):
    """The value checks possible on the concrete arguments (none under ``jax.jit``; there,
    :func:`_debug_checks` inside :func:`forge_jax.debug_checks`)."""
    if any(_concrete(x) is None for x in (block_tables, kv_lengths, cu_q_lens, num_seqs)):
        _debug_checks(block_tables, kv_lengths, cu_q_lens, num_seqs,
                      total_tokens=total_tokens, num_pages=num_pages, page_size=page_size)
    max_seqs, pages_per_seq = block_tables.shape
    n, cu = _concrete(num_seqs), _concrete(cu_q_lens)
    if n is not None and not 0 <= n <= max_seqs:
        raise ValueError(f"num_seqs must be in [0, max_seqs={max_seqs}] "
                         f"(max_seqs = block_tables.shape[0]), got num_seqs={int(n)}")
    if cu is not None and cu[0] != 0:
        raise ValueError(f"cu_q_lens must start at 0, got cu_q_lens[0]={cu[0]}")
    if n is None or cu is None:
        return
    n = int(n)
    # Only the first num_seqs sequences are described; the entries after them are ignored.
    for i in range(n):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"cu_q_lens must be non-decreasing over its first num_seqs + 1 = "
                             f"{n + 1} entries, got cu_q_lens[{i}]={cu[i]} > "
                             f"cu_q_lens[{i + 1}]={cu[i + 1]}")
    if cu[n] > total_tokens:
        raise ValueError(f"cu_q_lens[num_seqs={n}]={cu[n]} exceeds the {total_tokens} rows of q "
                         f"(q.shape[0])")
    kv = _concrete(kv_lengths)
    if kv is None:
        return
    capacity = pages_per_seq * page_size
    for i in range(n):
        q_len = cu[i + 1] - cu[i]
        if not q_len <= kv[i] <= capacity:
            raise ValueError(
                f"sequence {i}: kv_lengths[{i}]={kv[i]} must count its {q_len} new tokens "
                f"(cu_q_lens[{i + 1}] - cu_q_lens[{i}]) and fit its block table "
                f"(pages_per_seq * page_size = {pages_per_seq} * {page_size} = {capacity})")
    tables = _concrete(block_tables)
    if tables is None:
        return
    for i in range(n):
        used = tables[i, :-(-kv[i] // page_size)] if kv[i] else tables[i, :0]
        bad = np.flatnonzero((used < 0) | (used >= num_pages))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"block_tables[{i}, {j}]={used[j]} names no page of k_pages "
                             f"(num_pages={num_pages}); sequence {i} uses its first "
                             f"{used.size} entries (kv_lengths[{i}]={kv[i]})")


def _debug_checks(block_tables, kv_lengths, cu_q_lens, num_seqs, *, total_tokens, num_pages,
                  page_size):
    """:func:`_check_values` as checkify checks of traced values (debug checks only)."""
    if not _checks.debug_checks_enabled():
        return
    max_seqs, pages_per_seq = block_tables.shape
    capacity = pages_per_seq * page_size
    n = jnp.asarray(num_seqs)
    _checks.traced_check((n >= 0) & (n <= max_seqs),
                         f"num_seqs must be in [0, max_seqs={max_seqs}], got num_seqs={{n}}", n=n)
    cu, kv = jnp.asarray(cu_q_lens), jnp.asarray(kv_lengths)
    active = jnp.arange(max_seqs) < n
    _checks.traced_check(cu[0] == 0, "cu_q_lens must start at 0, got cu_q_lens[0]={c}", c=cu[0])
    bad = active & (cu[1:] < cu[:-1])
    i = _checks.first_bad(bad)
    _checks.traced_check(~jnp.any(bad), "cu_q_lens must be non-decreasing over its first "
                         "num_seqs + 1 entries, got cu_q_lens[{i}]={a} > cu_q_lens[{j}]={b}",
                         i=i, a=cu[i], j=i + 1, b=cu[i + 1])
    last = cu[jnp.clip(n, 0, max_seqs)]
    _checks.traced_check(last <= total_tokens, f"cu_q_lens[num_seqs]={{c}} exceeds the "
                         f"{total_tokens} rows of q (q.shape[0])", c=last)
    q_len = cu[1:] - cu[:-1]
    bad = active & ((kv < q_len) | (kv > capacity))
    i = _checks.first_bad(bad)
    _checks.traced_check(
        ~jnp.any(bad), f"sequence {{i}}: kv_lengths[{{i}}]={{kv}} must count its {{q}} new "
        f"tokens and fit its block table (pages_per_seq * page_size = {pages_per_seq} * "
        f"{page_size} = {capacity})", i=i, kv=kv[i], q=q_len[i])
    tables = jnp.asarray(block_tables)
    used = active[:, None] & (jnp.arange(pages_per_seq)[None, :] * page_size
                              < jnp.clip(kv, 0, capacity)[:, None])
    bad = used & ((tables < 0) | (tables >= num_pages))
    flat = _checks.first_bad(bad)
    i, j = flat // pages_per_seq, flat % pages_per_seq
    _checks.traced_check(
        ~jnp.any(bad), f"block_tables[{{i}}, {{j}}]={{entry}} names no page of k_pages "
        f"(num_pages={num_pages}), and sequence {{i}} uses it (kv_lengths[{{i}}]={{kv}})",
        i=i, j=j, entry=tables[i, j], kv=kv[i])


def _ragged_args(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens, num_seqs, *,
                 scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                 attention_chunk_size=None):
    _checks.array("q", q, ndim=3)
    k_pages, v_pages, scales = pool_args(k_pages, v_pages)
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
    num_seqs = _check_num_seqs(num_seqs, max_seqs)
    kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q and k_pages disagree on head_dim: {q.shape=}, {k_pages.shape=}")
    if q.shape[1] == 0:
        raise ValueError(f"q_heads (q.shape[1]) must be positive, got {q.shape=}")
    check_heads(q.shape[1], kv_heads, q.shape, k_pages.shape)
    scale, sliding_window, logits_soft_cap = check_masking(
        scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    extras = check_extras(sinks=sinks, attention_chunk_size=attention_chunk_size,
                          q_heads=q.shape[1])
    _check_values(block_tables, kv_lengths, cu_q_lens, num_seqs, total_tokens=q.shape[0],
                  num_pages=num_pages, page_size=page_size)
    return dict(q=q, k_pages=kv_fold.stored(k_pages), v_pages=kv_fold.stored(v_pages),
                block_tables=block_tables, kv_lengths=kv_lengths, cu_q_lens=cu_q_lens,
                num_seqs=num_seqs, scale=scale, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap, **scales, **extras)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens, num_seqs, *,
                           scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                           attention_chunk_size=None, implementation=None):
    """Attention of a ragged batch of new tokens over a paged KV cache (mixed prefill + decode).

    Sequence ``i < num_seqs`` owns the query rows ``cu_q_lens[i]:cu_q_lens[i + 1]``; they are
    its last ``n_i = cu_q_lens[i + 1] - cu_q_lens[i]`` tokens, whose keys and values (the
    new ones included) are already in its pages, ``kv_lengths[i]`` tokens in all. Row ``r``
    of sequence ``i`` sits at position ``p = kv_lengths[i] - (cu_q_lens[i + 1] - r)``
    (bottom-right alignment, per sequence) and computes

    ``out[r, h] = sum_j softmax_j(cap(scale * q[r, h] . k[i, j, h // g])) * v[i, j, h // g]``

    over the keys ``j`` it sees: ``j <= p``, ``j < kv_lengths[i]``, with a sliding
    window ``j > p - sliding_window``, and with chunked attention ``j // c == p // c``
    (``c = attention_chunk_size``). Attention sinks (``sinks[h]``) join every row's
    denominator as in :func:`forge_jax.attention`. Here ``k[i, j] = k_pages[:, block_tables[i, j //
    page_size], j % page_size]``, ``g = q_heads // kv_heads`` and ``cap(x) = logits_soft_cap
    * tanh(x / logits_soft_cap)`` when a soft cap is given. Logits, softmax and the weighted
    sum run in float32. This is :func:`forge_jax.paged_attention` of each sequence's rows,
    and :func:`forge_jax.attention` on its gathered keys and values.

    Whatever the slots a query does not see hold (stale or NaN values, the tail of a last
    page, unused pages and block-table entries) never reaches its output; NaN in data a
    query sees propagates. A query that sees no key returns zeros. Rows from
    ``cu_q_lens[num_seqs]`` on are padding and return zeros whatever ``q`` holds there;
    sequences ``i >= num_seqs`` are ignored, whatever their entries of ``block_tables``,
    ``kv_lengths`` and ``cu_q_lens[i + 1]`` hold.

    Values are checked where they are concrete: ``0 <= num_seqs <= max_seqs``,
    ``cu_q_lens[0] == 0`` and non-decreasing up to ``cu_q_lens[num_seqs] <= total_tokens``,
    ``n_i <= kv_lengths[i] <= pages_per_seq * page_size`` and every page a sequence uses in
    ``[0, num_pages)``. Under ``jax.jit`` they cannot be; out-of-range values are then safe
    (no page the table does not name is ever read) and give these results (the index
    contract in the docstring of :mod:`forge_jax.ops.paged`): ``num_seqs`` is clamped to
    ``[0, max_seqs]``; a used page id outside ``[0, num_pages)`` reads nothing (its slots
    are invisible, as if masked); ``kv_lengths`` are clamped to ``[0, pages_per_seq *
    page_size]``, positions included; a query at a negative position (``n_i >
    kv_lengths[i]``) sees nothing and returns zeros; a row outside its sequence's range
    (``cu_q_lens`` decreasing) returns zeros. Inside :func:`forge_jax.debug_checks` the
    traced values get the concrete checks as checkify checks.

    Implementations (``fj.explain("ragged_paged_attention", ...)`` says which runs):
    ``"xla"``, :func:`ragged_paged_attention_xla` below, the reference; the Pallas kernels
    ``pallas_kernels/tpu/ragged_paged_attention.py`` (Mosaic TPU) and
    ``pallas_kernels/gpu/mosaic_ragged_paged_attention.py`` (Mosaic GPU, Hopper). Partition
    rule: :func:`_ragged_paged_attention_partition` below. Tests: ``tests/test_ragged.py``,
    ``tests/cases/ragged_base.py``, ``tests/test_pallas_{tpu,mgpu}_ragged.py``.

    Args:
      q: ``[total_tokens, q_heads, head_dim]``, the sequences' new tokens, concatenated.
      k_pages, v_pages: ``[kv_heads, num_pages, page_size, head_dim]``, same dtype (may differ
        from ``q``'s; the math is float32 either way), ``q_heads % kv_heads == 0``; or both
        int8/fp8 ``QuantizedArray`` pools, a scale per token and KV head
        (:mod:`forge_jax.ops.kv_quant`), dequantized slot by slot as they are read (a
        hidden slot's scale, NaN say, is as invisible as its values); or both ``FoldedPages``
        (:mod:`forge_jax.ops.kv_fold`).
      block_tables: int ``[max_seqs, pages_per_seq]``, each sequence's pages in order.
      kv_lengths: int ``[max_seqs]``, tokens in the cache per sequence, new ones included.
      cu_q_lens: int ``[max_seqs + 1]``, ``cu_q_lens[0] == 0``, non-decreasing: sequence
        ``i``'s rows of ``q`` are ``cu_q_lens[i]:cu_q_lens[i + 1]``.
      num_seqs: int scalar (a Python int or an int32 array, possibly traced), the number of
        sequences in this step.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      sliding_window: optional positive int; a query sees itself and the
        ``sliding_window - 1`` keys before it.
      logits_soft_cap: optional positive float.
      sinks: optional float ``[q_heads]``, attention sinks (as :func:`forge_jax.attention`).
      attention_chunk_size: optional positive int, chunked attention (as
        :func:`forge_jax.attention`).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[total_tokens, q_heads, head_dim]`` in ``q.dtype``.
    """
    args = _ragged_args(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens, num_seqs,
                        scale=scale, sliding_window=sliding_window,
                        logits_soft_cap=logits_soft_cap, sinks=sinks,
                        attention_chunk_size=attention_chunk_size)
    return dispatch.call("ragged_paged_attention", args, implementation)


def _ragged_paged_attention_partition(args, config):
    """How ``ragged_paged_attention`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    q, pages = args["q"], args["k_pages"]  # q [tokens, heads, dim]
    h = sharding.heads_axis(config, q.shape[1], pages.shape[0])
    ps = P(h, None, None, None)
    specs = {"q": P(None, h, None), "k_pages": ps, "v_pages": ps, "block_tables": P(),
             "kv_lengths": P(), "cu_q_lens": P()}
    if "k_scales" in args:
        specs.update(k_scales=ps, v_scales=ps)
    if isinstance(args["num_seqs"], jax.Array | np.ndarray):
        specs["num_seqs"] = P()
    if args.get("sinks") is not None:
        specs["sinks"] = P(h)
    return specs, P(None, h, None)


dispatch.define("ragged_paged_attention", _ragged_args, partition=_ragged_paged_attention_partition)


def _token_rows(block_tables, kv_lengths, cu_q_lens, num_seqs, total_tokens, capacity):
    """Each query row's sequence ``[tokens]`` (in ``[0, max_seqs)``), kv length ``[tokens]``
    (0 for padding rows, which therefore see nothing and read no page) and position
    ``[tokens]`` (-1 for padding rows)."""
    max_seqs = block_tables.shape[0]
    cu = cu_q_lens.astype(jnp.int32)
    kv = clamp_lengths(kv_lengths, capacity)
    n = jnp.clip(jnp.asarray(num_seqs).astype(jnp.int32), 0, max_seqs)
    # Ends of the active sequences, then "never": sorted whenever cu_q_lens is valid, so the
    # search finds each row's sequence; ignored sequences' entries play no part.
    ends = jnp.where(jnp.arange(max_seqs) < n, cu[1:], jnp.iinfo(jnp.int32).max)
    rows = jnp.arange(total_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # [tokens], in [0, max_seqs]
    active = seq < n
    seq = jnp.minimum(seq, max_seqs - 1)
    end = cu[seq + 1]
    active &= (rows >= cu[seq]) & (rows < end)
    lengths = jnp.where(active, kv[seq], 0)
    positions = jnp.where(active, kv[seq] - (end - rows), -1)
    return seq, lengths, positions


def _attend_rows(q, k_pages, v_pages, tables, lengths, positions, *, scale, sliding_window,
                 logits_soft_cap, k_scales=None, v_scales=None, sinks=None,
                 attention_chunk_size=None):
    """Each row of ``q [rows, q_heads, head_dim]`` over the pages of its own block table."""
    rows, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    groups = q_heads // kv_heads
    k, named = named_pages(k_pages, tables, lengths)  # [kv_heads, rows, seq, head_dim]
    v, _ = named_pages(v_pages, tables, lengths)
    if k_scales is not None:  # quantized: dequantize the named slots only
        k = kv_quant.dequantize_vectors(k, named_pages(k_scales, tables, lengths)[0])
        v = kv_quant.dequantize_vectors(v, named_pages(v_scales, tables, lengths)[0])
    seq = k.shape[2]
    # Slots past the length or on an entry that names no page are invisible.
    mask = visible_mask(positions[:, None], seq, causal=True, kv_lengths=None,
                        sliding_window=sliding_window,
                        attention_chunk_size=attention_chunk_size)[:, 0] & named  # [rows, seq]
    # Hidden slots may hold NaN or inf (a zero probability times NaN is still NaN): each
    # row zeroes the keys and values it does not see (the keys for the gradient of q). A
    # non-finite value it sees makes its output NaN (the attention contract), also where
    # the probability underflowed to zero.
    seen = mask[None, :, :, None]
    k = jnp.where(seen, k, jnp.zeros((), k.dtype))
    v = jnp.where(seen, v, jnp.zeros((), v.dtype))
    finite = jnp.isfinite(v)
    seen_non_finite = jnp.any(~finite, axis=2)[:, :, None, :]  # [k, rows, 1, d]
    v = jnp.where(finite, v, jnp.zeros((), v.dtype))
    qg = jnp.swapaxes(q.reshape(rows, kv_heads, groups, head_dim), 0, 1)  # [k, rows, g, d]
    logits = exact_logits("krgd,krsd->krgs", qg, k)
    probs = masked_probs(logits, mask[None, :, None, :], scale=scale,
                         logits_soft_cap=logits_soft_cap,
                         sinks=None if sinks is None else jnp.asarray(sinks).reshape(
                             kv_heads, 1, groups, 1))
    out = jnp.einsum("krgs,krsd->krgd", probs, v.astype(jnp.float32),
                     preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    out = jnp.where(seen_non_finite, jnp.float32(jnp.nan), out)
    return jnp.swapaxes(out, 0, 1).reshape(rows, q_heads, head_dim).astype(q.dtype)


def _by_rows(q, k_pages, v_pages, k_scales, v_scales, sinks, block_tables, kv_lengths,
             cu_q_lens, num_seqs, *, masking):
    """The differentiable formulation (reverse and forward mode): every row over its own
    sequence's pages (:func:`_attend_rows`), in blocks of ``_ROWS_PER_STEP`` rows."""
    total_tokens, q_heads, head_dim = q.shape
    seq, lengths, positions = _token_rows(block_tables, kv_lengths, cu_q_lens, num_seqs,
                                          total_tokens, block_tables.shape[1] * k_pages.shape[2])
    tables = block_tables[seq]
    attend = lambda q, tables, lengths, positions: _attend_rows(  # noqa: E731
        q, k_pages, v_pages, tables, lengths, positions, k_scales=k_scales, v_scales=v_scales,
        sinks=sinks, **masking)
    block = _ROWS_PER_STEP
    if total_tokens <= block:
        return attend(q, tables, lengths, positions)
    steps = -(-total_tokens // block)
    pad = steps * block - total_tokens
    # Pad rows have length 0: they see nothing and are dropped below.
    blocks = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
        steps, block, *x.shape[1:]) for x in (q, tables, lengths, positions)]
    out = jax.lax.map(lambda xs: attend(*xs), tuple(blocks))
    return out.reshape(-1, q_heads, head_dim)[:total_tokens]


def _by_sequences(q, k_pages, v_pages, k_scales, v_scales, sinks, block_tables, kv_lengths,
                  cu_q_lens, num_seqs, *, masking):
    """The forward: each prefill chunk by blocks of ``_SEQ_BLOCK`` rows over its sequence's
    pages, the decode rows by groups of ``_DECODE_ROWS`` (each row over its own pages), both
    through :func:`forge_jax.ops.paged.paged_attention_xla` (the same masking contract);
    loops of a traced trip count, so a step pays for the rows it has."""
    total_tokens, q_heads, head_dim = q.shape
    max_seqs = block_tables.shape[0]
    seq, lengths, positions = _token_rows(block_tables, kv_lengths, cu_q_lens, num_seqs,
                                          total_tokens, block_tables.shape[1] * k_pages.shape[2])
    cu = cu_q_lens.astype(jnp.int32)
    n = jnp.clip(jnp.asarray(num_seqs).astype(jnp.int32), 0, max_seqs)
    q_lens = jnp.where(jnp.arange(max_seqs) < n, cu[1:] - cu[:-1], 0)  # [max_seqs]
    kv = clamp_lengths(kv_lengths, block_tables.shape[1] * k_pages.shape[2])
    pools = dict(k_pages=k_pages, v_pages=v_pages, k_scales=k_scales, v_scales=v_scales,
                 sinks=sinks)
    single = (lengths > 0) & (q_lens[seq] == 1)  # [tokens]: decode rows that see a key
    out = jnp.zeros(q.shape, q.dtype)

    # Decode rows: gathered into groups, each row over its own pages.
    g = min(total_tokens, _DECODE_ROWS)
    count = jnp.sum(single, dtype=jnp.int32)
    picked = jnp.nonzero(single, size=total_tokens, fill_value=total_tokens)[0]
    picked = jnp.pad(picked.astype(jnp.int32), (0, -total_tokens % g),
                     constant_values=total_tokens)

    def decode_group(i, out):
        rows = jax.lax.dynamic_slice_in_dim(picked, i * g, g)  # total_tokens: no row
        row = jnp.minimum(rows, total_tokens - 1)
        got = paged_attention_xla(
            q[row], block_tables=block_tables[seq[row]],
            lengths=jnp.where(rows < total_tokens, lengths[row], 0), q_positions=None,
            **pools, **masking)  # [g, q_heads, head_dim]
        return out.at[rows].set(got, mode="drop")

    # A loop carries the page pools in its state, which XLA:CPU copies on entry: a step
    # whose rows fit one group (every decode step up to _DECODE_ROWS) runs it without one,
    # and a loop runs only when it has work.
    if g == total_tokens:
        out = decode_group(0, out)
    else:
        out = jax.lax.cond(count > 0, lambda out: jax.lax.fori_loop(
            0, -(-count // g), decode_group, out), lambda out: out, out)

    # Prefill chunks: blocks of b rows of one sequence, its pages gathered once per block.
    b = min(total_tokens, _SEQ_BLOCK)
    blocks = jnp.where(q_lens >= 2, -(-q_lens // b), 0)  # [max_seqs]
    block_ends = jnp.cumsum(blocks)
    pad = lambda x, value: jnp.pad(x, [(0, b)] + [(0, 0)] * (x.ndim - 1),  # noqa: E731
                                   constant_values=value)
    q_pad, seq_pad, pos_pad = pad(q, 0), pad(seq, -1), pad(positions, -1)
    out = pad(out, 0)
    row_ids = jnp.arange(total_tokens + b, dtype=jnp.int32)

    def chunk_block(i, out):
        s = jnp.searchsorted(block_ends, i, side="right").astype(jnp.int32)
        start = cu[s] + (i - (block_ends[s] - blocks[s])) * b
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, b)  # noqa: E731
        # (dynamic_slice clamps a start past the end: the row ids clamp with it)
        mine = (take(seq_pad) == s) & (take(pos_pad) >= 0) & (take(row_ids) < total_tokens)
        got = paged_attention_xla(
            take(q_pad)[None], block_tables=block_tables[s][None], lengths=kv[s][None],
            q_positions=jnp.where(mine, take(pos_pad), -1)[None], **pools, **masking)[0]
        kept = jnp.where(mine[:, None, None], got, take(out))
        return jax.lax.dynamic_update_slice_in_dim(out, kept, start, 0)

    out = jax.lax.cond(block_ends[-1] > 0, lambda out: jax.lax.fori_loop(
        0, block_ends[-1], chunk_block, out), lambda out: out, out)
    return out[:total_tokens]


@dispatch.register("ragged_paged_attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="prefill chunks by blocks of one sequence over its pages, "
                               "decode rows each over its own; masked float32 softmax")
def ragged_paged_attention_xla(q, k_pages, v_pages, block_tables, kv_lengths, cu_q_lens,
                               num_seqs, *, scale, sliding_window, logits_soft_cap,
                               k_scales=None, v_scales=None, fold=1, sinks=None,
                               attention_chunk_size=None):
    q, k_pages, v_pages = map(jnp.asarray, (q, k_pages, v_pages))
    if fold > 1:  # folded pools (forge_jax.ops.kv_fold): read the logical view
        k_pages, v_pages = kv_fold.unfold(k_pages, fold), kv_fold.unfold(v_pages, fold)
    total_tokens, q_heads, head_dim = q.shape
    if scale is None:
        scale = head_dim ** -0.5
    if total_tokens == 0 or block_tables.shape[0] == 0 or k_pages.shape[1] == 0:
        return jnp.zeros(q.shape, q.dtype)  # no row can see a key
    masking = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                   attention_chunk_size=attention_chunk_size)
    ints = (jnp.asarray(block_tables).astype(jnp.int32), jnp.asarray(kv_lengths),
            jnp.asarray(cu_q_lens), jnp.asarray(num_seqs).astype(jnp.int32))

    # The loops' trip counts are traced, which reverse mode cannot differentiate: the
    # derivatives are those of the row-by-row formulation (the same function).
    @jax.custom_jvp
    def attend(floats, ints):
        return _by_sequences(*floats, *ints, masking=masking)

    @attend.defjvp
    def attend_jvp(primals, tangents):
        floats, ints = primals
        _, tangent = jax.jvp(lambda f: _by_rows(*f, *ints, masking=masking), (floats,),
                             (tangents[0],))
        return attend(floats, ints), tangent

    with jax.named_scope("ragged_paged_attention"):
        return attend((q, k_pages, v_pages, k_scales, v_scales, sinks), ints)


# The ragged layout's checks, shared with the other ops that take it
# (forge_jax.ops.mla.mla_paged_attention).
check_num_seqs = _check_num_seqs
check_ragged_values = _check_values
token_rows = _token_rows
