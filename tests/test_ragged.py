"""ragged_paged_attention: a mix of prefill and decode sequences in one call.

Every cache slot no query may see holds NaN: the tail of each last page, spare pages,
the slots a sliding window hides from all of a sequence's queries, the pages of
sequences past ``num_seqs``. Ignored sequences' block tables, lengths and
``cu_q_lens`` entries hold garbage, and the padding rows of ``q`` hold NaN. The op is
compared with a float64 reference written from the ragged definition, with
``fj.paged_attention`` on the same pages (one padded sequence per batch row) and with
``fj.attention`` on the keys and values ``fj.paged_gather`` returns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import PAGED_STATIC, jit_ragged_paged_attention
from cases.checks import assert_close, assert_raises_as_listed
from cases.inputs import rng
from cases.paged import RAGGED_MIXES, make_step
from cases.references import f64, ragged_paged_attention_ref

import forge_jax as fj
from forge_jax import dispatch, tolerances

ragged = jit_ragged_paged_attention


@functools.partial(jax.jit, static_argnames=PAGED_STATIC)
def xla_references(q, k_pages, v_pages, block_tables, lengths, positions, **masking):
    """fj.paged_attention on the pages, fj.attention on what fj.paged_gather returns."""
    paged = fj.paged_attention(q, k_pages, v_pages, block_tables, lengths, q_positions=positions,
                               **masking)
    k = fj.paged_gather(k_pages, block_tables, lengths)
    v = fj.paged_gather(v_pages, block_tables, lengths)
    dense = fj.attention(q, k, v, q_positions=positions, kv_lengths=lengths, **masking)
    return paged, dense

def padded_references(step, **masking):
    """fj.paged_attention and fj.attention of each sequence's rows, scattered back to rows."""
    n = step.num_seqs
    cu, kv = step.cu_q_lens[:n + 1], step.kv_lengths[:n]
    q_lens = np.diff(cu)
    width = max(int(q_lens.max()), 1)
    t = np.arange(width)[None, :]
    # Pad queries sit at position -1: they see nothing.
    positions = np.where(t < q_lens[:, None], kv[:, None] - q_lens[:, None] + t, -1)
    rows = np.minimum(cu[:-1, None] + t, step.q.shape[0] - 1)
    paged, dense = xla_references(step.q[rows], step.k_clean, step.v_clean,
                                  step.block_tables[:n], kv, positions.astype(np.int32),
                                  **masking)
    take = t < q_lens[:, None]
    return f64(paged)[take], f64(dense)[take], np.asarray(cu[:-1, None] + t)[take]


def check_step(step, out, *, dtype, xla_ops=True, **masking):
    """``out`` against the float64 reference and (``xla_ops``) fj.paged_attention and
    fj.attention; padding rows exactly zero."""
    ref = ragged_paged_attention_ref(step, **masking)
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    assert_close(out, ref, dtype=dtype)
    end = step.cu_q_lens[step.num_seqs]
    np.testing.assert_array_equal(f64(out)[end:], 0.0)
    if not xla_ops:
        return
    paged, dense, rows = padded_references(step, **masking)
    tol = tolerances.tolerance(dtype).as_kwargs()
    np.testing.assert_allclose(f64(out)[rows], paged, **tol)
    np.testing.assert_allclose(f64(out)[rows], dense, **tol)


MIXED = RAGGED_MIXES["mixed"]


@pytest.mark.parametrize("mix,heads,dtype,q_dtype,page_size", [
    ("decode", "gqa", jnp.float32, None, 8),
    ("prefill", "mqa", jnp.bfloat16, None, 16),
    ("chunked_prefill", "gqa", jnp.float32, None, 1),
    ("mixed", "mha", jnp.float32, None, 4),
    ("mixed", "gqa", jnp.bfloat16, None, 8),
    ("mixed", "mqa", jnp.bfloat16, jnp.float32, 8),  # bfloat16 cache, float32 queries
])
def test_matches_references(mix, heads, dtype, q_dtype, page_size):
    step = make_step(rng(*mix.encode(), page_size), **RAGGED_MIXES[mix], page_size=page_size,
                     heads=heads, head_dim=16,
                     dtype=dtype, q_dtype=q_dtype)
    check_step(step, ragged(*step.args()), dtype=q_dtype or dtype)


@pytest.mark.parametrize("dtype,window,cap,scale,xla_ops", [
    (jnp.float32, 5, None, None, True), (jnp.float32, None, 3.0, 0.3, True),
    (jnp.bfloat16, 3, 2.0, None, True), (jnp.float32, 1, None, None, False)])
def test_sliding_window_and_soft_cap(dtype, window, cap, scale, xla_ops):
    step = make_step(rng(window or 0, int(cap or 0)), **MIXED, page_size=4, heads="gqa",
                     head_dim=16, dtype=dtype,
                     window=window)
    assert np.isnan(f64(step.k_pages)).sum() > np.isnan(f64(step.k_clean)).sum()
    out = ragged(*step.args(), scale=scale, sliding_window=window, logits_soft_cap=cap)
    check_step(step, out, dtype=dtype, xla_ops=xla_ops, scale=scale, sliding_window=window,
               logits_soft_cap=cap)


def test_concrete_values_with_garbage_in_ignored_entries_pass_and_python_int_num_seqs():
    """Concrete valid input, garbage in the ignored sequences' entries: the value checks pass
    (explain validates as the op does); a Python int num_seqs gives the traced one's result."""
    step = make_step(rng(5), **MIXED, page_size=8, heads="gqa", head_dim=8,
                     dtype=jnp.float32)
    assert step.cu_q_lens[step.num_seqs + 1] != step.cu_q_lens[step.num_seqs]  # garbage
    fj.explain("ragged_paged_attention", *step.args()[:-1], step.num_seqs)
    out = jax.jit(lambda *a: fj.ragged_paged_attention(*a, step.num_seqs))(*step.args()[:-1])
    check_step(step, out, dtype=jnp.float32, xla_ops=False)


def test_row_blocks_longer_than_one_step():
    """More rows than one step of the XLA implementation attends at once."""
    step = make_step(rng(6), q_lens=[130, 1, 150, 7], kv_lens=[160, 20, 150, 9],
                     max_seqs=5, total_tokens=300, page_size=16, heads="gqa", head_dim=8,
                     dtype=jnp.float32)
    assert step.q.shape[0] > 256
    out = ragged(*step.args(), sliding_window=100)
    ref = ragged_paged_attention_ref(step, sliding_window=100)
    assert_close(out, ref, dtype=jnp.float32)
    np.testing.assert_array_equal(f64(out[288:]), 0.0)


# Mixes for the XLA forward's sequence blocks (32 rows of one sequence) and decode groups
# (32 rows): chunks spanning several blocks, a last block reaching into the next sequence's
# rows, more decode rows than one group, decode rows between chunks, a two-row chunk and
# a sequence with no new token.
SEQUENCE_BLOCK_MIXES = {
    "chunks_across_blocks": ([33, 64, 2, 70], [40, 64, 90, 75], 176),
    "decode_groups_between_chunks": ([1] * 20 + [37] + [1] * 19 + [0, 5],
                                     [int(x) for x in np.arange(42) * 7 % 61 + 1], 90),
    "one_long_chunk_and_decodes": ([1, 1, 100, 1], [9, 60, 130, 33], 128),
}


@pytest.mark.parametrize("mix", list(SEQUENCE_BLOCK_MIXES))
def test_sequence_blocks_and_decode_groups_against_float64(mix):
    """Chunks by blocks of one sequence and decode rows by groups, against float64, with
    every slot no query may see holding NaN; a sliding window hides more of them."""
    q_lens, kv_lens, total = SEQUENCE_BLOCK_MIXES[mix]
    kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens, strict=True)]
    for window in (None, 24):
        step = make_step(rng(14, len(q_lens)), q_lens, kv_lens, max_seqs=len(q_lens) + 2,
                         total_tokens=total, page_size=8, heads="gqa", head_dim=8,
                         dtype=jnp.float32, window=window)
        check_step(step, ragged(*step.args(), sliding_window=window), dtype=jnp.float32,
                   xla_ops=False, sliding_window=window)


def test_one_compilation_serves_any_mix():
    traces = []

    def step_fn(*args):
        traces.append(1)
        return fj.ragged_paged_attention(*args, sliding_window=12)

    step_fn = jax.jit(step_fn)
    gen = rng(7)
    shapes = dict(max_seqs=6, total_tokens=24, page_size=8, heads="gqa", head_dim=8,
                  dtype=jnp.float32, pages_per_seq=6, num_pages=30)
    mixes = [([4, 1, 1], [4, 30, 9]), ([1, 1, 7, 1, 5, 1], [40, 2, 7, 13, 25, 1]), ([], [])]
    for q_lens, kv_lens in mixes:
        if not q_lens:  # nothing scheduled: every row is padding
            step = make_step(gen, [1], [3], **shapes)
            step.num_seqs = 0
            out = step_fn(*step.args())
            np.testing.assert_array_equal(f64(out), 0.0)
            continue
        step = make_step(gen, q_lens, kv_lens, **shapes)
        out = step_fn(*step.args())
        assert_close(out, ragged_paged_attention_ref(step, sliding_window=12), dtype=jnp.float32)
    assert len(traces) == 1


def test_padding_rows_are_zero_whatever_q_holds():
    step = make_step(rng(8), **MIXED, page_size=4, heads="mqa", head_dim=8,
                     dtype=jnp.float32)
    end = step.cu_q_lens[step.num_seqs]
    step.q[end:end + 2] = [[[np.inf]], [[-np.inf]]]  # NaN after them
    out = f64(ragged(*step.args()))
    np.testing.assert_array_equal(out[end:], 0.0)
    assert_close(out[:end], ragged_paged_attention_ref(step)[:end], dtype=jnp.float32)


def _poison_visible(step, pages, value):
    """``value`` in slot 1 of sequence 0, kv head 0 (seen by rows 1 and 2 only)."""
    pages[0, step.block_tables[0, 0], 1] = value


def _nan_rows_and_heads(out):
    nan = np.isnan(f64(out))
    # Rows 1 and 2 (positions 1, 2) see slot 1 through q heads 0..3; row 0 and sequence 1 not.
    return nan[1:3, :4].all() and not nan[1:3, 4:].any() and not nan[0].any() and \
        not nan[3:].any()


def _visible_nan_step():
    return make_step(rng(9), q_lens=[3, 2], kv_lens=[3, 5], max_seqs=2,
                     total_tokens=5, page_size=4, heads="gqa", head_dim=8, dtype=jnp.float32)


@pytest.mark.parametrize("where,value", [("v", np.nan), ("v", np.inf), ("k", np.nan)])
def test_non_finite_visible_data_gives_nan_only_where_seen(where, value):
    step = _visible_nan_step()
    _poison_visible(step, step.k_pages if where == "k" else step.v_pages, value)
    assert _nan_rows_and_heads(ragged(*step.args()))


def test_out_of_range_values_under_jit_are_safe():
    """Values jit cannot check: clamped or hidden as documented, other sequences intact."""
    step = make_step(rng(10), q_lens=[2, 3, 1], kv_lens=[9, 12, 5],
                     max_seqs=3, total_tokens=8, page_size=4, heads="gqa", head_dim=8,
                     dtype=jnp.float32)
    ref = ragged_paged_attention_ref(step)
    q, k, v, tables, kv, cu, _ = step.args()
    # num_seqs past max_seqs is max_seqs, below zero is zero.
    np.testing.assert_array_equal(f64(ragged(q, k, v, tables, kv, cu, np.int32(7))),
                                  f64(ragged(q, k, v, tables, kv, cu, np.int32(3))))
    np.testing.assert_array_equal(f64(ragged(q, k, v, tables, kv, cu, np.int32(-4))), 0.0)
    # Page ids out of range (read nothing) in sequence 0 leave the others' rows intact.
    bad = step.block_tables.copy()
    bad[0, :2] = [-5, 1 << 30]
    out = f64(ragged(q, k, v, bad, kv, cu, np.int32(3)))
    np.testing.assert_allclose(out[2:6], ref[2:6], **tolerances.tolerance(jnp.float32).as_kwargs())
    # More new tokens than kv_lengths: the queries at negative positions see nothing.
    short = step.kv_lengths.copy()
    short[1] = 1
    out = f64(ragged(q, k, v, tables, short, cu, np.int32(3)))
    np.testing.assert_array_equal(out[2:4], 0.0)
    assert np.isfinite(out[4]).all() and np.abs(out[4]).max() > 0


def test_grads_match_dense_attention_despite_nan_in_hidden_slots():
    step = make_step(rng(12), q_lens=[3, 1, 4], kv_lens=[3, 9, 6], max_seqs=3,
                     total_tokens=10, page_size=4, heads="gqa", head_dim=8, dtype=jnp.float32)
    q, k_pages, v_pages, tables, kv, cu, n = step.args()
    w = jnp.asarray(rng(13).standard_normal(q.shape), jnp.float32)

    def ragged_loss(q, k_pages, v_pages):
        return jnp.sum(fj.ragged_paged_attention(q, k_pages, v_pages, tables, kv, cu, n) * w)

    # The same rows as one dense batch row per sequence, padded with rows that see nothing.
    rows = np.array([[0, 1, 2, 9], [3, 9, 9, 9], [4, 5, 6, 7]])
    positions = np.array([[0, 1, 2, -1], [8, -1, -1, -1], [2, 3, 4, 5]], np.int32)
    lens = jnp.asarray([3, 9, 6], jnp.int32)

    def dense_loss(q, k, v):
        out = fj.attention(q[rows], k, v, q_positions=positions, kv_lengths=lens)
        return jnp.sum(out * w[rows] * (positions >= 0).astype(np.float32)[:, :, None, None])

    dq, dk_pages, dv_pages = jax.jit(jax.grad(ragged_loss, argnums=(0, 1, 2)))(
        q, k_pages, v_pages)
    dense_k, dense_v = (jnp.asarray(x, jnp.float32) for x in (step.dense_k, step.dense_v))
    want_q, want_k, want_v = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(
        jnp.where(jnp.isnan(q), 0.0, q), dense_k, dense_v)
    tol = tolerances.tolerance(jnp.float32).as_kwargs()
    np.testing.assert_allclose(f64(dq), f64(want_q), **tol)  # padding rows: zero
    for got, want in ((dk_pages, want_k), (dv_pages, want_v)):
        assert np.isfinite(f64(got)).all()
        back = fj.paged_gather(got, tables, lens)
        np.testing.assert_allclose(f64(back), f64(want), **tol)


def test_auto_selects_xla_and_explain_validates():
    step = make_step(rng(11), q_lens=[1], kv_lens=[3], max_seqs=1,
                     total_tokens=1, page_size=4, heads="mqa", head_dim=8, dtype=jnp.float32)
    assert fj.explain("ragged_paged_attention", *step.args()).implementation == "xla"
    assert "xla" in dispatch.implementations("ragged_paged_attention", "cpu")


# --- bad input ----------------------------------------------------------------------------


def _good():
    """Valid placeholders (NumPy: validation reads shapes, dtypes and concrete values)."""
    return dict(q=np.ones((6, 4, 8), np.float32), k_pages=np.ones((2, 5, 4, 8), np.float32),
                v_pages=np.ones((2, 5, 4, 8), np.float32),
                block_tables=np.asarray([[0, 1], [2, 3], [9, 9]], np.int32),
                kv_lengths=np.asarray([5, 2, 99], np.int32),
                cu_q_lens=np.asarray([0, 4, 5, -3], np.int32), num_seqs=2)


def _call(**changes):
    args = _good()
    masking = {k: changes.pop(k) for k in ("sliding_window", "logits_soft_cap", "scale")
               if k in changes}
    args.update(changes)
    return lambda: fj.ragged_paged_attention(*args.values(), **masking)


BAD = {
    "q_rank": (_call(q=np.ones((1, 6, 4, 8))), ValueError, r"q must have rank 3"),
    "q_int": (_call(q=np.ones((6, 4, 8), np.int32)), TypeError, r"q\.dtype=int32"),
    "pages_shape": (_call(v_pages=np.ones((2, 5, 2, 8))), ValueError, r"v_pages\.shape"),
    "pages_dtype": (_call(v_pages=np.ones((2, 5, 4, 8), jnp.bfloat16)), TypeError,
                    r"v_pages\.dtype"),
    "head_dim": (_call(q=np.ones((6, 4, 16))), ValueError, r"head_dim.*q\.shape=\(6, 4, 16\)"),
    "heads": (_call(q=np.ones((6, 3, 8))), ValueError, r"q_heads \(3\).*kv_heads \(2\)"),
    "no_q_heads": (_call(q=np.ones((6, 0, 8))), ValueError, r"q_heads.*q\.shape=\(6, 0, 8\)"),
    "tables_float": (_call(block_tables=np.ones((3, 2))), TypeError, r"block_tables\.dtype"),
    "kv_lengths_shape": (_call(kv_lengths=np.ones((2,), np.int32)), ValueError,
                         r"kv_lengths must be \[max_seqs\] = \(3,\).*\(2,\)"),
    "cu_shape": (_call(cu_q_lens=np.zeros((3,), np.int32)), ValueError,
                 r"cu_q_lens must be \[max_seqs \+ 1\] = \(4,\).*\(3,\)"),
    "cu_float": (_call(cu_q_lens=np.zeros((4,), np.float32)), TypeError,
                 r"cu_q_lens\.dtype=float32"),
    "num_seqs_float": (_call(num_seqs=1.0), TypeError, r"num_seqs.*float"),
    "num_seqs_bool": (_call(num_seqs=True), TypeError, r"num_seqs=True"),
    "num_seqs_vector": (_call(num_seqs=np.ones((1,), np.int32)), ValueError,
                        r"num_seqs\.shape=\(1,\)"),
    "num_seqs_float_array": (_call(num_seqs=np.float32(1)), TypeError,
                             r"num_seqs\.dtype=float32"),
    "num_seqs_range": (_call(num_seqs=4), ValueError, r"\[0, max_seqs=3\].*num_seqs=4"),
    "num_seqs_negative": (_call(num_seqs=np.int32(-1)), ValueError, r"num_seqs=-1"),
    "cu_start": (_call(cu_q_lens=np.asarray([1, 4, 5, 5], np.int32)), ValueError,
                 r"cu_q_lens\[0\]=1"),
    "cu_decreasing": (_call(cu_q_lens=np.asarray([0, 4, 3, 5], np.int32)), ValueError,
                      r"cu_q_lens\[1\]=4 > cu_q_lens\[2\]=3"),
    "cu_past_q": (_call(cu_q_lens=np.asarray([0, 4, 7, 7], np.int32)), ValueError,
                  r"cu_q_lens\[num_seqs=2\]=7 exceeds the 6 rows"),
    "q_len_over_kv": (_call(kv_lengths=np.asarray([3, 2, 0], np.int32)), ValueError,
                      r"kv_lengths\[0\]=3 must count its 4 new tokens"),
    "kv_over_capacity": (_call(kv_lengths=np.asarray([5, 9, 0], np.int32)), ValueError,
                         r"kv_lengths\[1\]=9.*2 \* 4 = 8"),
    "page_out_of_range": (_call(block_tables=np.asarray([[0, 5], [2, 3], [0, 0]], np.int32)),
                          ValueError, r"block_tables\[0, 1\]=5.*num_pages=5"),
    "page_negative": (_call(block_tables=np.asarray([[0, 1], [-1, 3], [0, 0]], np.int32)),
                      ValueError, r"block_tables\[1, 0\]=-1"),
    "window": (_call(sliding_window=0), ValueError, r"sliding_window=0"),
    "cap": (_call(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap=-1\.0"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_before_work(name):
    assert_raises_as_listed(BAD[name])


def test_good_placeholder_input_is_valid():
    """The base of the bad-input cases is itself valid (so each case fails for its reason)."""
    args = _good()
    assert fj.explain("ragged_paged_attention", *args.values()).implementation == "xla"
