"""Folded page pools (forge_jax/ops/kv_fold.py): the paged ops on a folded pool keep their
logical contract (XLA implementations here, against float64 references on NaN-poisoned
pools), the write scatters into the folded rows, the cache folds only where asked or
where the TPU kernel reads folded pools, and kernels that read unfolded pages refuse them.
The TPU kernel's folded reads: tests/test_pallas_tpu_paged.py; compiled: tests/test_aot.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import default_positions, make_step, paged_cache
from cases.references import attention_ref, f64, ragged_paged_attention_ref

import forge_jax as fj
from forge_jax.kv_cache import PagedKVCache
from forge_jax.ops import kv_fold

F32, BF16 = jnp.float32, jnp.bfloat16


def _folded(*pools):
    return tuple(kv_fold.fold(p) for p in pools)


def test_fold_puts_consecutive_tokens_side_by_side():
    pool = rng(0).standard_normal((2, 3, 8, 32)).astype(np.float32)
    folded = kv_fold.fold(jnp.asarray(pool))
    assert folded.data.shape == (2, 3, 2, 128) and folded.fold == 4
    assert folded.shape == pool.shape and folded.dtype == F32
    # Row t of a page holds tokens 4t .. 4t+3, token 4t+r in lanes [32r, 32r + 32).
    np.testing.assert_array_equal(np.asarray(folded.data)[1, 2, 1, 64:96], pool[1, 2, 6])
    np.testing.assert_array_equal(np.asarray(kv_fold.logical(folded)), pool)
    assert kv_fold.fold_factor(128, 16) == 1 and kv_fold.fold_factor(64, 15) == 1
    assert kv_fold.fold_factor(80, 16) == 1 and kv_fold.fold_factor(64, 16) == 2
    with pytest.raises(ValueError, match="cannot fold"):
        kv_fold.fold(jnp.zeros((1, 2, 16, 128)))
    with pytest.raises(ValueError, match="only float pools fold, got a QuantizedArray"):
        kv_fold.fold(fj.ops.kv_quant.empty_pool((1, 2, 16, 64), "int8"))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_lands_in_the_folded_rows(dtype):
    gen = rng(1)
    shape = (3, 5, 16, 64)
    pool = gen.standard_normal(shape).astype(np.float32)
    k = gen.standard_normal((7, 3, 64)).astype(np.float32)
    # Neighbouring slots share a stored row; -1 skips; 5 * 16 is past the pool (traced).
    slots = np.array([17, 16, 3, -1, 79, 40, 41], np.int32)
    expect = np.asarray(jnp.asarray(pool, dtype)).astype(np.float64)
    for t, s in enumerate(slots):
        if 0 <= s < 80:
            expect[:, s // 16, s % 16] = f64(jnp.asarray(k[t], dtype))
    write = jax.jit(fj.paged_write)
    folded = _folded(jnp.asarray(pool, dtype), jnp.asarray(pool, dtype))
    new_k, new_v = write(*folded, jnp.asarray(k), jnp.asarray(k), jnp.asarray(slots))
    assert kv_fold.is_folded(new_k) and new_k.data.shape == (3, 5, 8, 128)
    np.testing.assert_array_equal(f64(kv_fold.logical(new_k)), expect)
    np.testing.assert_array_equal(f64(kv_fold.logical(new_v)), expect)
    past = jnp.asarray(np.where(slots < 0, slots, slots + 80))
    new_k, _ = write(*folded, jnp.asarray(k), jnp.asarray(k), past)
    np.testing.assert_array_equal(f64(kv_fold.logical(new_k)), f64(jnp.asarray(pool, dtype)))


@pytest.mark.parametrize("q_len, window", [(None, None), (3, 9)])
def test_paged_attention_and_gather_read_a_folded_pool(q_len, window):
    gen = rng(2)
    lengths = np.array([37, 5, 64])
    positions = default_positions(lengths, q_len or 1)
    cache = paged_cache(gen, lengths, positions=positions, window=window, page_size=16,
                        kv_heads=2, head_dim=64, dtype=F32)
    q = jnp.asarray(gen.standard_normal((3, q_len or 1, 6, 64)), F32)
    k, v = _folded(cache.k_pages, cache.v_pages)
    out = fj.paged_attention(q if q_len else q[:, 0], k, v, cache.block_tables,
                             jnp.asarray(lengths, jnp.int32), sliding_window=window,
                             implementation="xla")
    ref = attention_ref(f64(q), cache.dense_k, cache.dense_v, q_positions=positions,
                        kv_lengths=lengths, sliding_window=window)
    assert_close(out if q_len else out[:, None], ref, implementation="xla")
    if window is None:
        dense = fj.paged_gather(k, cache.block_tables, jnp.asarray(lengths, jnp.int32))
        np.testing.assert_array_equal(f64(dense), cache.dense_k)


def test_ragged_attention_reads_a_folded_pool():
    step = make_step(rng(3), [1, 7, 1], [30, 7, 17], max_seqs=4, total_tokens=12,
                     page_size=16, heads="smollm2", head_dim=64, dtype=F32)
    q, k, v, tables, kv_lengths, cu, num_seqs = step.args()
    out = fj.ragged_paged_attention(q, *_folded(k, v), tables, kv_lengths, cu, num_seqs,
                                    implementation="xla")
    rows = int(step.cu_q_lens[step.num_seqs])
    assert_close(out[:rows], ragged_paged_attention_ref(step)[:rows], implementation="xla")


def test_copy_pages_copies_folded_pages():
    pool = jnp.asarray(rng(4).standard_normal((2, 4, 16, 64)), F32)
    k, v = fj.copy_pages(*_folded(pool, -pool), jnp.asarray([[2, 0], [-1, 3]], jnp.int32))
    expect = np.asarray(pool).copy()
    expect[:, 0] = expect[:, 2]
    np.testing.assert_array_equal(np.asarray(kv_fold.logical(k)), expect)
    np.testing.assert_array_equal(np.asarray(kv_fold.logical(v)), -expect)


def test_mixed_or_mismatched_pools_are_refused():
    pool = jnp.ones((2, 4, 16, 64), F32)
    q, tables, lengths = jnp.ones((1, 2, 64), F32), jnp.zeros((1, 2), jnp.int32), \
        jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="both be folded alike"):
        fj.paged_attention(q, kv_fold.fold(pool), pool, tables, lengths)


def test_kernels_that_read_unfolded_pages_refuse_folded_pools():
    pool = kv_fold.fold(jnp.ones((2, 4, 16, 64), F32))
    q, tables, lengths = jnp.ones((1, 2, 64), F32), jnp.zeros((1, 2), jnp.int32), \
        jnp.ones((1,), jnp.int32)
    with pytest.raises(fj.ImplementationError, match="k_pages is folded"):
        fj.paged_attention(q, pool, pool, tables, lengths, implementation="pallas_gpu_interpret")


def test_the_cache_folds_only_where_asked_or_read_folded():
    make = lambda **kw: PagedKVCache.create(  # noqa: E731
        num_layers=2, num_pages=4, page_size=16, kv_heads=2, head_dim=64,
        block_tables=np.zeros((1, 4), np.int32), **kw)
    assert not make().folded  # CPU (and GPU): never by default
    cache = make(fold=True)
    assert cache.folded and cache.head_dim == 64 and cache.num_pages == 4
    assert cache.k_pages[0].data.shape == (2, 4, 8, 128)
    with pytest.raises(ValueError, match="quantized pools are not folded"):
        make(fold=True, quantize="int8")
    with pytest.raises(ValueError, match="head_dim < 128"):
        PagedKVCache.create(num_layers=1, num_pages=4, page_size=16, kv_heads=2, head_dim=128,
                            block_tables=np.zeros((1, 4), np.int32), fold=True)


def test_a_folded_cache_writes_and_attends_as_an_unfolded_one():
    gen = rng(5)
    tables = np.array([[3, 1, 0], [2, 4, 5]], np.int32)
    make = lambda fold: PagedKVCache.create(  # noqa: E731
        num_layers=1, num_pages=6, page_size=16, kv_heads=2, head_dim=64,
        block_tables=tables, fold=fold)
    k = jnp.asarray(gen.standard_normal((2, 21, 2, 64)), F32)
    v = jnp.asarray(gen.standard_normal((2, 21, 2, 64)), F32)
    positions = jnp.broadcast_to(jnp.arange(21, dtype=jnp.int32), (2, 21))
    valid = jnp.asarray(np.arange(21)[None, :] < np.array([[21], [13]]))
    q = jnp.asarray(gen.standard_normal((2, 1, 4, 64)), F32)
    lengths = jnp.asarray([21, 13], jnp.int32)
    outs = []
    for fold in (False, True):
        cache = make(fold).write(0, k, v, positions, valid)
        assert cache.folded == fold
        outs.append(cache.attend(0, q, q_positions=lengths[:, None] - 1, kv_lengths=lengths))
    dense_k = np.where(np.asarray(valid)[..., None, None], f64(k), 0.0)
    dense_v = np.where(np.asarray(valid)[..., None, None], f64(v), 0.0)
    ref = attention_ref(f64(q), dense_k, dense_v, q_positions=np.asarray(lengths)[:, None] - 1,
                        kv_lengths=np.asarray(lengths))
    for out in outs:
        assert_close(out, ref, implementation="xla")


def test_folded_pools_split_by_head_on_a_mesh():
    gen = rng(6)
    pool = gen.standard_normal((2, 6, 16, 64)).astype(np.float32)
    x = gen.standard_normal((3, 2, 64)).astype(np.float32)
    slots = np.array([5, 17, 33])
    q = jnp.asarray(gen.standard_normal((2, 4, 64)), F32)
    tables, lengths = np.array([[0, 1], [2, 3]]), np.array([20, 9])
    with fj.sharding.use_mesh(fj.sharding.make_mesh({"dp": 2, "tp": 2})):
        k, v = jax.jit(fj.paged_write)(*_folded(jnp.asarray(pool), jnp.asarray(-pool)),
                                       jnp.asarray(x), jnp.asarray(x), jnp.asarray(slots))
        out = jax.jit(fj.paged_attention)(q, k, v, jnp.asarray(tables, jnp.int32),
                                          jnp.asarray(lengths, jnp.int32))
    expect_k, expect_v = pool.astype(np.float64), -pool.astype(np.float64)
    for t, s in enumerate(slots):
        expect_k[:, s // 16, s % 16] = expect_v[:, s // 16, s % 16] = x[t]
    np.testing.assert_array_equal(f64(kv_fold.logical(k)), expect_k)
    dense = lambda p: np.transpose(p[:, tables].reshape(2, 2, 32, 64), (1, 2, 0, 3))  # noqa: E731
    ref = attention_ref(f64(q)[:, None], dense(expect_k), dense(expect_v),
                        q_positions=lengths[:, None] - 1, kv_lengths=lengths)
    assert_close(out[:, None], ref, implementation="xla")
