"""KV caches: ContiguousKVCache, PagedKVCache and the host-side BlockManager."""

from __future__ import annotations

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import variants
from cases.inputs import garbage
from cases.references import attention_ref, f64
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import forge_jax as fj
from forge_jax import tolerances
from forge_jax.kv_cache import (
    BlockManager,
    CacheFullError,
    CacheUsage,
    ContiguousKVCache,
    PagedKVCache,
)

# --- device caches: construction and pytree -----------------------------------------------


def _paged(num_layers=2, num_pages=12, page_size=4, kv_heads=2, head_dim=8, dtype=jnp.float32,
           tables=((0, 1, 2), (3, 4, 5))):
    return PagedKVCache.create(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                               kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                               block_tables=np.asarray(tables, np.int32))


def _contiguous(num_layers=2, batch=2, max_len=12, kv_heads=2, head_dim=8, dtype=jnp.float32):
    return ContiguousKVCache.create(num_layers=num_layers, batch=batch, max_len=max_len,
                                    kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def test_create_shapes_and_pytree():
    c = _contiguous(num_layers=3, dtype=jnp.bfloat16)
    assert len(c.k) == len(c.v) == 3 and isinstance(c.k, tuple)
    assert c.k[0].shape == (2, 12, 2, 8) and c.dtype == jnp.bfloat16
    assert c.lengths.dtype == jnp.int32 and c.lengths.shape == (2,)
    assert (c.num_layers, c.batch, c.max_len, c.kv_heads, c.head_dim) == (3, 2, 12, 2, 8)
    p = _paged(num_layers=3)
    assert p.k_pages[2].shape == (2, 12, 4, 8) and p.block_tables.dtype == jnp.int32
    assert (p.page_size, p.num_pages, p.max_pages, p.batch) == (4, 12, 3, 2)
    for cache, n_leaves in ((c, 7), (p, 8)):
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        assert len(leaves) == n_leaves  # per-layer arrays, lengths (and block tables)
        chex.assert_trees_all_equal(jax.tree_util.tree_unflatten(treedef, leaves), cache)
        out = jax.jit(lambda x: x)(cache)
        assert type(out) is type(cache)
        chex.assert_trees_all_equal(out, cache)
    # page_size is static: it lives in the tree structure, not in the leaves.
    assert jax.tree_util.tree_structure(p) != jax.tree_util.tree_structure(_paged(page_size=2))
    assert jax.jit(lambda x: x.page_size * 2)(p) == 8  # a Python int under jit


def test_with_lengths_and_block_tables():
    c = _contiguous().with_lengths(np.array([3, 5]))
    np.testing.assert_array_equal(np.asarray(c.lengths), [3, 5])
    assert c.lengths.dtype == jnp.int32
    p = _paged().with_lengths(jnp.array([1, 2], jnp.int32))
    p2 = p.with_block_tables(np.array([[7, 8], [9, 10]]))
    assert p2.block_tables.shape == (2, 2) and p2.k_pages is p.k_pages
    np.testing.assert_array_equal(np.asarray(p2.lengths), [1, 2])
    with pytest.raises(ValueError, match="lengths must be"):
        c.with_lengths(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="lengths must be an integer"):
        p.with_lengths(np.array([1.0, 2.0]))


def test_cache_validation():
    c, p = _contiguous(), _paged()
    k = jnp.ones((2, 3, 2, 8), jnp.float32)
    pos = jnp.zeros((2, 3), jnp.int32)
    valid = jnp.ones((2, 3), bool)
    for cache in (c, p):
        with pytest.raises(ValueError, match="layer must be in"):
            cache.write(2, k, k, pos, valid)
        with pytest.raises(TypeError, match="layer must be a Python int"):
            cache.write(True, k, k, pos, valid)
        with pytest.raises(ValueError, match="k must be"):
            cache.write(0, k[:, :, :1], k[:, :, :1], pos, valid)
        with pytest.raises(ValueError, match="same shape"):
            cache.write(0, k, k[:, :2], pos, valid)
        with pytest.raises(ValueError, match="positions must be"):
            cache.write(0, k, k, pos[:, :2], valid)
        with pytest.raises(TypeError, match="valid must be a boolean"):
            cache.write(0, k, k, pos, pos)
        with pytest.raises(TypeError, match="positions must be an integer"):
            cache.write(0, k, k, pos.astype(jnp.float32), valid)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        _contiguous(num_layers=0)
    with pytest.raises(TypeError, match="dtype must be"):
        _contiguous(dtype=jnp.int32)
    with pytest.raises(ValueError, match="block_tables must have rank 2"):
        _paged(tables=(1, 2))
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        _paged(page_size=0)


# --- device caches: writes ----------------------------------------------------------------


def test_contiguous_write_exact_placement_and_padding():
    rng = np.random.default_rng(0)
    cache = _contiguous(max_len=6, dtype=jnp.bfloat16)
    poison = garbage(rng, cache.k[1].shape, jnp.bfloat16)
    cache = ContiguousKVCache(k=(cache.k[0], poison), v=(cache.v[0], -poison),
                              lengths=cache.lengths)
    k = jnp.asarray(rng.standard_normal((2, 4, 2, 8)), jnp.float32)
    positions = jnp.asarray([[0, 1, 5, 6], [3, -1, 2, 4]], jnp.int32)
    valid = jnp.asarray([[True, False, True, True], [True, True, True, False]])
    out = jax.jit(lambda c: c.write(1, k, 2 * k, positions, valid))(cache)
    assert out.k[1].dtype == jnp.bfloat16
    want_k = np.asarray(poison).astype(np.float32)
    want_v = -want_k
    kb = np.asarray(k.astype(jnp.bfloat16)).astype(np.float32)
    vb = np.asarray((2 * k).astype(jnp.bfloat16)).astype(np.float32)
    for b, t in [(0, 0), (0, 2), (1, 0), (1, 2)]:  # padding, negative, >= max_len skipped
        want_k[b, positions[b, t]] = kb[b, t]
        want_v[b, positions[b, t]] = vb[b, t]
    np.testing.assert_array_equal(np.asarray(out.k[1]).astype(np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(out.v[1]).astype(np.float32), want_v)
    chex.assert_trees_all_equal(out.k[0], cache.k[0])


def test_paged_write_uses_block_tables():
    rng = np.random.default_rng(1)
    cache = _paged(num_layers=1, page_size=2, tables=((5, 2, 9), (7, 0, 1)))
    k = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.float32)
    positions = jnp.asarray([[0, 3, 6], [4, 5, -2]], jnp.int32)  # 6: beyond the table
    valid = jnp.asarray([[True, True, True], [True, False, True]])
    slots = np.asarray(cache.slots(positions, valid))
    np.testing.assert_array_equal(slots, [[10, 5, -1], [2, -1, -1]])
    out = cache.write(0, k, -k, positions, valid)
    np.testing.assert_array_equal(np.asarray(out.k_pages[0][:, 5, 0]), np.asarray(k[0, 0]))
    np.testing.assert_array_equal(np.asarray(out.k_pages[0][:, 2, 1]), np.asarray(k[0, 1]))
    np.testing.assert_array_equal(np.asarray(out.v_pages[0][:, 1, 0]), -np.asarray(k[1, 0]))
    assert int(jnp.count_nonzero(out.k_pages[0])) == 3 * 2 * 8


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_write_donated_is_in_place(kind):
    if kind == "contiguous":
        cache = _contiguous(num_layers=2, batch=4, max_len=2048, kv_heads=2, head_dim=32)
        big = "f32[4,2048,2,32]"
    else:
        cache = _paged(num_layers=2, num_pages=2048, page_size=4, kv_heads=2, head_dim=32,
                       tables=np.arange(8).reshape(4, 2))
        big = "f32[2,2048,4,32]"
    size = 2048 * 4 * 2 * 32 * 4  # bytes of one layer's K
    k = jnp.ones((4, 1, 2, 32), jnp.float32)
    pos = jnp.asarray([[0], [3], [5], [7]], jnp.int32)
    valid = jnp.ones((4, 1), bool)
    step = jax.jit(lambda cache, k: cache.write(1, k, k, pos, valid), donate_argnames="cache")
    compiled = step.lower(cache, k).compile()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < size / 100
    assert stats.alias_size_in_bytes >= 4 * size  # every layer's K and V stays in place
    assert not [line for line in compiled.as_text().splitlines()
                if " copy(" in line and big in line]
    old = jax.tree_util.tree_leaves(cache)
    new = step(cache, k)
    assert all(x.is_deleted() for x in old if x.size > 64)
    assert float(jnp.sum(jax.tree_util.tree_leaves(new)[1])) == 4 * 2 * 32


# --- device caches: contiguous and paged agree, against a float64 reference ---------------


def _step(cache, q, k, v, positions, valid, kv_lengths):
    """What a model does per step: write each layer's new K/V, then attend over it."""
    outs = []
    for layer in range(cache.num_layers):
        cache = cache.write(layer, k[layer], v[layer], positions, valid)
        outs.append(cache.attend(layer, q[layer], q_positions=positions, kv_lengths=kv_lengths))
    return cache, jnp.stack(outs)


step = jax.jit(_step, donate_argnames="cache")
gather_attend = jax.jit(lambda q, kp, vp, tables, positions, lengths: fj.attention(
    q, fj.paged_gather(kp, tables, lengths).astype(jnp.float32),
    fj.paged_gather(vp, tables, lengths).astype(jnp.float32), q_positions=positions,
    kv_lengths=lengths))


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_caches_agree_with_each_other_and_reference(cache_dtype):
    rng = np.random.default_rng(2)
    layers, batch, kv_heads, q_heads, head_dim, page_size, max_len = 2, 3, 2, 4, 16, 4, 24
    prompt = np.array([5, 9, 2])
    manager = BlockManager(num_pages=3 * max_len // page_size + 2, page_size=page_size)
    manager.allocate("spacer", 7)  # so that sequences do not start at page 0
    for b, n in enumerate(prompt):
        manager.allocate(b, int(n))
    max_pages = max_len // page_size
    paged = PagedKVCache.create(num_layers=layers, num_pages=manager.num_pages,
                                page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
                                dtype=cache_dtype,
                                block_tables=manager.block_tables(range(batch), max_pages))
    contiguous = ContiguousKVCache.create(num_layers=layers, batch=batch, max_len=max_len,
                                          kv_heads=kv_heads, head_dim=head_dim,
                                          dtype=cache_dtype)
    # Poison both caches: nothing unwritten may matter.
    poison = lambda x: garbage(rng, x.shape, x.dtype)
    paged = jax.tree_util.tree_map(lambda x: poison(x) if x.ndim == 4 else x, paged)
    contiguous = jax.tree_util.tree_map(lambda x: poison(x) if x.ndim == 4 else x, contiguous)
    dense = np.zeros((2, layers, batch, max_len, kv_heads, head_dim))  # the truth, f64
    lengths = np.zeros(batch, np.int64)

    def run(t, positions, valid, new_lengths):
        nonlocal paged, contiguous
        k, v = (rng.standard_normal((layers, batch, t, kv_heads, head_dim)) for _ in "kv")
        q = rng.standard_normal((layers, batch, t, q_heads, head_dim))
        for b in range(batch):
            for i in range(t):
                if valid[b, i]:
                    dense[0, :, b, positions[b, i]] = f64(jnp.asarray(k[:, b, i], cache_dtype))
                    dense[1, :, b, positions[b, i]] = f64(jnp.asarray(v[:, b, i], cache_dtype))
        args = (jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                jnp.asarray(v, jnp.float32), jnp.asarray(positions, jnp.int32),
                jnp.asarray(valid), jnp.asarray(new_lengths, jnp.int32))
        contiguous, out_c = step(contiguous, *args)
        paged, out_p = step(paged, *args)
        assert out_c.dtype == out_p.dtype == jnp.float32
        tol = tolerances.tolerance(jnp.float32)
        np.testing.assert_allclose(f64(out_p), f64(out_c), **tol.as_kwargs())
        for layer in range(layers):
            ref = attention_ref(q[layer], dense[0, layer], dense[1, layer],
                                q_positions=positions, kv_lengths=new_lengths)
            np.testing.assert_allclose(f64(out_c[layer]), ref, **tol.as_kwargs())
            # And fj.attention on the dense K/V the paged cache holds.
            got = gather_attend(args[0][layer], paged.k_pages[layer], paged.v_pages[layer],
                                paged.block_tables, args[3], args[-1])
            np.testing.assert_allclose(f64(got), f64(out_p[layer]), **tol.as_kwargs())

    # Prefill: ragged prompts padded to the longest.
    t = int(prompt.max())
    positions = np.broadcast_to(np.arange(t), (batch, t)).copy()
    valid = positions < prompt[:, None]
    run(t, positions, valid, prompt)
    lengths[:] = prompt
    # Decode: one token per sequence per step; block tables grow through the manager.
    for _ in range(4):
        for b in range(batch):
            manager.append(b)
        assert manager.take_pending_copies().shape == (0, 2)
        paged = paged.with_block_tables(manager.block_tables(range(batch), max_pages))
        run(1, lengths[:, None].copy(), np.ones((batch, 1), bool), lengths + 1)
        lengths += 1


@jax.jit
def _cow_step(cache, copies, tables, k, v, q, positions, lengths):
    cache = cache.copy_pages(copies).with_block_tables(tables)
    cache = cache.write(0, k, v, positions, jnp.ones(positions.shape, bool))
    return cache, cache.attend(0, q, q_positions=positions, kv_lengths=lengths)


def test_forked_sequences_copy_on_write_end_to_end():
    """Parallel sampling: one prompt, three continuations sharing its pages."""
    rng = np.random.default_rng(5)
    page_size, max_pages, kv_heads, q_heads, head_dim = 4, 4, 2, 4, 8
    manager = BlockManager(num_pages=16, page_size=page_size)
    ids = ["a", "b", "c"]
    manager.allocate("pad", 3)  # pages are not handed out from 0
    prompt = rng.standard_normal((2, 6, kv_heads, head_dim))
    manager.allocate("a", 6)
    cache = PagedKVCache.create(num_layers=1, num_pages=16, page_size=page_size,
                                kv_heads=kv_heads, head_dim=head_dim, dtype=jnp.float32,
                                block_tables=manager.block_tables(["a"], max_pages))
    cache = jax.tree_util.tree_map(
        lambda x: garbage(rng, x.shape, x.dtype) if x.ndim == 4 else x, cache)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    cache = cache.write(0, jnp.asarray(prompt[0][None], jnp.float32),
                        jnp.asarray(prompt[1][None], jnp.float32), positions,
                        jnp.ones((1, 6), bool))
    manager.fork("a", "b")
    manager.fork("a", "c")
    assert manager.usage().used_pages == 3
    dense = np.zeros((2, 3, 12, kv_heads, head_dim))
    dense[:, :, :6] = prompt[:, None]
    lengths = np.full(3, 6)
    for step_ in range(3):
        for s in ids:
            manager.append(s)
        copies = manager.take_pending_copies()
        assert len(copies) == (2 if step_ == 0 else 0)  # a and b copy the shared page, c keeps it
        padded = np.full((3, 2), -1, np.int32)  # fixed shape: one compilation
        padded[:len(copies)] = copies
        new = rng.standard_normal((2, 3, 1, kv_heads, head_dim))
        dense[:, np.arange(3), lengths] = new[:, :, 0]
        pos = np.asarray(lengths[:, None], np.int32)
        lengths = lengths + 1
        q = rng.standard_normal((3, 1, q_heads, head_dim))
        cache, out = _cow_step(cache, padded, manager.block_tables(ids, max_pages),
                               *(jnp.asarray(x, jnp.float32) for x in (new[0], new[1], q)),
                               pos, lengths.astype(np.int32))
        ref = attention_ref(q, dense[0], dense[1], q_positions=np.asarray(pos), kv_lengths=lengths)
        np.testing.assert_allclose(f64(out), ref, **tolerances.tolerance(
            jnp.float32).as_kwargs())
    for s in [*ids, "pad"]:
        manager.free(s)
    assert manager.usage() == CacheUsage(0, 16, 16, 0, 0)


def test_decode_loop_example():
    """The README's decode loop: allocate, write, attend, append, free."""
    num_layers, kv_heads, q_heads, head_dim, page_size, max_pages = 2, 2, 4, 16, 8, 4
    manager = BlockManager(num_pages=32, page_size=page_size)
    cache = PagedKVCache.create(num_layers=num_layers, num_pages=32, page_size=page_size,
                                kv_heads=kv_heads, head_dim=head_dim, dtype=jnp.bfloat16,
                                block_tables=np.zeros((2, max_pages), np.int32))

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def layer_step(cache, q, k, v, positions, valid, lengths):  # what one layer of a model does
        cache = cache.write(0, k, v, positions, valid)
        return cache, cache.attend(0, q, q_positions=positions, kv_lengths=lengths)

    rng = np.random.default_rng(6)
    prompts = [5, 11]
    for seq, n in enumerate(prompts):
        manager.allocate(seq, n)  # returns the prompt's slots, if you write them directly
    cache = cache.with_block_tables(manager.block_tables([0, 1], max_pages))
    t = max(prompts)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    valid = positions < jnp.asarray(prompts)[:, None]
    lengths = jnp.asarray(prompts, jnp.int32)
    x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    cache, out = layer_step(cache, x(2, t, q_heads, head_dim), x(2, t, kv_heads, head_dim),
                            x(2, t, kv_heads, head_dim), positions, valid, lengths)
    for _ in range(10):  # decode: one token per sequence per step
        for seq in (0, 1):
            manager.append(seq)
        cache = cache.copy_pages(manager.take_pending_copies())
        cache = cache.with_block_tables(manager.block_tables([0, 1], max_pages))
        cache, out = layer_step(cache, x(2, 1, q_heads, head_dim), x(2, 1, kv_heads, head_dim),
                                x(2, 1, kv_heads, head_dim), lengths[:, None],
                                jnp.ones((2, 1), bool), lengths + 1)
        lengths = lengths + 1
        assert out.shape == (2, 1, q_heads, head_dim) and np.isfinite(f64(out)).all()
    assert [manager.seq_len(s) for s in (0, 1)] == [15, 21]
    manager.free(0)
    manager.free(1)
    assert manager.usage().used_pages == 0


@variants.device_variants
def test_write_attend_variants(variant):
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    positions = jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, True, False]])
    kv_lengths = jnp.asarray([3, 2], jnp.int32)

    @variant
    def f(cache, q, k, positions, valid, kv_lengths):
        cache = cache.write(0, k, -k, positions, valid)
        return cache.attend(0, q, q_positions=positions, kv_lengths=kv_lengths)

    dense = np.asarray(k, np.float64)
    ref = attention_ref(q, dense, -dense, q_positions=np.asarray(positions),
                        kv_lengths=np.asarray(kv_lengths))
    tol = tolerances.tolerance(jnp.float32).as_kwargs()
    for cache in (_contiguous(), _paged(tables=((3, 1, 0), (2, 5, 4)))):
        out = f(cache, q, k, positions, valid, kv_lengths)
        np.testing.assert_allclose(f64(out), ref, **tol)


# --- BlockManager: unit tests -------------------------------------------------------------


def test_allocate_append_slots_and_tables():
    m = BlockManager(num_pages=8, page_size=4)
    s = m.allocate("a", 6)
    assert s.dtype == np.int32
    np.testing.assert_array_equal(s, [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(m.allocate("b", 3), [8, 9, 10])
    np.testing.assert_array_equal(m.append("a", 3), [6, 7, 12])  # page 1 full, then page 3
    np.testing.assert_array_equal(m.block_table("a"), [0, 1, 3])
    assert m.seq_len("a") == 9 and m.seq_len("b") == 3
    np.testing.assert_array_equal(m.slots("a", 5, 7), [5, 6])
    tables = m.block_tables(["b", "a"], 4, pad=-1)
    np.testing.assert_array_equal(tables, [[2, -1, -1, -1], [0, 1, 3, -1]])
    assert tables.dtype == np.int32
    assert m.block_tables(["a"]).shape == (1, 3)
    assert m.append("b", 0).shape == (0,)
    assert m.usage() == CacheUsage(used_pages=4, free_pages=4, total_pages=8, num_sequences=2,
                                   num_tokens=12)
    assert m.can_allocate(16) and not m.can_allocate(17)
    m.free("a")
    assert m.usage().free_pages == 7 and "a" not in m and m.seq_ids == ("b",)
    m.allocate("empty", 0)
    assert m.block_table("empty").shape == (0,)
    np.testing.assert_array_equal(m.append("empty", 1), [0])


def test_fork_shares_pages_and_copies_on_write():
    m = BlockManager(num_pages=8, page_size=4)
    m.allocate("a", 6)  # pages [0, 1], page 1 half full
    m.fork("a", "b")
    assert m.usage().used_pages == 2 and m.usage().num_tokens == 12
    np.testing.assert_array_equal(m.block_table("b"), [0, 1])
    slots = m.append("b")  # shared, partly filled page 1: b gets page 2, copy 1 -> 2
    np.testing.assert_array_equal(slots, [2 * 4 + 2])
    np.testing.assert_array_equal(m.block_table("b"), [0, 2])
    np.testing.assert_array_equal(m.pending_copies(), [[1, 2]])
    np.testing.assert_array_equal(m.pending_copies(), [[1, 2]])  # not cleared
    assert m.pending_copies().dtype == np.int32
    # a is now page 1's only owner: it writes in place, no copy.
    np.testing.assert_array_equal(m.append("a"), [1 * 4 + 2])
    np.testing.assert_array_equal(m.take_pending_copies(), [[1, 2]])
    assert m.take_pending_copies().shape == (0, 2)
    # Full shared pages are never copied.
    m.append("a", 1)  # exactly two full pages
    m.fork("a", "c")
    assert m.append("c").tolist() == [3 * 4]
    assert m.pending_copies().shape == (0, 2)
    m.free("a")
    m.free("b")
    m.free("c")
    assert m.usage() == CacheUsage(0, 8, 8, 0, 0)


def test_pending_copy_source_is_kept_until_taken():
    m = BlockManager(num_pages=3, page_size=4)
    m.allocate("a", 2)  # page 0
    m.fork("a", "b")
    m.append("b")  # b -> page 1, copy (0, 1) pending
    m.free("a")  # page 0 has no owner, but the copy still has to read it
    assert m.usage().used_pages == 2
    m.allocate("c", 4)  # gets page 2, not page 0
    np.testing.assert_array_equal(m.block_table("c"), [2])
    with pytest.raises(CacheFullError):
        m.allocate("d", 1)
    np.testing.assert_array_equal(m.take_pending_copies(), [[0, 1]])
    assert m.usage().used_pages == 2
    np.testing.assert_array_equal(m.allocate("d", 1), [0])


def test_pending_copy_dropped_when_destination_freed_and_chains_collapse():
    m = BlockManager(num_pages=6, page_size=4)
    m.allocate("a", 1)  # page 0
    m.fork("a", "b")
    m.append("b")  # copy (0, 1)
    m.free("b")  # page 1 goes back: its copy must not land on the next owner
    assert m.pending_copies().shape == (0, 2) and m.usage().used_pages == 1
    m.fork("a", "b")
    m.append("b")  # copy (0, 1) again
    m.fork("b", "c")  # c shares page 1, which holds nothing yet
    m.append("c")  # c's copy reads page 0 (the data page 1 will get), not page 1
    np.testing.assert_array_equal(m.pending_copies(), [[0, 1], [0, 2]])
    m.take_pending_copies()
    assert m.usage().used_pages == 3


def test_block_manager_errors_change_nothing():
    m = BlockManager(num_pages=4, page_size=2)
    m.allocate(1, 3)
    m.fork(1, 2)
    before = (m.usage(), m.block_tables([1, 2]).tolist(), m.seq_len(2))
    with pytest.raises(CacheFullError, match=r"needs 3 free pages, 2 free") as e:
        m.allocate(3, 6)
    assert (e.value.requested_pages, e.value.free_pages) == (3, 2)
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(CacheFullError, match="copy-on-write") as e:
        m.append(2, 4)  # copy of page 1 + 2 new pages: 3 > 2
    assert e.value.requested_pages == 3
    with pytest.raises(KeyError, match="unknown sequence 9"):
        m.append(9)
    with pytest.raises(KeyError, match="unknown sequence"):
        m.fork(9, 10)
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate(1, 1)
    with pytest.raises(ValueError, match="already allocated"):
        m.fork(1, 2)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        m.append(1, -1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        m.allocate(5, -2)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        m.append(1, 1.5)
    with pytest.raises(ValueError, match="max_pages"):
        m.block_tables([1], 1)
    with pytest.raises(ValueError, match="positive int"):
        BlockManager(0, 4)
    assert (m.usage(), m.block_tables([1, 2]).tolist(), m.seq_len(2)) == before
    m.free(2)
    with pytest.raises(KeyError, match="already freed"):
        m.free(2)
    m.free(1)
    assert m.usage() == CacheUsage(0, 4, 4, 0, 0)


# --- BlockManager: stateful test against a model of token lists ---------------------------

NUM_PAGES, MAX_SEQS, KV_HEADS, HEAD_DIM = 10, 5, 2, 4
MAX_WRITE, MAX_COPIES, NUM_TOKEN_IDS = 16, 4, 1024
_TOKENS = np.random.default_rng(99).standard_normal((2, NUM_TOKEN_IDS, KV_HEADS, HEAD_DIM))
TOKEN_K, TOKEN_V = _TOKENS.astype(np.float32)

_write = jax.jit(fj.paged_write, donate_argnums=(0, 1))
_copy = jax.jit(fj.copy_pages, donate_argnums=(0, 1))
_gather = jax.jit(lambda k, v, t, n: (fj.paged_gather(k, t, n), fj.paged_gather(v, t, n)))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/free against a list of token ids per sequence.

    Each token id stands for fixed random K/V vectors; after every operation the
    pending copies are applied and the new tokens written, exactly as a server would,
    and the invariants read the pages back.
    """

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def init(self, page_size):
        self.page_size = page_size
        self.manager = BlockManager(NUM_PAGES, page_size)
        shape = (KV_HEADS, NUM_PAGES, page_size, HEAD_DIM)
        rng = np.random.default_rng(page_size)
        self.k_pages = garbage(rng, shape, jnp.float32)
        self.v_pages = garbage(rng, shape, jnp.float32)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.next_token = 0

    # -- helpers --------------------------------------------------------------------------

    def _pick(self, index):
        ids = sorted(self.tokens)
        return ids[index % len(ids)]

    def _snapshot(self):
        m = self.manager
        return (m.usage(), {s: (m.block_table(s).tolist(), m.seq_len(s)) for s in self.tokens},
                m.pending_copies().tolist())

    def _new_tokens(self, n):
        ids = [(self.next_token + i) % NUM_TOKEN_IDS for i in range(n)]
        self.next_token += n
        return ids

    def _sync(self, slots, token_ids):
        """Copies first (copy-on-write), then the new tokens: the device protocol."""
        copies = self.manager.take_pending_copies()
        assert copies.dtype == np.int32 and len(copies) <= MAX_COPIES
        padded = np.full((MAX_COPIES, 2), -1, np.int32)
        padded[:len(copies)] = copies
        self.k_pages, self.v_pages = _copy(self.k_pages, self.v_pages, jnp.asarray(padded))
        assert len(slots) == len(token_ids) <= MAX_WRITE
        s = np.full(MAX_WRITE, -1, np.int32)
        s[:len(slots)] = slots
        ids = np.zeros(MAX_WRITE, np.int64)
        ids[:len(token_ids)] = token_ids
        self.k_pages, self.v_pages = _write(self.k_pages, self.v_pages,
                                            jnp.asarray(TOKEN_K[ids]), jnp.asarray(TOKEN_V[ids]),
                                            jnp.asarray(s))

    def _pages_for(self, n):
        return -(-n // self.page_size)

    # -- rules ----------------------------------------------------------------------------

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(n=st.integers(0, 12))
    def allocate(self, n):
        sid = self.next_id
        free = self.manager.usage().free_pages
        assert self.manager.can_allocate(n) == (self._pages_for(n) <= free)
        if self._pages_for(n) > free:
            before = self._snapshot()
            with pytest.raises(CacheFullError) as e:
                self.manager.allocate(sid, n)
            assert (e.value.requested_pages, e.value.free_pages) == (self._pages_for(n), free)
            assert self._snapshot() == before
            return
        self.next_id += 1
        slots = self.manager.allocate(sid, n)
        token_ids = self._new_tokens(n)
        self.tokens[sid] = token_ids
        self._sync(slots, token_ids)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 99), n=st.integers(0, 6), free_index=st.none() | st.integers(0, 99))
    def append(self, index, n, free_index):
        sid = self._pick(index)
        m = self.manager
        length, table = len(self.tokens[sid]), m.block_table(sid).tolist()
        shared = length % self.page_size and any(
            table[-1] in m.block_table(o).tolist() for o in self.tokens if o != sid)
        need = int(bool(shared and n)) + self._pages_for(length + n) - len(table)
        free = m.usage().free_pages
        if need > free:
            before = self._snapshot()
            with pytest.raises(CacheFullError) as e:
                m.append(sid, n)
            assert (e.value.requested_pages, e.value.free_pages) == (need, free)
            assert self._snapshot() == before
            return
        slots = m.append(sid, n)
        assert slots.dtype == np.int32 and len(slots) == n
        if shared and n:
            np.testing.assert_array_equal(m.pending_copies(), [[table[-1], m.block_table(sid)[
                len(table) - 1]]])
        token_ids = self._new_tokens(n)
        self.tokens[sid] = self.tokens[sid] + token_ids
        if free_index is not None:  # free another sequence while a copy may be pending
            other = self._pick(free_index)
            if other != sid:
                m.free(other)
                del self.tokens[other]
        self._sync(slots, token_ids)

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_SEQS)
    @rule(index=st.integers(0, 99))
    def fork(self, index):
        src = self._pick(index)
        before = self.manager.usage()
        self.manager.fork(src, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[src])
        self.next_id += 1
        assert self.manager.usage().used_pages == before.used_pages

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 99))
    def free(self, index):
        sid = self._pick(index)
        self.manager.free(sid)
        del self.tokens[sid]

    @rule(n=st.integers(-3, -1))
    def bad_calls(self, n):
        before = self._snapshot()
        with pytest.raises(KeyError, match="never allocated"):
            self.manager.free(self.next_id + 7)
        freed = sorted(set(range(self.next_id)) - set(self.tokens))
        if freed:
            with pytest.raises(KeyError, match="already freed"):
                self.manager.free(freed[-1])  # a double free
            with pytest.raises(KeyError):
                self.manager.append(freed[0])
        with pytest.raises(ValueError):
            self.manager.allocate(self.next_id, n)
        if self.tokens:
            with pytest.raises(ValueError):
                self.manager.append(self._pick(0), n)
        assert self._snapshot() == before

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def bookkeeping_agrees(self):
        m, ps = self.manager, self.page_size
        owners: dict[int, list[tuple[int, int]]] = {}  # page -> [(seq, index in table)]
        for sid, toks in self.tokens.items():
            assert m.seq_len(sid) == len(toks)
            table = m.block_table(sid).tolist()
            assert len(table) == self._pages_for(len(toks))
            assert len(set(table)) == len(table)
            for i, page in enumerate(table):
                assert 0 <= page < NUM_PAGES
                owners.setdefault(page, []).append((sid, i))
        # A page held by several sequences sits at the same place in each, holds the
        # same number of their tokens (so no sharer can write into it), and those tokens agree.
        for sharers in owners.values():
            (first, i), rest = sharers[0], sharers[1:]
            for sid, j in rest:
                assert j == i
                assert (min(ps, len(self.tokens[sid]) - i * ps)
                        == min(ps, len(self.tokens[first]) - i * ps))
                assert (self.tokens[sid][i * ps:(i + 1) * ps]
                        == self.tokens[first][i * ps:(i + 1) * ps])
        usage = m.usage()
        assert usage.used_pages == len(owners)  # nothing leaked
        assert usage.free_pages == NUM_PAGES - len(owners)
        assert usage.total_pages == NUM_PAGES
        assert usage.num_sequences == len(self.tokens)
        assert usage.num_tokens == sum(len(t) for t in self.tokens.values())
        assert m.pending_copies().shape == (0, 2)

    @invariant()
    def pages_hold_what_was_written(self):
        ids = sorted(self.tokens)
        tables = np.zeros((MAX_SEQS, NUM_PAGES), np.int32)
        tables[:len(ids)] = self.manager.block_tables(ids, NUM_PAGES)
        lengths = np.zeros(MAX_SEQS, np.int32)
        lengths[:len(ids)] = [len(self.tokens[s]) for s in ids]
        k, v = _gather(self.k_pages, self.v_pages, jnp.asarray(tables), jnp.asarray(lengths))
        k, v = np.asarray(k), np.asarray(v)
        for row, sid in enumerate(ids):
            toks = self.tokens[sid]
            np.testing.assert_array_equal(k[row, :len(toks)], TOKEN_K[toks])
            np.testing.assert_array_equal(v[row, :len(toks)], TOKEN_V[toks])
        past = np.arange(k.shape[1])[None, :] >= lengths[:, None]
        assert not k[past].any() and not v[past].any()


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = hypothesis.settings(
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])


def test_decode_step_write_then_attend_does_not_copy_the_pool():
    """A model's decode step writes the new token and then attends in the same jit: the
    pool must still be updated in place, with scratch memory for the named pages only."""
    num_pages, page_size, kv_heads, head_dim = 2048, 4, 2, 32
    cache = _paged(num_layers=2, num_pages=num_pages, page_size=page_size, kv_heads=kv_heads,
                   head_dim=head_dim, tables=np.arange(8).reshape(4, 2))
    pool_bytes = num_pages * page_size * kv_heads * head_dim * 4
    k = jnp.asarray(np.random.default_rng(30).standard_normal((4, 1, kv_heads, head_dim)),
                    jnp.float32)
    q = jnp.concatenate([k, -k], axis=2)  # 4 query heads over 2 kv heads
    pos = jnp.asarray([[0], [3], [5], [7]], jnp.int32)

    def step(cache, q, k):
        for layer in range(2):
            cache = cache.write(layer, k, k, pos, jnp.ones((4, 1), bool))
            q = cache.attend(layer, q, q_positions=pos, kv_lengths=pos[:, 0] + 1)
        return cache, q

    compiled = jax.jit(step, donate_argnames="cache").lower(cache, q, k).compile()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < pool_bytes / 20
    assert stats.alias_size_in_bytes >= 4 * pool_bytes


def test_block_manager_prefix_pages_and_holds():
    m = BlockManager(num_pages=6, page_size=2)
    m.allocate("a", 5)  # pages 0, 1 full, page 2 partly filled
    prefix = m.block_table("a")[:2].tolist()
    for page in prefix:
        m.hold(page)  # a prefix cache keeps them
    m.free("a")
    assert m.usage().used_pages == 2 and [m.refcount(p) for p in prefix] == [1, 1]
    slots = m.allocate("b", 5, prefix_pages=prefix)  # shares them, one new page for token 4
    assert m.block_table("b")[:2].tolist() == prefix and slots[:4].tolist() == [
        prefix[0] * 2, prefix[0] * 2 + 1, prefix[1] * 2, prefix[1] * 2 + 1]
    assert [m.refcount(p) for p in prefix] == [2, 2] and m.usage().used_pages == 3
    m.append("b", 2)  # the shared pages are full: no copy-on-write
    assert m.pending_copies().shape == (0, 2)
    with pytest.raises(ValueError, match="more than num_tokens=3"):
        m.allocate("c", 3, prefix_pages=prefix)
    with pytest.raises(ValueError, match="page 5 is not in use"):
        m.allocate("c", 4, prefix_pages=[5, prefix[0]])
    assert "c" not in m and [m.refcount(p) for p in prefix] == [2, 2]
    m.free("b")
    for page in prefix:
        m.release(page)
    assert m.usage().used_pages == 0 and m.usage().free_pages == 6
    with pytest.raises(ValueError, match="not in use"):
        m.release(prefix[0])


def test_cache_spec_checks_its_fields():
    from forge_jax.kv_cache import CacheSpec

    spec = CacheSpec(kind="contiguous", page_size=8, dtype="bfloat16", kv_dtype="int8")
    assert spec.dtype == jnp.bfloat16 and spec.resolved_dtype(jnp.float32) == jnp.bfloat16
    assert CacheSpec().resolved_dtype(jnp.float16) == jnp.float16
    for bad, match in [(dict(kind="ring"), "kind="), (dict(page_size=0), "page_size=0"),
                       (dict(page_size=True), "page_size=True"), (dict(dtype="int32"), "int32"),
                       (dict(kv_dtype="int4"), "kv_dtype='int4'")]:
        with pytest.raises(ValueError, match=match):
            CacheSpec(**bad)
