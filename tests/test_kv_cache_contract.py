"""The KV-cache contract (forge_jax/kv_cache/contract.py): every cache a model may be handed
(contiguous, paged, and the serving step's ragged batch) has its members, and each member does
what the contract says on small random inputs: ``write`` stores the valid tokens where their
positions say and nothing else, ``attend`` matches a float64 reference over NaN/inf-poisoned
storage it must not read, ``as_stored`` rounds as the cache stores, ``with_lengths`` replaces the
lengths. Also: the rule that decides whether a paged cache's pools are stored folded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import rng
from cases.references import attention_ref, f64

import forge_jax as fj
from forge_jax.kv_cache import (
    CacheSpec,
    ContiguousKVCache,
    KVCache,
    PagedKVCache,
    RaggedBatchCache,
    RaggedMetadata,
    stores_folded,
)

KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 2, 4, 8, 4
F32 = jnp.float32


def _poisoned(gen, shape):
    """NaN keys and +-inf values: storage a query must never read."""
    return (jnp.full(shape, jnp.nan, F32),
            jnp.asarray(gen.choice([np.inf, -np.inf], shape), F32))


def _new_tokens(gen, lengths, t):
    """Random ``k, v [batch, t, kv_heads, head_dim]``, positions ``0..t-1`` and the mask of
    each row's first ``lengths[b]`` tokens (the rest padding)."""
    batch = len(lengths)
    k = gen.standard_normal((batch, t, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = gen.standard_normal((batch, t, KV_HEADS, HEAD_DIM)).astype(np.float32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (batch, t))
    valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    return k, v, positions, valid


def _contiguous(gen, batch, max_len):
    k, v = _poisoned(gen, (batch, max_len, KV_HEADS, HEAD_DIM))
    return ContiguousKVCache(k=(k,), v=(v,), lengths=jnp.zeros((batch,), jnp.int32))


def _paged(gen, batch, max_pages, num_pages):
    k, v = _poisoned(gen, (KV_HEADS, num_pages, PAGE, HEAD_DIM))
    # Each row on its own randomly chosen pages; the pool's other pages stay poisoned.
    tables = gen.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
    return PagedKVCache(k_pages=(k,), v_pages=(v,), block_tables=jnp.asarray(tables, jnp.int32),
                        lengths=jnp.zeros((batch,), jnp.int32), page_size=PAGE)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_per_row_cache_writes_and_attends_as_the_contract_says(kind):
    gen = rng(1, len(kind))
    lengths, t = np.array([5, 9]), 10
    cache = (_contiguous(gen, 2, 12) if kind == "contiguous" else _paged(gen, 2, 3, 9))
    assert isinstance(cache, KVCache)
    k, v, positions, valid = _new_tokens(gen, lengths, t)
    cache = cache.write(0, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions),
                        jnp.asarray(valid))
    # Nothing but the valid tokens was written: every other slot still holds its poison.
    stored = cache.k[0] if kind == "contiguous" else cache.k_pages[0]
    assert int(np.isfinite(np.asarray(stored)).sum()) == lengths.sum() * KV_HEADS * HEAD_DIM
    assert (cache.lengths == 0).all()  # write leaves the lengths alone
    cache = cache.with_lengths(jnp.asarray(lengths, jnp.int32))
    np.testing.assert_array_equal(cache.lengths, lengths)
    # Each row's last two tokens attend over its cache.
    q = gen.standard_normal((2, 2, Q_HEADS, HEAD_DIM)).astype(np.float32)
    q_positions = (lengths[:, None] - 2 + np.arange(2)[None, :]).astype(np.int32)
    out = cache.attend(0, jnp.asarray(q), q_positions=jnp.asarray(q_positions),
                       kv_lengths=jnp.asarray(lengths, jnp.int32))
    dense_k = np.where(valid[..., None, None], f64(k), 0.0)
    dense_v = np.where(valid[..., None, None], f64(v), 0.0)
    ref = attention_ref(q, dense_k, dense_v, q_positions=q_positions, kv_lengths=lengths)
    assert out.dtype == F32
    assert_close(out, ref, implementation="xla")


def test_the_ragged_cache_places_each_token_by_its_sequence_and_position():
    gen = rng(2)
    num_pages, pages_per_seq, max_seqs = 10, 3, 3
    k_pool, v_pool = _poisoned(gen, (KV_HEADS, num_pages, PAGE, HEAD_DIM))
    tables = np.full((max_seqs, pages_per_seq), 2**30, np.int32)  # unused entries: huge
    tables[0], tables[1] = [7, 2, 5], [4, 0, 9]
    # Two sequences in one packed row of 12: a prefill of 6 and a chunk of 3 (positions 5..7
    # of a sequence whose first 5 tokens are already cached), then 3 padding rows.
    kv_lens = [6, 8]
    cached = gen.standard_normal((5, KV_HEADS, HEAD_DIM)).astype(np.float32), \
        gen.standard_normal((5, KV_HEADS, HEAD_DIM)).astype(np.float32)
    slots1 = [tables[1, i // PAGE] * PAGE + i % PAGE for i in range(5)]

    def put(pool, x):
        flat = pool.reshape(KV_HEADS, -1, HEAD_DIM).at[:, jnp.asarray(slots1)].set(
            jnp.asarray(x).transpose(1, 0, 2))
        return flat.reshape(pool.shape)

    pool = PagedKVCache(k_pages=(put(k_pool, cached[0]),), v_pages=(put(v_pool, cached[1]),),
                        block_tables=jnp.zeros((0, pages_per_seq), jnp.int32),
                        lengths=jnp.zeros((0,), jnp.int32), page_size=PAGE)
    metadata = RaggedMetadata(
        block_tables=jnp.asarray(tables), kv_lengths=jnp.asarray([6, 8, 2**30], jnp.int32),
        cu_q_lens=jnp.asarray([0, 6, 9, 9], jnp.int32), num_seqs=jnp.int32(2))
    cache = RaggedBatchCache.from_pool(pool, metadata)
    assert isinstance(cache, KVCache) and cache.batch == 1
    rows = 12
    k = gen.standard_normal((1, rows, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = gen.standard_normal((1, rows, KV_HEADS, HEAD_DIM)).astype(np.float32)
    positions = np.zeros((1, rows), np.int32)
    positions[0, :9] = [0, 1, 2, 3, 4, 5, 5, 6, 7]
    valid = np.zeros((1, rows), bool)
    valid[0, :9] = True
    valid[0, 9] = False  # and rows 10, 11: past the step's sequences, valid or not
    valid[0, 10:] = True
    # A row of a sequence marked invalid is not written either.
    hole = valid.copy()
    hole[0, 3] = False
    slots = np.asarray(cache.slots(jnp.asarray(positions), jnp.asarray(hole)))
    assert slots[3] == -1 and (slots[9:] == -1).all() and (np.delete(slots[:9], 3) >= 0).all()
    cache = cache.write(0, jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions),
                        jnp.asarray(valid))
    written = np.isfinite(np.asarray(cache.k_pages[0]))
    assert int(written.sum()) == (6 + 8) * KV_HEADS * HEAD_DIM  # 9 new tokens, 5 cached
    got = np.asarray(cache.k_pages[0]).reshape(KV_HEADS, -1, HEAD_DIM)
    for row, (seq, pos) in enumerate([(0, p) for p in range(6)] + [(1, 5), (1, 6), (1, 7)]):
        slot = tables[seq, pos // PAGE] * PAGE + pos % PAGE
        np.testing.assert_array_equal(got[:, slot], k[0, row])
    cache = cache.with_lengths(jnp.asarray([8], jnp.int32))
    np.testing.assert_array_equal(cache.lengths, [8])
    q = gen.standard_normal((1, rows, Q_HEADS, HEAD_DIM)).astype(np.float32)
    # The per-row arguments of the contract do not describe the packed row's sequences:
    # the metadata does (see KVCache.attend), so garbage here changes nothing.
    out = cache.attend(0, jnp.asarray(q), q_positions=jnp.full((1, rows), -7, jnp.int32),
                       kv_lengths=jnp.asarray([0], jnp.int32))
    assert out.shape == (1, rows, Q_HEADS, HEAD_DIM) and out.dtype == F32
    dense = [np.concatenate([k[0, :6]]), np.concatenate([cached[0], k[0, 6:9]])]
    dense_v = [np.concatenate([v[0, :6]]), np.concatenate([cached[1], v[0, 6:9]])]
    for s, (start, stop) in enumerate([(0, 6), (6, 9)]):
        ref = attention_ref(q[:, start:stop], dense[s][None], dense_v[s][None],
                            kv_lengths=np.array([kv_lens[s]]))
        assert_close(out[:, start:stop], ref, implementation="xla", err_msg=f"sequence {s}")


@pytest.mark.parametrize("make", ["contiguous", "paged", "ragged"])
def test_as_stored_rounds_and_quantizes_as_the_cache_stores(make):
    gen = rng(3, len(make))
    x = jnp.asarray(gen.standard_normal((3, HEAD_DIM)) * 3, F32)
    for dtype, quantize in ((jnp.bfloat16, None), (F32, "int8")):
        if make == "contiguous":
            cache = ContiguousKVCache.create(num_layers=1, batch=1, max_len=4,
                                             kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                                             quantize=quantize)
        else:
            cache = PagedKVCache.create(num_layers=1, num_pages=2, page_size=PAGE,
                                        kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                                        block_tables=np.zeros((1, 2), np.int32),
                                        quantize=quantize)
            if make == "ragged":
                cache = RaggedBatchCache.from_pool(cache, RaggedMetadata(
                    jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                    jnp.asarray([0, 1], jnp.int32), jnp.int32(1)))
        assert isinstance(cache, KVCache)
        stored = cache.as_stored(x)
        assert stored.dtype == dtype
        if quantize is None:
            np.testing.assert_array_equal(stored, x.astype(dtype))
        else:  # int8 with a scale per vector: within half a step of the vector's max / 127
            step = np.abs(f64(x)).max(axis=-1, keepdims=True) / 127
            assert (np.abs(f64(stored) - f64(x)) <= step / 2 * 1.001).all()
            assert not np.array_equal(f64(stored), f64(x))


def test_what_is_not_a_cache():
    assert not isinstance(object(), KVCache)
    assert not isinstance(RaggedMetadata(*(jnp.zeros(1),) * 4), KVCache)


# --- whether the pools are stored folded -------------------------------------------------


@pytest.mark.parametrize("spec, head_dim, platform, folded", [
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 64, "tpu", True),  # SmolLM2 on TPU
    (CacheSpec(page_size=16, dtype=jnp.float32), 64, "tpu", True),
    (CacheSpec(page_size=32, dtype=jnp.bfloat16), 32, "tpu", True),  # 8 rows of 4 tokens
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 64, "cpu", False),
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 64, "gpu", False),
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 128, "tpu", False),  # whole lanes already
    (CacheSpec(page_size=16, dtype=jnp.bfloat16, kv_dtype="int8"), 64, "tpu", False),
    (CacheSpec(page_size=16, dtype=jnp.float16), 64, "tpu", False),  # the kernel reads none
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 32, "tpu", False),  # 4 rows: not 8
    (CacheSpec(page_size=15, dtype=jnp.bfloat16), 64, "tpu", False),  # no whole rows
    (CacheSpec(page_size=16, dtype=jnp.bfloat16), 48, "tpu", False),  # 48 does not divide
])
def test_the_fold_rule_reads_the_spec_and_the_platform(spec, head_dim, platform, folded):
    assert stores_folded(spec, head_dim=head_dim, platform=platform) is folded


def test_create_folds_by_the_rule_on_the_current_platform():
    make = lambda: PagedKVCache.create(  # noqa: E731
        num_layers=1, num_pages=2, page_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
        block_tables=np.zeros((1, 2), np.int32))
    assert jax.default_backend() != "tpu" and not make().folded  # CPU: never
    with fj.targets.use("tpu-v5e"):  # a TPU target: folded
        cache = make()
    assert cache.folded and cache.k_pages[0].data.shape == (2, 2, 8, 128)
    with pytest.raises(ValueError, match="head_dim must be"):
        stores_folded(CacheSpec(), head_dim=0, platform="tpu")
