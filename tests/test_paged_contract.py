"""The paged ops' contract for block tables, lengths, slots and copies.

One behaviour for ``paged_attention``, ``paged_gather``, ``paged_write``, ``copy_pages`` and
``ragged_paged_attention``, in every implementation:

* concrete arguments that name a page outside the pool (a block-table entry a sequence
  uses, a slot, a copy row), or lengths outside ``[0, max_pages * page_size]``, raise a
  ValueError naming the argument and the value, before any work (``fj.explain`` raises
  the same);
* traced arguments never read a page the table does not name: an out-of-range entry a
  sequence uses reads nothing (its slots are invisible, as if hidden by the mask), a
  traced length is clamped into ``[0, max_pages * page_size]``. The pool is NaN wherever
  no valid entry points, so a read of any other page shows;
* entries past a sequence's used pages may hold anything, concrete or traced;
* ``fj.debug_checks()`` with ``jax.experimental.checkify`` reports the traced errors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.references import f64
from jax.experimental import checkify

import forge_jax as fj

NUM_PAGES, PAGE, KV_HEADS, Q_HEADS, DIM, MAX_PAGES = 10, 8, 2, 4, 128, 4
CAPACITY = MAX_PAGES * PAGE
PAGED_IMPLS = ["xla", "pallas_gpu_interpret", "pallas_tpu_interpret"]
RAGGED_IMPLS = ["xla", "pallas_tpu_interpret"]

# Each sequence uses ceil(length / PAGE) entries of its row. Page 9 is spare and holds NaN,
# as does every slot past a sequence's length: a clamped or wrapped read shows.
TABLES = np.array([
    [1, 99, 4, -7],          # length 20: entry 1 (slots 8..15) names no page
    [-1, 2, 2**30, -1],      # length 12: entry 0 (slots 0..7) is negative
    [5, NUM_PAGES, 3, 2**30],  # length 24: entry 1 names page num_pages
    [0, 6, 7, 8],            # length 1000 > capacity 32 (traced: clamped to 32)
], np.int32)
LENGTHS = np.array([20, 12, 24, 1000], np.int32)
GOOD_TABLES = np.array([[1, 9, 4, -7], [9, 2, 2**30, -1], [5, 9, 3, 2**30], [0, 6, 7, 8]],
                       np.int32)


def _pools(seed=0):
    """NaN pools with finite data in the slots the valid entries of TABLES name (up to each
    sequence's clamped length), and the float64 per-sequence keys/values ``[batch,
    CAPACITY, kv_heads, dim]`` (NaN where nothing valid is named)."""
    rng = np.random.default_rng(seed)
    shape = (KV_HEADS, NUM_PAGES, PAGE, DIM)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    dense = np.full((2, len(TABLES), CAPACITY, KV_HEADS, DIM), np.nan)
    for b, (row, n) in enumerate(zip(TABLES, np.clip(LENGTHS, 0, CAPACITY), strict=True)):
        for pos in range(n):
            page = row[pos // PAGE]
            if 0 <= page < NUM_PAGES:
                kv = rng.standard_normal((2, KV_HEADS, DIM)).astype(np.float32)
                k_pages[:, page, pos % PAGE], v_pages[:, page, pos % PAGE] = kv
                dense[:, b, pos] = kv
    return jnp.asarray(k_pages), jnp.asarray(v_pages), dense


def _named(tables, lengths):
    """``[batch, CAPACITY]``: slot j of sequence b exists (j < clamped length) and its entry
    names a page of the pool."""
    j = np.arange(CAPACITY)
    entry = np.take_along_axis(tables, np.broadcast_to(j // PAGE, (len(tables), CAPACITY)), 1)
    return (j < np.clip(lengths, 0, CAPACITY)[:, None]) & (entry >= 0) & (entry < NUM_PAGES)


def _attention_ref(q, dense_k, dense_v, lengths, seen_slots):
    """float64 attention of ``q [batch, t, q_heads, dim]`` at the default (bottom-right)
    positions of the clamped lengths, over the slots ``seen_slots [batch, CAPACITY]``."""
    q = f64(q)
    batch, t_len, q_heads, dim = q.shape
    group = q_heads // KV_HEADS
    lengths = np.clip(lengths, 0, CAPACITY)
    out = np.zeros(q.shape)
    j = np.arange(CAPACITY)
    for b in range(batch):
        for t in range(t_len):
            p = lengths[b] - t_len + t
            seen = (j <= p) & seen_slots[b]
            if not seen.any():
                continue
            for h in range(q_heads):
                logits = dense_k[b, seen, h // group] @ q[b, t, h] / math.sqrt(dim)
                w = np.exp(logits - logits.max())
                out[b, t, h] = (w / w.sum()) @ dense_v[b, seen, h // group]
    return out


# --- concrete arguments: one-line ValueErrors before any work ---------------------------------


def _q(batch=4, q_len=None, seed=1):
    shape = (batch, Q_HEADS, DIM) if q_len is None else (batch, q_len, Q_HEADS, DIM)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _concrete_cases():
    k, v, _ = _pools()
    q = _q()
    tokens = jnp.ones((3, KV_HEADS, DIM), jnp.float32)
    good_len = np.array([20, 12, 24, 32], np.int32)

    def attend(tables=GOOD_TABLES, lengths=good_len):
        return ("paged_attention", (q, k, v, jnp.asarray(tables), jnp.asarray(lengths)))

    def gather(tables=GOOD_TABLES, lengths=good_len):
        return ("paged_gather", (k, jnp.asarray(tables), jnp.asarray(lengths)))

    def ragged(tables=GOOD_TABLES, lengths=good_len):
        return ("ragged_paged_attention",
                (q, k, v, jnp.asarray(tables), jnp.asarray(lengths),
                 jnp.asarray([0, 1, 2, 3, 4], jnp.int32), 4))

    def with_entry(b, i, value):
        tables = GOOD_TABLES.copy()
        tables[b, i] = value
        return tables

    def with_length(b, value):
        lengths = good_len.copy()
        lengths[b] = value
        return lengths

    cases = {}
    for name, call in (("attention", attend), ("gather", gather), ("ragged", ragged)):
        lengths_name = "kv_lengths" if name == "ragged" else "lengths"
        cases |= {
            f"{name}_entry_99": (call(with_entry(0, 1, 99)), r"block_tables\[0, 1\]=99"),
            f"{name}_entry_num_pages": (call(with_entry(2, 2, NUM_PAGES)),
                                        r"block_tables\[2, 2\]=10.*num_pages=10"),
            f"{name}_entry_negative": (call(with_entry(1, 0, -1)), r"block_tables\[1, 0\]=-1"),
            f"{name}_length_beyond_table": (call(lengths=with_length(3, 1000)),
                                            rf"{lengths_name}\[3\]=1000.*32"),
        }
        if name != "ragged":  # (ragged: a negative length cannot count its new token)
            cases[f"{name}_length_negative"] = (call(lengths=with_length(1, -3)),
                                                rf"{lengths_name}\[1\]=-3")
    slots = lambda s: ("paged_write", (k, v, tokens, tokens, jnp.asarray(s, jnp.int32)))
    cases["write_slot_past_pool"] = (slots([3, NUM_PAGES * PAGE, -1]),
                                     rf"slots\[1\]={NUM_PAGES * PAGE}.*80")
    copies = lambda c: ("copy_pages", (k, v, jnp.asarray(c, jnp.int32)))
    cases["copy_src_past_pool"] = (copies([[1, 2], [NUM_PAGES, 3]]), r"copies\[1, 0\]=10")
    cases["copy_dst_past_pool"] = (copies([[1, 99], [-1, -1]]), r"copies\[0, 1\]=99")
    cases["copy_dst_negative"] = (copies([[1, -2]]), r"copies\[0, 1\]=-2")
    return cases


CONCRETE = _concrete_cases()


@pytest.mark.parametrize("name", list(CONCRETE))
def test_concrete_out_of_range_raises_naming_the_argument(name):
    (op, args), match = CONCRETE[name]
    fn = getattr(fj, op)
    with pytest.raises(ValueError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=match):  # validation, before any dispatch
        fj.explain(op, *args)


def test_concrete_garbage_past_the_used_entries_and_padding_are_accepted():
    k, v, _ = _pools()
    lengths = jnp.asarray([20, 12, 24, 32], jnp.int32)
    empty = jnp.asarray([0, 0, 0, 0], jnp.int32)
    tables = jnp.asarray(GOOD_TABLES)
    for lens in (lengths, empty):
        fj.paged_attention(_q(), k, v, tables, lens)
        fj.paged_gather(k, tables, lens)
    # Sequences with no token may hold anything in every entry.
    junk = jnp.full((4, MAX_PAGES), -(2**31), jnp.int32)
    np.testing.assert_array_equal(f64(fj.paged_attention(_q(), k, v, junk, empty)), 0.0)
    tokens = jnp.ones((2, KV_HEADS, DIM), jnp.float32)
    fj.paged_write(k, v, tokens, tokens, jnp.asarray([-1, -(2**31)], jnp.int32))  # padding
    fj.copy_pages(k, v, jnp.asarray([[-1, 99], [-5, -5]], jnp.int32))  # padding rows


# --- traced arguments: an out-of-range entry reads nothing -------------------------------------


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
@pytest.mark.parametrize("q_len", [None, 3], ids=["decode", "chunk"])
def test_traced_out_of_range_entries_read_nothing_paged_attention(implementation, q_len):
    k_pages, v_pages, (dense_k, dense_v) = _pools()
    q = _q(q_len=q_len)
    step = jax.jit(lambda q, t, n: fj.paged_attention(q, k_pages, v_pages, t, n,
                                                      implementation=implementation))
    out = step(q, jnp.asarray(TABLES), jnp.asarray(LENGTHS))
    q4 = q[:, None] if q_len is None else q
    ref = _attention_ref(q4, dense_k, dense_v, LENGTHS, _named(TABLES, LENGTHS))
    assert_close(f64(out).reshape(ref.shape), ref, dtype=jnp.float32,
                 implementation=implementation)


def test_traced_out_of_range_entries_read_nothing_paged_gather():
    k_pages, _, (dense_k, _) = _pools()
    out = jax.jit(fj.paged_gather)(k_pages, jnp.asarray(TABLES), jnp.asarray(LENGTHS))
    want = np.where(_named(TABLES, LENGTHS)[:, :, None, None], dense_k, 0.0)
    np.testing.assert_array_equal(f64(out), want)


def _ragged_args(q_lens):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = np.random.default_rng(3).standard_normal((int(cu[-1]), Q_HEADS, DIM))
    return jnp.asarray(q, jnp.float32), jnp.asarray(cu)


@pytest.mark.parametrize("implementation", RAGGED_IMPLS)
def test_traced_out_of_range_entries_read_nothing_ragged(implementation):
    k_pages, v_pages, (dense_k, dense_v) = _pools()
    q_lens = [1, 3, 2, 3]
    q, cu = _ragged_args(q_lens)
    step = jax.jit(lambda q, t, n, cu: fj.ragged_paged_attention(
        q, k_pages, v_pages, t, n, cu, len(q_lens), implementation=implementation))
    out = f64(step(q, jnp.asarray(TABLES), jnp.asarray(LENGTHS), cu))
    named = _named(TABLES, LENGTHS)
    for b, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        ref = _attention_ref(q[None, lo:hi], dense_k[b:b + 1], dense_v[b:b + 1],
                             LENGTHS[b:b + 1], named[b:b + 1])
        assert_close(out[lo:hi], ref[0], dtype=jnp.float32, implementation=implementation,
                     err_msg=f"sequence {b}")


@pytest.mark.parametrize("implementation", PAGED_IMPLS)
def test_traced_lengths_are_clamped_to_the_table(implementation):
    """A traced length past the table acts as the capacity (positions included), a negative
    one as zero: the same result as the clamped value, in every implementation."""
    k_pages, v_pages, _ = _pools()
    tables = jnp.asarray(GOOD_TABLES)
    step = jax.jit(lambda q, n: fj.paged_attention(q, k_pages, v_pages, tables, n,
                                                   implementation=implementation))
    q = _q(q_len=3)
    wild = step(q, jnp.asarray([20, -5, 24, 1000], jnp.int32))
    clamped = step(q, jnp.asarray([20, 0, 24, CAPACITY], jnp.int32))
    np.testing.assert_array_equal(f64(wild), f64(clamped))
    np.testing.assert_array_equal(f64(wild)[1], 0.0)


@pytest.mark.parametrize("implementation", RAGGED_IMPLS)
def test_traced_ragged_kv_lengths_are_clamped_to_the_table(implementation):
    k_pages, v_pages, _ = _pools()
    q, cu = _ragged_args([1, 3, 2, 3])
    tables = jnp.asarray(GOOD_TABLES)
    step = jax.jit(lambda n: fj.ragged_paged_attention(
        q, k_pages, v_pages, tables, n, cu, 4, implementation=implementation))
    np.testing.assert_array_equal(f64(step(jnp.asarray([20, 12, 24, 1000], jnp.int32))),
                                  f64(step(jnp.asarray([20, 12, 24, CAPACITY], jnp.int32))))


def test_traced_write_and_copy_out_of_range_touch_nothing():
    k_pages, v_pages, _ = _pools()
    tokens = jnp.asarray(np.random.default_rng(4).standard_normal((3, KV_HEADS, DIM)),
                         jnp.float32)
    slots = jnp.asarray([NUM_PAGES * PAGE, -1, 2**30], jnp.int32)
    new_k, new_v = jax.jit(fj.paged_write)(k_pages, v_pages, tokens, tokens, slots)
    np.testing.assert_array_equal(f64(new_k), f64(k_pages))
    copies = jnp.asarray([[NUM_PAGES, 1], [2, NUM_PAGES], [3, -1], [-1, 4]], jnp.int32)
    new_k, new_v = jax.jit(fj.copy_pages)(k_pages, v_pages, copies)
    np.testing.assert_array_equal(f64(new_k), f64(k_pages))
    np.testing.assert_array_equal(f64(new_v), f64(v_pages))


# --- traced arguments: debug checks --------------------------------------------------------------


def _checked(fn, *args):
    with fj.debug_checks():
        err, out = jax.jit(checkify.checkify(fn))(*args)
    return err.get(), out


@pytest.mark.parametrize("op", ["paged_attention", "paged_gather", "ragged"])
def test_debug_checks_report_traced_out_of_range_values(op):
    k_pages, v_pages, _ = _pools()
    q = _q()
    cu = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)
    fn = {
        "paged_attention": lambda t, n: fj.paged_attention(q, k_pages, v_pages, t, n),
        "paged_gather": lambda t, n: fj.paged_gather(k_pages, t, n),
        "ragged": lambda t, n: fj.ragged_paged_attention(q, k_pages, v_pages, t, n, cu, 4),
    }[op]
    good = (jnp.asarray(GOOD_TABLES), jnp.asarray([20, 12, 24, 32], jnp.int32))
    assert _checked(fn, *good)[0] is None
    bad_entry = (jnp.asarray(TABLES), jnp.asarray([20, 12, 24, 32], jnp.int32))
    message, _ = _checked(fn, *bad_entry)
    assert message is not None and "block_tables" in message and "names no page" in message
    bad_length = (jnp.asarray(GOOD_TABLES), jnp.asarray([20, 12, 24, 1000], jnp.int32))
    message, _ = _checked(fn, *bad_length)
    assert message is not None and "lengths" in message and "1000" in message
    # Off (the default, unless FORGE_JAX_DEBUG_CHECKS is set), nothing is emitted:
    # checkify finds no check to report.
    with fj.debug_checks(False):
        err, _ = jax.jit(checkify.checkify(fn))(*bad_entry)
    assert err.get() is None
    # On, without checkify, the checks are dropped rather than breaking jit.
    with fj.debug_checks():
        jax.jit(fn)(*bad_entry)


def test_debug_checks_report_traced_slots_and_copies():
    k_pages, v_pages, _ = _pools()
    tokens = jnp.ones((2, KV_HEADS, DIM), jnp.float32)
    write = lambda s: fj.paged_write(k_pages, v_pages, tokens, tokens, s)
    assert _checked(write, jnp.asarray([3, -1], jnp.int32))[0] is None
    message, _ = _checked(write, jnp.asarray([3, 80], jnp.int32))
    assert message is not None and "slots" in message and "80" in message
    copy = lambda c: fj.copy_pages(k_pages, v_pages, c)
    assert _checked(copy, jnp.asarray([[1, 2], [-1, 99]], jnp.int32))[0] is None
    message, _ = _checked(copy, jnp.asarray([[1, 2], [3, 99]], jnp.int32))
    assert message is not None and "copies" in message and "99" in message
