"""The serving engine's settings: :class:`EngineConfig` checks each knob on creation with an
error naming the field and its value, and the engine builds its page pool, a
:class:`PagedKVCache`, from the config's cache spec."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from forge_jax.kv_cache import CacheSpec, PagedKVCache
from forge_jax.serving import Engine, EngineConfig, RequestParams


@pytest.mark.parametrize("fields, error, match", [
    (dict(max_batch_tokens=0), ValueError, r"max_batch_tokens must be an int >= 1, got "
                                           r"max_batch_tokens=0"),
    (dict(min_batch_tokens=2.0), ValueError, r"min_batch_tokens must be an int >= 1, got "
                                             r"min_batch_tokens=2.0"),
    (dict(max_seqs=True), ValueError, r"max_seqs must be an int >= 1, got max_seqs=True"),
    (dict(num_pages=-3), ValueError, r"num_pages must be an int >= 1, got num_pages=-3"),
    (dict(max_waiting=0), ValueError, r"max_waiting must be an int >= 1, got max_waiting=0"),
    (dict(max_model_len=0), ValueError, r"max_model_len must be an int >= 1, got "
                                        r"max_model_len=0"),
    (dict(min_batch_tokens=64, max_batch_tokens=32), ValueError,
     r"min_batch_tokens must be <= max_batch_tokens, got min_batch_tokens=64 and "
     r"max_batch_tokens=32"),
    (dict(prefix_caching="yes"), TypeError, r"prefix_caching must be a bool, got "
                                            r"prefix_caching='yes'"),
    (dict(overlap=1), TypeError, r"overlap must be a bool, got overlap=1"),
    (dict(eos_token_ids=[2, -1]), ValueError, r"eos_token_ids must be ints >= 0 or None, got "
                                              r"eos_token_ids=\[2, -1\]"),
    (dict(eos_token_ids="2"), ValueError, r"eos_token_ids must be ints >= 0 or None"),
    (dict(cache=dict(page_size=8)), TypeError, r"cache must be a forge_jax.kv_cache.CacheSpec"),
    (dict(cache=CacheSpec(kind="contiguous")), ValueError,
     r"cache.kind must be 'paged' \(the engine's pool is paged\), got "
     r"cache.kind='contiguous'"),
])
def test_a_bad_knob_is_named_with_its_value(fields, error, match):
    with pytest.raises(error, match=match) as info:
        EngineConfig(**fields)
    assert "\n" not in str(info.value)


def test_the_config_is_frozen_and_keeps_ids_as_a_tuple():
    config = EngineConfig(eos_token_ids=[np.int64(2), 7])
    assert config.eos_token_ids == (2, 7) and all(type(t) is int for t in config.eos_token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_seqs = 3
    assert dataclasses.replace(config, max_seqs=3).max_seqs == 3


def test_the_engine_holds_a_paged_cache_of_its_spec(chat_model):
    engine = Engine(chat_model, None, EngineConfig(
        num_pages=12, max_model_len=64, eos_token_ids=(),
        cache=CacheSpec(page_size=8, dtype=jnp.bfloat16)))
    cache = engine.cache
    assert isinstance(cache, PagedKVCache) and not cache.folded
    assert cache.num_layers == chat_model.config.num_hidden_layers
    assert (cache.num_pages, cache.page_size, cache.kv_heads, cache.head_dim) == (
        12, 8, chat_model.kv_heads, chat_model.config.head_dim)
    assert cache.dtype == jnp.bfloat16 and engine.pages_per_seq == 8
    assert engine.config.cache.page_size == engine.page_size == 8
    with pytest.raises(TypeError, match=r"config must be a forge_jax.serving.EngineConfig"):
        Engine(chat_model, None, dict(num_pages=12))
    # And it serves.
    stream = engine.submit([1, 2, 3], RequestParams(max_tokens=2))
    while engine.has_work():
        engine.step()
    assert len(stream.result()[0]) == 2


def test_the_last_releases_keywords_still_build_the_same_engine_with_a_warning(chat_model):
    with pytest.warns(DeprecationWarning, match=r"Engine\(\): the keywords kv_cache_dtype, "
                                                r"num_pages, page_size are deprecated"):
        engine = Engine(chat_model, None, num_pages=12, page_size=8, kv_cache_dtype="int8")
    assert engine.config == EngineConfig(num_pages=12,
                                         cache=CacheSpec(page_size=8, kv_dtype="int8"))
    # Over a given config; unknown keywords are refused as Python refuses them.
    with pytest.warns(DeprecationWarning):
        engine = Engine(chat_model, None, EngineConfig(num_pages=12), overlap=False)
    assert engine.config == EngineConfig(num_pages=12, overlap=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'pages'"):
        Engine(chat_model, None, pages=12)
