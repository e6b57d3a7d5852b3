"""``prefill_step(empty_cache=True)``, generate's prefill: the prompt attends to itself alone
instead of to the cache's whole capacity, with the same tokens and the same cache as the
cached path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.inputs import random_llama
from flax import nnx

from forge_jax.generation import sampling
from forge_jax.kv_cache import ContiguousKVCache, PagedKVCache
from forge_jax.models import llama

CONFIG = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
BATCH, BUCKET, CACHE_LEN, PAGE = 3, 16, 32, 8


def _model(seed) -> llama.Llama:
    return random_llama(CONFIG, seed)


def _cache(kind):
    if kind == "contiguous":
        return ContiguousKVCache.create(num_layers=2, batch=BATCH, max_len=CACHE_LEN,
                                        kv_heads=2, head_dim=16)
    pages = CACHE_LEN // PAGE
    tables = np.arange(BATCH * pages, dtype=np.int32).reshape(BATCH, pages)[:, ::-1].copy()
    return PagedKVCache.create(num_layers=2, num_pages=BATCH * pages, page_size=PAGE,
                               kv_heads=2, head_dim=16, block_tables=tables)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_empty_cache_prefill_matches_the_cached_path(kind):
    graphdef, state = nnx.split(_model(3))
    gen = np.random.default_rng(7)
    lengths = np.array([16, 9, 0], np.int32)  # a full row, a padded one, a batch padding row
    tokens = np.where(np.arange(BUCKET) < lengths[:, None],
                      gen.integers(0, CONFIG.vocab_size, (BATCH, BUCKET)), 0).astype(np.int32)
    greedy = sampling.SamplingParams()
    seen = jnp.zeros((BATCH, CONFIG.vocab_size), bool)
    out = {}
    for empty in (False, True):
        out[empty] = llama.prefill_step(
            state, _cache(kind), jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(1),
            greedy.arrays(), seen, graphdef=graphdef, greedy=greedy.greedy, empty_cache=empty)
    (tok0, _, cache0), (tok1, _, cache1) = out[False], out[True]
    np.testing.assert_array_equal(np.asarray(tok0)[:2], np.asarray(tok1)[:2])
    np.testing.assert_array_equal(np.asarray(cache0.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(cache1.lengths), lengths)
    # The same slots written with the same keys and values (up to rounding past layer 0),
    # the rest untouched (zeros).
    for a, b in zip(jax.tree.leaves(cache0), jax.tree.leaves(cache1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(a) == 0, np.asarray(b) == 0)


def test_generate_prefills_an_empty_cache():
    """generate's greedy tokens with the prompt attending to itself equal those of a
    prefill over the cache (a cache longer than the prompt bucket: 8 + 30 -> 64)."""
    model = _model(4)
    prompts = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7]]
    tokens, stats = llama.generate_with_stats(model, prompts, 30, cache="paged")
    assert stats.cache_len > stats.prompt_bucket
    graphdef, state = nnx.split(model)
    # The same prefill over the cache, then generate's own decode: run by hand.
    cache = PagedKVCache.create(num_layers=2, num_pages=2 * 4, page_size=16, kv_heads=2,
                                head_dim=16,
                                block_tables=np.arange(8, dtype=np.int32).reshape(2, 4))
    ids = np.zeros((2, 8), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    params = sampling.SamplingParams().arrays()
    greedy = sampling.SamplingParams().greedy
    seen = jnp.zeros((2, CONFIG.vocab_size), bool)
    first, seen, cache = llama.prefill_step(
        state, cache, jnp.asarray(ids), jnp.asarray([5, 7], jnp.int32), jax.random.key(0),
        params, seen, graphdef=graphdef, greedy=greedy)
    out = [np.asarray(first)]
    for step in range(1, 30):
        first, seen, cache = llama.decode_step(
            state, cache, first, jnp.ones((2,), bool), jax.random.key(0),
            jnp.asarray(step, jnp.int32), params, seen, graphdef=graphdef, greedy=greedy)
        out.append(np.asarray(first))
    np.testing.assert_array_equal(np.stack(out, 1), np.asarray(tokens))


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
@pytest.mark.parametrize("empty", [True, False])
def test_prefill_logits_are_the_full_forwards_at_each_last_token(kind, empty):
    # The prefill runs the last layer's queries, attention and MLP for each row's last
    # token alone; its logits must be the full forward's (every token through every layer)
    # at that token, and its cache hold every token's keys and values.
    model = _model(5)
    gen = np.random.default_rng(11)
    lengths = np.array([16, 9, 1], np.int32)
    tokens = np.where(np.arange(BUCKET) < lengths[:, None],
                      gen.integers(1, CONFIG.vocab_size, (BATCH, BUCKET)), 0).astype(np.int32)
    offsets = np.broadcast_to(np.arange(BUCKET, dtype=np.int32), (BATCH, BUCKET))
    logits, cache = model.forward_cached(
        jnp.asarray(tokens), jnp.asarray(offsets), jnp.asarray(offsets < lengths[:, None]),
        _cache(kind), logits_at=jnp.asarray(lengths - 1), empty_cache=empty)
    assert logits.shape == (BATCH, CONFIG.vocab_size)
    full = np.asarray(model(jnp.asarray(tokens)))  # [batch, t, vocab]
    np.testing.assert_allclose(np.asarray(logits), full[np.arange(BATCH), lengths - 1],
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    # The next token, decoded from that cache, sees every prompt token of the last layer.
    nxt = gen.integers(1, CONFIG.vocab_size, BATCH).astype(np.int32)
    step, _ = model.forward_cached(jnp.asarray(nxt[:, None]), jnp.asarray(lengths[:, None]),
                                   jnp.ones((BATCH, 1), bool), cache,
                                   logits_at=jnp.zeros(BATCH, jnp.int32))
    for b, n in enumerate(lengths):
        row = np.concatenate([tokens[b, :n], nxt[b:b + 1]])[None]
        np.testing.assert_allclose(np.asarray(step[b]), np.asarray(model(jnp.asarray(row)))[0, -1],
                                   rtol=2e-5, atol=2e-5)


def test_prompt_buckets_pad_by_at_most_a_quarter():
    from forge_jax.generation import loop as generation
    buckets = [generation.prompt_bucket(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in enumerate(buckets, 1))
    assert all(b <= max(8, 2 * n if n <= 64 else 1.25 * n) for n, b in enumerate(buckets, 1))
    assert {generation.prompt_bucket(n) for n in (1000, 1024)} == {1024}
    assert generation.prompt_bucket(1100) == 1280 and generation.prompt_bucket(2049) == 2560
    assert len({b for b in buckets if 1024 < b <= 2048}) == 4  # four per octave
