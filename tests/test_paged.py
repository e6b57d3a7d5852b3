"""Paged KV-cache ops: paged_write, paged_gather, paged_attention, copy_pages.

Every pool is filled with garbage (large random values) wherever no sequence token
lives (the tail of each last page, spare pages) and unused block-table entries hold
huge random integers: none of it may reach a result.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import variants
from cases.calls import jit_attention, jit_paged_attention, jit_paged_gather
from cases.checks import assert_close, assert_raises_as_listed
from cases.inputs import garbage, rng
from cases.paged import paged_cache
from cases.references import attention_ref, f64

import forge_jax as fj
from forge_jax import tolerances


def make_paged(gen, lengths, *, page_size, kv_heads, head_dim, dtype, **shapes):
    """Random sequences on randomly permuted pages of a pool of large finite garbage:
    ``(k_pages, v_pages, block_tables, dense_k, dense_v)`` with ``dense_*`` the float64
    ``[batch, max_pages * page_size, kv_heads, head_dim]`` truth (zero past the lengths)."""
    cache = paged_cache(gen, lengths, page_size=page_size, kv_heads=kv_heads,
                        head_dim=head_dim, dtype=dtype, **shapes)
    return cache.finite_k, cache.finite_v, cache.block_tables, cache.dense_k, cache.dense_v



def small_paged(gen, lengths):
    """:func:`make_paged` of a small float32 cache: pages of 4 slots, 2 KV heads of 8."""
    return make_paged(gen, lengths, page_size=4, kv_heads=2, head_dim=8, dtype=jnp.float32)


def _lengths(page_size):
    # Ragged: a single token, a partly filled last page, an exact number of pages, longer.
    return np.array([1, 2 * page_size + 3, 4 * page_size, 37])


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


# --- paged_attention ----------------------------------------------------------------------


# Each page size with decode and multi-token queries; MHA/GQA/MQA spread over them.
@pytest.mark.parametrize("page_size,heads,q_len", [
    (1, "mha", None), (1, "gqa", 3), (8, "mqa", None), (8, "mha", 3), (16, "gqa", None),
    (16, "mqa", 3)])
def test_paged_attention_matches_references(page_size, heads, q_len):
    gen = rng(page_size, q_len or 0)
    q_heads, kv_heads = HEADS[heads]
    head_dim = 16
    lengths = _lengths(page_size)
    k_pages, v_pages, tables, dense_k, dense_v = make_paged(
        gen, lengths, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
        dtype=jnp.float32)
    batch = len(lengths)
    q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    q = jnp.asarray(gen.standard_normal(q_shape), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    out = jit_paged_attention(q, k_pages, v_pages, tables, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    q4 = q[:, None] if q_len is None else q
    ref = attention_ref(q4, dense_k, dense_v, kv_lengths=lengths)
    ref = ref[:, 0] if q_len is None else ref
    assert_close(out, ref, dtype=jnp.float32)
    # Against fj.attention on the gathered dense K/V, same positions.
    t = q4.shape[1]
    positions = lens[:, None] - t + jnp.arange(t)[None, :]
    k = jit_paged_gather(k_pages, tables, lens)
    v = jit_paged_gather(v_pages, tables, lens)
    dense = jit_attention(q4, k, v, q_positions=positions, kv_lengths=lens)
    dense = dense[:, 0] if q_len is None else dense
    np.testing.assert_allclose(f64(out), f64(dense), **tolerances.tolerance(
        jnp.float32).as_kwargs())


@pytest.mark.parametrize("dtype,q_dtype,window,cap", [
    (jnp.bfloat16, jnp.bfloat16, None, None), (jnp.bfloat16, jnp.float32, 5, None),
    (jnp.float16, jnp.float16, None, 4.0), (jnp.float32, jnp.float32, 9, 2.5),
    (jnp.float32, jnp.float32, 1, None), (jnp.bfloat16, jnp.float32, 9, 2.5)])
def test_paged_attention_dtypes_window_cap(dtype, q_dtype, window, cap):
    gen = rng(7)
    page_size, q_heads, kv_heads, head_dim = 8, 6, 2, 32
    lengths = np.array([21, 3, 8, 16])
    k_pages, v_pages, tables, dense_k, dense_v = make_paged(
        gen, lengths, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(gen.standard_normal((4, 4, q_heads, head_dim)) * 2, q_dtype)
    out = jit_paged_attention(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                          sliding_window=window, logits_soft_cap=cap, scale=0.3)
    assert out.dtype == q.dtype
    ref = attention_ref(f64(q), dense_k, dense_v, kv_lengths=lengths, scale=0.3,
                        sliding_window=window, logits_soft_cap=cap)
    assert_close(out, ref, dtype=q_dtype)


def test_paged_attention_explicit_positions_and_decode_forms():
    """Chunked prefill with explicit (and padded) positions; 3-D q equals its 4-D form."""
    gen = rng(3)
    lengths = np.array([12, 30, 5])
    k_pages, v_pages, tables, dense_k, dense_v = small_paged(gen, lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    positions = np.array([[8, 9, 10, 11], [20, 21, 22, 23], [3, 4, -1, -1]], np.int32)
    q = jnp.asarray(gen.standard_normal((3, 4, 4, 8)), jnp.float32)
    out = jit_paged_attention(q, k_pages, v_pages, tables, lens, q_positions=positions)
    ref = attention_ref(q, dense_k, dense_v, kv_lengths=lengths, q_positions=positions)
    assert_close(out, ref, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[2, 2:]), 0.0)  # sees no key
    # Decode: [batch, heads, dim] with [batch] or [batch, 1] positions == the 4-D call.
    qd = q[:, 0]
    full = jit_paged_attention(qd[:, None], k_pages, v_pages, tables, lens)
    for pos in (None, lens - 1, (lens - 1)[:, None]):
        got = jit_paged_attention(qd, k_pages, v_pages, tables, lens, q_positions=pos)
        np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, 0]), atol=1e-6)


def test_paged_attention_empty_sequence_gives_zeros():
    gen = rng(4)
    k_pages, v_pages, tables, _, _ = make_paged(
        gen, [5, 1], page_size=4, kv_heads=1, head_dim=8, dtype=jnp.float32)
    q = jnp.asarray(gen.standard_normal((2, 2, 8)), jnp.float32)
    out = jit_paged_attention(q, k_pages, v_pages, tables, jnp.asarray([5, 0], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert np.abs(np.asarray(out[0])).max() > 0


def test_paged_attention_reads_only_the_named_pages():
    """The XLA implementation's scratch scales with the block tables, not with the pool."""
    kv_heads, num_pages, page_size, head_dim = 2, 4096, 16, 64
    pool = jax.ShapeDtypeStruct((kv_heads, num_pages, page_size, head_dim), jnp.float32)
    q = jax.ShapeDtypeStruct((8, 8, head_dim), jnp.float32)
    tables = jax.ShapeDtypeStruct((8, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((8,), jnp.int32)
    compiled = jax.jit(fj.paged_attention).lower(q, pool, pool, tables, lens).compile()
    pool_bytes = kv_heads * num_pages * page_size * head_dim * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < pool_bytes / 20, (temp, pool_bytes)


def test_paged_attention_grad_and_vmap():
    gen = rng(8)
    lengths = np.array([7, 2, 12])
    k_pages, v_pages, tables, dense_k, dense_v = small_paged(gen, lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(gen.standard_normal((3, 2, 4, 8)), jnp.float32)
    w = jnp.asarray(gen.standard_normal(q.shape), jnp.float32)

    def paged_loss(q, k_pages, v_pages):
        return jnp.sum(fj.paged_attention(q, k_pages, v_pages, tables, lens) * w)

    def dense_loss(q, k, v):
        positions = lens[:, None] - 2 + jnp.arange(2)[None, :]
        return jnp.sum(fj.attention(q, k, v, q_positions=positions, kv_lengths=lens) * w)

    grads = jax.jit(jax.grad(paged_loss, argnums=(0, 1, 2)))(q, k_pages, v_pages)
    k, v = jnp.asarray(dense_k, jnp.float32), jnp.asarray(dense_v, jnp.float32)
    dq, dk, dv = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(q, k, v)
    tol = tolerances.tolerance(jnp.float32).as_kwargs()
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(dq), **tol)
    # The pool's gradient is the dense one scattered back to the slots; garbage gets none.
    for g_pages, g_dense in ((grads[1], dk), (grads[2], dv)):
        back = np.asarray(fj.paged_gather(g_pages, tables, lens))
        np.testing.assert_allclose(back, np.asarray(g_dense), **tol)
        assert np.abs(np.asarray(g_pages)).sum() == pytest.approx(
            np.abs(np.asarray(g_dense)).sum(), rel=1e-5)
    # vmap over a stacked layer axis equals one call per layer.
    k2 = jnp.stack([k_pages, -k_pages])
    v2 = jnp.stack([v_pages, 2 * v_pages])
    q2 = jnp.stack([q, q[::-1]])
    out = jax.jit(jax.vmap(fj.paged_attention, in_axes=(0, 0, 0, None, None)))(
        q2, k2, v2, tables, lens)
    for layer in range(2):
        np.testing.assert_allclose(
            np.asarray(out[layer]),
            np.asarray(jit_paged_attention(q2[layer], k2[layer], v2[layer], tables, lens)), **tol)


@hypothesis.given(
    lengths=st.lists(st.integers(0, 16), min_size=3, max_size=3),
    shift=st.integers(-3, 2),
    masking=st.sampled_from([(None, None), (3, None), (None, 1.5)]),
    seed=st.integers(0, 2**16))
def test_paged_attention_fuzz(lengths, shift, masking, seed):
    """Random ragged lengths (empty included) and query positions; fixed shapes."""
    gen = rng(seed)
    lengths = np.array(lengths)
    k_pages, v_pages, tables, dense_k, dense_v = make_paged(
        gen, lengths, page_size=4, kv_heads=1, head_dim=8, dtype=jnp.float32, max_pages=4,
        num_pages=14)
    q = jnp.asarray(gen.standard_normal((3, 2, 3, 8)), jnp.float32)
    positions = (lengths[:, None] - 2 + shift + np.arange(2)[None, :]).astype(np.int32)
    window, cap = masking
    out = jit_paged_attention(q, k_pages, v_pages, tables, jnp.asarray(lengths, jnp.int32),
                          q_positions=jnp.asarray(positions), sliding_window=window,
                          logits_soft_cap=cap)
    ref = attention_ref(q, dense_k, dense_v, kv_lengths=lengths, q_positions=positions,
                        sliding_window=window, logits_soft_cap=cap)
    out = f64(out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **tolerances.tolerance(jnp.float32).as_kwargs())


# --- paged_gather -------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 8])
def test_paged_gather_exact_and_zero_past_lengths(page_size):
    gen = rng(page_size)
    lengths = _lengths(page_size)
    k_pages, _, tables, dense_k, _ = make_paged(
        gen, lengths, page_size=page_size, kv_heads=3, head_dim=8, dtype=jnp.bfloat16)
    out = jit_paged_gather(k_pages, tables, jnp.asarray(lengths, jnp.int32))
    assert out.shape == dense_k.shape and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(f64(out), dense_k)  # zeros past each length included


# --- paged_write --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 8])
def test_paged_write_exact_placement_and_padding(page_size):
    gen = rng(11)
    kv_heads, num_pages, head_dim, tokens = 2, 12, 4, 9
    shape = (kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = garbage(gen, shape, jnp.bfloat16), garbage(gen, shape, jnp.bfloat16)
    capacity = num_pages * page_size
    slots = gen.permutation(capacity)[:tokens].astype(np.int32)
    slots[[1, 4]] = -1  # padding
    slots[6] = -capacity  # would wrap around to slot 0 if negatives were not masked
    if capacity > tokens:
        slots[7] = capacity + 3  # out of range: skipped too
    k = jnp.asarray(gen.standard_normal((tokens, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(gen.standard_normal((tokens, kv_heads, head_dim)), jnp.float32)
    new_k, new_v = jax.jit(fj.paged_write)(k_pages, v_pages, k, v, jnp.asarray(slots))
    assert new_k.dtype == jnp.bfloat16 and new_k.shape == shape
    for pages, new, x in ((k_pages, new_k, k), (v_pages, new_v, v)):
        want = np.asarray(pages).astype(np.float32).reshape(kv_heads, capacity, head_dim)
        for t, s in enumerate(slots):
            if 0 <= s < capacity:
                want[:, s] = np.asarray(x[t].astype(jnp.bfloat16)).astype(np.float32)
        np.testing.assert_array_equal(
            np.asarray(new).astype(np.float32).reshape(kv_heads, capacity, head_dim), want)


def test_paged_write_donated_updates_in_place():
    gen = rng(12)
    kv_heads, num_pages, page_size, head_dim = 2, 2048, 16, 32
    shape = (kv_heads, num_pages, page_size, head_dim)
    k_pages, v_pages = garbage(gen, shape), garbage(gen, shape)
    k = jnp.asarray(gen.standard_normal((4, kv_heads, head_dim)), jnp.float32)
    slots = jnp.asarray([5, -1, 700, 32767], jnp.int32)
    step = jax.jit(fj.paged_write, donate_argnums=(0, 1))
    compiled = step.lower(k_pages, v_pages, k, k, slots).compile()
    pool_bytes = 4 * math.prod(shape)
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < pool_bytes / 100
    assert stats.alias_size_in_bytes >= 2 * pool_bytes  # outputs live in the donated inputs
    pool_type = f"f32[{','.join(map(str, shape))}]"
    assert not [line for line in compiled.as_text().splitlines()
                if " copy(" in line and pool_type in line]
    expect = np.asarray(k_pages).reshape(kv_heads, -1, head_dim)[:, 5].copy()
    new_k, _ = step(k_pages, v_pages, k, k, slots)
    assert k_pages.is_deleted() and v_pages.is_deleted()
    flat = np.asarray(new_k).reshape(kv_heads, -1, head_dim)
    np.testing.assert_array_equal(flat[:, 5], np.asarray(k[0]))
    np.testing.assert_array_equal(flat[:, 32767], np.asarray(k[3]))
    assert not np.array_equal(flat[:, 5], expect)


# --- copy_pages ---------------------------------------------------------------------------


def test_copy_pages_copies_and_skips_padding_rows():
    gen = rng(13)
    shape = (2, 8, 4, 8)
    k_pages, v_pages = garbage(gen, shape), garbage(gen, shape)
    copies = np.array([[1, 5], [-1, 0], [3, 2], [-1, -1], [1, 7]], np.int32)
    new_k, new_v = jax.jit(fj.copy_pages, donate_argnums=(0, 1))(
        jnp.array(k_pages), jnp.array(v_pages), jnp.asarray(copies))
    for old, new in ((k_pages, new_k), (v_pages, new_v)):
        want = np.asarray(old).copy()
        for src, dst in copies:
            if src >= 0:
                want[:, dst] = np.asarray(old)[:, src]
        np.testing.assert_array_equal(np.asarray(new), want)
    # Sources are read before destinations are written: a swap works.
    swapped, _ = jax.jit(fj.copy_pages)(k_pages, v_pages, jnp.asarray([[0, 1], [1, 0]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(swapped[:, 0]), np.asarray(k_pages[:, 1]))
    np.testing.assert_array_equal(np.asarray(swapped[:, 1]), np.asarray(k_pages[:, 0]))


# --- chex variants ------------------------------------------------------------------------


@variants.device_variants
def test_attention_and_write_agree_across_variants(variant):
    gen = rng(21)
    lengths = np.array([9, 2, 16])
    k_pages, v_pages, tables, dense_k, dense_v = small_paged(gen, lengths)
    q = jnp.asarray(gen.standard_normal((3, 2, 4, 8)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    attend = variant(lambda q, k, v, t, n: fj.paged_attention(
        q, k, v, t, n, sliding_window=6, logits_soft_cap=5.0))
    out = attend(q, k_pages, v_pages, tables, lens)
    ref = attention_ref(q, dense_k, dense_v, kv_lengths=lengths, sliding_window=6,
                        logits_soft_cap=5.0)
    assert_close(out, ref, dtype=jnp.float32)
    new = jnp.asarray(gen.standard_normal((3, 2, 8)), jnp.float32)
    slots = jnp.asarray([int(tables[0, 2]) * 4 + 1, -1, int(tables[2, 3]) * 4 + 3], jnp.int32)
    write = variant(fj.paged_write)
    nk, nv = write(k_pages, v_pages, new, -new, slots)
    np.testing.assert_array_equal(np.asarray(nk[:, tables[0, 2], 1]), np.asarray(new[0]))
    np.testing.assert_array_equal(np.asarray(nv[:, tables[2, 3], 3]), -np.asarray(new[2]))
    np.testing.assert_array_equal(np.asarray(nk[:, tables[1, 0]]),
                                  np.asarray(k_pages[:, tables[1, 0]]))
    gather = variant(fj.paged_gather)
    np.testing.assert_array_equal(f64(gather(k_pages, tables, lens)), dense_k)


# --- dispatch and validation --------------------------------------------------------------


def test_registered_with_dispatch():
    gen = rng(0)
    k_pages, v_pages, tables, _, _ = make_paged(
        gen, [3], page_size=2, kv_heads=1, head_dim=4, dtype=jnp.float32)
    q = jnp.ones((1, 2, 4), jnp.float32)
    lens = jnp.asarray([3], jnp.int32)
    assert fj.explain("paged_attention", q, k_pages, v_pages, tables, lens).implementation == "xla"
    for op in ("paged_write", "paged_gather", "paged_attention", "copy_pages"):
        assert "xla" in fj.dispatch.implementations(op)
    fj.paged_attention(q, k_pages, v_pages, tables, lens, implementation="xla")
    assert fj.dispatch.last_selection("paged_attention").implementation == "xla"
    with pytest.raises(fj.ImplementationError, match="no implementation 'nope'"):
        fj.paged_attention(q, k_pages, v_pages, tables, lens, implementation="nope")


def _bad_calls():
    f32, i32 = jnp.float32, jnp.int32
    pages = jnp.ones((2, 5, 4, 8), f32)
    q = jnp.ones((3, 4, 8), f32)
    t = jnp.zeros((3, 2), i32)
    n = jnp.ones((3,), i32)
    tok = jnp.ones((6, 2, 8), f32)
    s = jnp.zeros((6,), i32)
    return [
        (lambda: fj.paged_attention(q[0], pages, pages, t, n), ValueError, "q must have rank"),
        (lambda: fj.paged_attention(q, pages[0], pages[0], t, n), ValueError, "k_pages"),
        (lambda: fj.paged_attention(q, pages, pages[:, :4], t, n), ValueError,
         "same shape"),
        (lambda: fj.paged_attention(q, pages, pages.astype(jnp.bfloat16), t, n), TypeError,
         "same dtype"),
        (lambda: fj.paged_attention(q[..., :4], pages, pages, t, n), ValueError, "head_dim"),
        (lambda: fj.paged_attention(jnp.ones((3, 3, 8), f32), pages, pages, t, n), ValueError,
         "multiple of kv_heads"),
        (lambda: fj.paged_attention(q, pages, pages, t[:2], n), ValueError, "lengths"),
        (lambda: fj.paged_attention(q, pages, pages, t[:2], n[:2]), ValueError, "batch"),
        (lambda: fj.paged_attention(q, pages, pages, t.astype(f32), n), TypeError,
         "block_tables must be an integer"),
        (lambda: fj.paged_attention(q, pages, pages, t, n, q_positions=jnp.zeros((3, 2), i32)),
         ValueError, "q_positions"),
        (lambda: fj.paged_attention(q, pages, pages, t, n, sliding_window=0), ValueError,
         "sliding_window"),
        (lambda: fj.paged_attention(q, pages, pages, t, n, logits_soft_cap=-1.0), ValueError,
         "logits_soft_cap"),
        (lambda: fj.paged_write(pages, pages, tok, tok, s[:5]), ValueError, "slots"),
        (lambda: fj.paged_write(pages, pages, tok[:, :1], tok[:, :1], s), ValueError,
         "kv_heads"),
        (lambda: fj.paged_write(pages, pages, tok, tok[:5], s), ValueError, "same shape"),
        (lambda: fj.paged_write(pages, pages, tok, tok, s.astype(f32)), TypeError, "slots"),
        (lambda: fj.paged_gather(pages, t, n[:2]), ValueError, "lengths"),
        (lambda: fj.paged_gather(pages[0], t, n), ValueError, "pages must have rank 4"),
        (lambda: fj.copy_pages(pages, pages, jnp.zeros((2, 3), i32)), ValueError, r"\[n, 2\]"),
        (lambda: fj.copy_pages(pages, pages, jnp.zeros((2,), i32)), ValueError, "copies"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_arguments_raise_with_names(case):
    assert_raises_as_listed(_bad_calls()[case])
