"""Quantized KV caches (int8, fp8) in the model: the embedded tiny model's logits with a
quantized paged or contiguous cache against the float32 cache's, ``generate``'s
``kv_cache_dtype`` and its statistics, and the CLI's ``--kv-cache-dtype``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.cli import assert_one_line_error, run
from flax import nnx

from forge_jax import memory
from forge_jax.cli import generate as cli_generate
from forge_jax.generation.stats import GenerationStats
from forge_jax.kv_cache import ContiguousKVCache, PagedKVCache
from forge_jax.models import llama
from forge_jax.models.tiny import task as tasks
from forge_jax.models.tiny import train as train_tiny

# Measured on the tiny model (2 layers, head_dim 32, 24 decode steps): the largest logit
# difference from the float32 cache is 0.073 (int8) and 0.20 (fp8) times the logits' standard
# deviation; the bounds leave ~1.4x room.
LOGIT_BOUND = {"int8": 0.1, "fp8": 0.3}


@pytest.fixture(scope="module")
def model():
    return llama.from_pretrained(train_tiny.TINY_DIR)


def _cache(model, kind, quantize):
    c = model.config
    kw = dict(num_layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads,
              head_dim=c.head_dim, quantize=quantize)
    if kind == "contiguous":
        return ContiguousKVCache.create(batch=2, max_len=24, **kw)
    # Sequence b owns pages b, b + 2, ...: interleaved.
    return PagedKVCache.create(num_pages=12, page_size=4,
                               block_tables=np.arange(12, dtype=np.int32).reshape(6, 2).T, **kw)


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _step(state, cache, tokens, positions, *, graphdef):
    valid = jnp.ones(tokens.shape, bool)
    return nnx.merge(graphdef, state).forward_cached(tokens, positions, valid, cache)


def _logits(model, cache, seqs):
    """Logits of the tokens of ``seqs [2, n]`` fed one decode step at a time (one compiled
    step per cache structure)."""
    graphdef, state = nnx.split(model)
    out = []
    for p in range(seqs.shape[1]):
        logits, cache = _step(state, cache, jnp.asarray(seqs[:, p:p + 1]),
                              jnp.full((2, 1), p, jnp.int32), graphdef=graphdef)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("kind,format", [("paged", "int8"), ("contiguous", "fp8")])
def test_quantized_cache_logits_near_the_float_cache(model, kind, format):
    seqs = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 24)).astype(np.int32)
    ref, _ = _logits(model, _cache(model, kind, None), seqs)
    out, cache = _logits(model, _cache(model, kind, format), seqs)
    assert cache.quantization == format
    err = np.abs(out - ref).max() / ref.std()
    assert 0 < err <= LOGIT_BOUND[format], err  # 0 would mean nothing was quantized
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


def test_generate_with_an_int8_cache_solves_the_task(model):
    # The tiny model answers these eight problems right with its float32 cache
    # (tests/test_tiny.py measures its accuracy); with an int8 cache too.
    problems = tasks.AdditionTask(max_digits=3).sample(np.random.default_rng(3), 8)
    out, stats = tasks.solve(model, problems, kv_cache_dtype="int8")
    assert all(tasks.is_correct(p, ids) for p, ids in zip(problems, out, strict=True))
    c = model.config
    assert stats.kv_cache_dtype == "int8" and stats.cache == "paged"
    # K and V of every layer and slot of the pool: a byte per value, a float32 scale per
    # token and KV head.
    slots = stats.padded_batch * stats.cache_len
    assert stats.cache_bytes == (2 * c.num_hidden_layers * slots * c.num_key_value_heads
                                 * (c.head_dim + 4))
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    assert stats.weight_bytes == params


def test_memory_estimate_counts_quantized_kv_bytes(model):
    kw = dict(batch=2, max_len=64)
    f32 = memory.estimate_inference_memory(model.config, **kw)
    bf16 = memory.estimate_inference_memory(model.config, cache_dtype=jnp.bfloat16, **kw)
    int8 = memory.estimate_inference_memory(model.config, kv_cache_dtype="int8", **kw)
    fp8 = memory.estimate_inference_memory(model.config, kv_cache_dtype="fp8", **kw)
    values = 2 * 2 * 64 * 2 * 2 * 32  # K and V, batch, tokens, layers, kv heads, head_dim
    assert f32.kv_cache == 4 * values and bf16.kv_cache == 2 * values
    assert int8.kv_cache == fp8.kv_cache == values + 4 * values // 32
    # The same count as the cache's arrays.
    cache = PagedKVCache.create(num_layers=2, num_pages=2 * 64 // 16, page_size=16,
                                kv_heads=2, head_dim=32, quantize="int8",
                                block_tables=np.zeros((2, 4), np.int32))
    assert cache.nbytes == int8.kv_cache


@pytest.mark.parametrize("bad", ["int4", "bfloat16", jnp.int8])
def test_generate_rejects_an_unknown_kv_cache_dtype(model, bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be 'int8' or 'fp8' \(or None "
                                         r"for a float cache\), got kv_cache_dtype="):
        llama.generate(model, [[1, 2, 3]], 2, kv_cache_dtype=bad)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_refuses_an_unknown_kv_cache_dtype_first(capsys, no_model_load, command):
    result = run(capsys, command, "--checkpoint", str(train_tiny.TINY_DIR),
                 "--kv-cache-dtype", "int4")
    assert_one_line_error(result, "--kv-cache-dtype", "invalid choice: 'int4'",
                          prog=f"forge-jax {command}")


def test_generate_prints_the_weight_and_cache_bytes(capsys):
    stats = GenerationStats(batch=1, padded_batch=1, prompt_bucket=8, cache_len=16,
                            cache="paged", max_new_tokens=1, weight_bytes=1_250_000,
                            cache_bytes=66_000, kv_cache_dtype="int8")
    cli_generate.print_stats(stats, [[3]])
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("memory:"))
    assert line == ("memory:  weights 1.25 MB, KV cache 0.07 MB (paged, int8, scales "
                    "included; measured from the arrays)")


def test_info_states_the_quantized_kv_bytes(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0
    line = next(s for s in out.splitlines() if "--kv-cache-dtype" in s)
    assert "0.53x at head_dim 64" in line and "float32 scale per token and KV head" in line


def test_chat_session_keeps_an_int8_cache(chat_model, chat_tokenizer):
    from forge_jax.text import api as text
    from forge_jax.text.chat_session import ChatSession

    with pytest.raises(ValueError, match="kv_cache_dtype must be 'int8' or 'fp8'"):
        ChatSession(chat_model, chat_tokenizer, kv_cache_dtype="int4")
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=4, kv_cache_dtype="int8")
    reply = session.send("Hello there")
    # The session's chunked prefill over its kept cache and generate's over a fresh one
    # read the same quantized keys and values.
    assert reply == text.chat(chat_model, chat_tokenizer, [{"role": "user", "content":
                                                            "Hello there"}],
                              max_new_tokens=4, kv_cache_dtype="int8")
    assert session.kv_cache_dtype == "int8" and session.last_turn.new_tokens == 4
