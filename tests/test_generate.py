"""Generation: the cached forward, generate() with both caches, sampling, compilation reuse,
and the memory check. A random-weight model, no torch needed (transformers' greedy parity
is in test_llama.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import forge_jax as fj
from forge_jax import memory
from forge_jax.generation import sampling
from forge_jax.kv_cache import ContiguousKVCache, PagedKVCache
from forge_jax.models import llama

LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
CONFIG = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           rope_scaling=fj.RopeScaling("linear", 2.0))
PROMPTS = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [70, 7, 64]]


def _random_model(config=CONFIG, seed=0) -> llama.Llama:
    """Weights large enough that the logits are far from uniform (no near-ties in argmax)."""
    model = llama.Llama(config, rngs=nnx.Rngs(seed))
    gen = np.random.default_rng(seed)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param):
            shape = param[...].shape
            if path[-2:-1] and str(path[-2]).endswith("norm"):
                value = gen.uniform(0.5, 1.5, shape)
            elif path[-1] == "kernel":  # kernels are [out, in]; drawn [in, out] as before
                value = gen.normal(0.0, 0.25, shape[::-1]).T
            else:
                value = gen.normal(0.0, 0.25 if len(shape) > 1 else 0.1, shape)
            param.set_value(jnp.asarray(value, jnp.float32))
    return model


@pytest.fixture(scope="module")
def model():
    return _random_model()


@functools.partial(jax.jit, static_argnames="graphdef")
def _full_logits(state, tokens, *, graphdef):
    return nnx.merge(graphdef, state)(tokens)


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _cached_logits(state, cache, tokens, positions, valid, *, graphdef):
    return nnx.merge(graphdef, state).forward_cached(tokens, positions, valid, cache)


def _make_cache(kind, batch, max_len, page_size=4):
    kw = dict(num_layers=CONFIG.num_hidden_layers, kv_heads=CONFIG.num_key_value_heads,
              head_dim=CONFIG.head_dim, dtype=jnp.float32)
    if kind == "contiguous":
        return ContiguousKVCache.create(batch=batch, max_len=max_len, **kw)
    pages = max_len // page_size
    # Sequence b owns pages b, b + batch, b + 2 batch, ...: interleaved, not contiguous.
    tables = np.arange(batch * pages, dtype=np.int32).reshape(pages, batch).T
    return PagedKVCache.create(num_pages=batch * pages, page_size=page_size,
                               block_tables=tables, **kw)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_cached_forward_matches_full_forward(model, kind):
    """Ragged prefill (right padding), then single-token steps: every logit equals the
    no-cache forward's at the same position."""
    gen = np.random.default_rng(1)
    lengths = np.array([5, 9])
    total = 12
    seqs = gen.integers(0, CONFIG.vocab_size, (2, total)).astype(np.int32)
    graphdef, state = nnx.split(model)
    full = np.asarray(_full_logits(state, jnp.asarray(seqs), graphdef=graphdef))

    cache = _make_cache(kind, batch=2, max_len=16)
    t = 10  # prefill width, padded
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
    valid = positions < lengths[:, None]
    tokens = np.where(valid, seqs[:, :t], 0).astype(np.int32)
    logits, cache = _cached_logits(state, cache, jnp.asarray(tokens), jnp.asarray(positions),
                                   jnp.asarray(valid), graphdef=graphdef)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits)[b, :n], full[b, :n], **LOGITS_TOL.as_kwargs())
    # Decode: sequence b continues from position lengths[b], one token at a time.
    pos = lengths.copy()
    while pos.min() < total:
        active = pos < total
        step_tokens = seqs[np.arange(2), np.minimum(pos, total - 1)][:, None]
        logits, cache = _cached_logits(
            state, cache, jnp.asarray(step_tokens), jnp.asarray(pos[:, None].astype(np.int32)),
            jnp.asarray(active[:, None]), graphdef=graphdef)
        for b in np.flatnonzero(active):
            np.testing.assert_allclose(np.asarray(logits)[b, 0], full[b, pos[b]],
                                       **LOGITS_TOL.as_kwargs())
        pos = pos + active
    np.testing.assert_array_equal(np.asarray(cache.lengths), [total, total])


def test_paged_and_contiguous_give_identical_greedy_tokens(model):
    contiguous = llama.generate(model, PROMPTS, 8, cache="contiguous")
    assert llama.generate(model, PROMPTS, 8, cache="paged") == contiguous
    assert llama.generate(model, PROMPTS, 8, cache="paged", page_size=4) == contiguous
    assert [len(r) for r in contiguous] == [8, 8, 8]
    assert len({tuple(r) for r in contiguous}) == 3


def test_batch_rows_do_not_interact(model):
    """Each prompt alone (batch 1) gives what it gives inside a padded batch of 3."""
    batched = llama.generate(model, PROMPTS, 8)
    assert [llama.generate(model, [p], 8)[0] for p in PROMPTS] == batched


@contextlib.contextmanager
def _count_traces():
    events = []
    listener = lambda name, duration, **kw: events.append(name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_second_call_does_not_recompile():
    # A config no other test uses, so that the first call must compile.
    model = _random_model(dataclasses.replace(CONFIG, rms_norm_eps=1e-5))
    with _count_traces() as first:
        llama.generate(model, PROMPTS, 8)
    assert "/jax/core/compile/jaxpr_trace_duration" in first  # the counter works
    with _count_traces() as events:
        llama.generate(model, PROMPTS, 8)
        # Other prompt lengths and a count in the same buckets reuse the steps too.
        llama.generate(model, [[1, 2], [3] * 14, [4] * 7], 6)
        tokens, stats = llama.generate_with_stats(model, PROMPTS, 8)
    assert not [e for e in events if e.startswith("/jax/core/compile")], events
    assert stats.compile_seconds < 1.0
    # Ops choose their implementation at trace time: another preference compiles anew.
    with _count_traces() as events, fj.use_implementation("xla"):
        assert llama.generate(model, PROMPTS, 8) == tokens
    assert "/jax/core/compile/jaxpr_trace_duration" in events


_COMPILES_TWICE = """
import jax
from flax import nnx
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(name)
    if name.endswith("backend_compile_duration") else None)
from forge_jax.models import llama
config = llama.LlamaConfig.from_hf(dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
    rms_norm_eps=1e-5, vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128))
model = llama.Llama(config, rngs=nnx.Rngs(0))
first = llama.generate(model, [[5, 6, 7]], 4, eos_token_id=())
compiled = len(compiles)
second = llama.generate(model, [[5, 6, 7]], 4, eos_token_id=())
assert first == second
print(compiled, len(compiles) - compiled)
"""


def test_second_generate_of_a_fresh_process_compiles_nothing():
    # The first dispatch imports the Pallas kernels inside the first traced function; an
    # import there that adds a config to JAX's jit key (Pallas' fuser, JAX 0.11 and 0.12)
    # made the second call compile every step again. A fresh process: in this one the
    # kernels were imported long ago.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILES_TWICE], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = map(int, done.stdout.split()[-2:])
    assert first > 0 and second == 0, (first, second)


def test_eos_stops_a_sequence_and_is_included(model):
    free = llama.generate(model, PROMPTS, 8)
    # A token that first appears after the start of some row, so that one sequence stops
    # mid-way (whatever the random weights generate).
    eos, stop = next((t, i) for row in free for i, t in enumerate(row)
                     if 0 < i < len(row) - 1 and t not in row[:i])
    expected = [row[:row.index(eos) + 1] if eos in row else row for row in free]
    assert any(len(row) == stop + 1 < 8 for row in expected)
    assert llama.generate(model, PROMPTS, 8, eos_token_id=eos) == expected
    assert llama.generate(model, PROMPTS, 8, eos_token_id=[free[0][0], free[1][0], free[2][0]]
                          ) == [[row[0]] for row in free]
    _, stats = llama.generate_with_stats(
        model, PROMPTS, 8, eos_token_id=(free[0][0], free[1][0], free[2][0]))
    assert stats.decode_steps == 0 and stats.new_tokens == 3  # all stopped at the prefill


def test_stats_and_progress(model):
    calls = []
    tokens, stats = llama.generate_with_stats(model, PROMPTS, 8,
                                              progress=lambda d, t: calls.append((d, t)))
    assert calls == [(i, 8) for i in range(1, 9)]
    assert stats.batch == 3 and stats.padded_batch == 4 and stats.prompt_bucket == 16
    assert stats.prompt_tokens == sum(map(len, PROMPTS)) and stats.new_tokens == 24
    assert stats.decode_steps == 7 and stats.decode_tokens == 21
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert stats.decode_ms_per_step > 0


def test_sampling_is_seeded_and_filters_reduce_to_greedy(model):
    greedy = llama.generate(model, PROMPTS, 6)
    assert llama.generate(model, PROMPTS, 6, temperature=1.0, top_k=1, seed=3) == greedy
    assert llama.generate(model, PROMPTS, 6, temperature=1.0, top_p=1e-6, seed=3) == greedy
    hot = dict(temperature=5.0, top_k=40, top_p=0.95)
    a = llama.generate(model, PROMPTS, 6, seed=1, **hot)
    assert llama.generate(model, PROMPTS, 6, seed=1, **hot) == a
    assert llama.generate(model, PROMPTS, 6, seed=2, **hot) != a
    assert llama.generate(model, PROMPTS, 6, seed=1, cache="contiguous", **hot) == a
    with _count_traces() as events:  # another temperature / top_p reuses the compiled steps
        llama.generate(model, PROMPTS, 6, seed=1, **(hot | dict(temperature=0.5, top_p=0.7)))
    assert not [e for e in events if e.startswith("/jax/core/compile")], events


def _filter_reference(logits, temperature, top_k, top_p):
    """HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper in float64 NumPy."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k is not None:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None:
        order = np.argsort(x, axis=-1, kind="stable")
        s = np.take_along_axis(x, order, axis=-1)
        p = np.exp(s - s.max(-1, keepdims=True))
        cum = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        mask = np.zeros_like(drop)
        np.put_along_axis(mask, order, drop, axis=-1)
        x = np.where(mask, -np.inf, x)
    return x


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 5, None), (0.7, None, 0.9), (1.3, 20, 0.5), (1.0, None, 1.0), (2.0, 1, 0.3)])
def test_filter_logits_matches_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(4).normal(0, 3, (6, 50)).astype(np.float32)
    got = np.asarray(sampling.filter_logits(jnp.asarray(logits), temperature=temperature,
                                            top_k=top_k, top_p=top_p))
    ref = _filter_reference(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    kept = np.isfinite(ref)
    np.testing.assert_allclose(got[kept], ref[kept], rtol=1e-6)
    assert kept.sum(-1).min() >= 1


def test_filter_logits_matches_transformers():
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    torch = pytest.importorskip("torch", reason="needs torch")
    logits = np.random.default_rng(5).normal(0, 2, (4, 64)).astype(np.float32)
    scores = torch.tensor(logits)
    for warper in (transformers.TemperatureLogitsWarper(0.8), transformers.TopKLogitsWarper(10),
                   transformers.TopPLogitsWarper(0.8)):
        scores = warper(None, scores)
    got = np.asarray(sampling.filter_logits(jnp.asarray(logits), temperature=0.8, top_k=10,
                                            top_p=0.8))
    # Traced temperature and top_p give the same filter.
    traced = jax.jit(lambda x, t, p: sampling.filter_logits(x, temperature=t, top_k=10, top_p=p))
    np.testing.assert_array_equal(np.asarray(traced(jnp.asarray(logits), 0.8, 0.8)), got)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(scores.numpy()))


def test_sample_follows_the_filtered_distribution():
    logits = jnp.tile(jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0]]), (20000, 1))
    draws = np.asarray(sampling.sample(logits, jax.random.key(0), temperature=0.7, top_k=3))
    freq = np.bincount(draws, minlength=5) / draws.size
    p = np.exp(np.array([2.0, 1.0, 0.5]) / 0.7)
    np.testing.assert_allclose(freq, np.concatenate([p / p.sum(), [0, 0]]), atol=0.015)
    assert np.asarray(sampling.sample(logits[:2], jax.random.key(0))).tolist() == [0, 0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[[]]), r"prompts\[0\]"),
    (dict(prompts=[[1], [96]]), r"prompts\[1\].*\[0, 96\)"),
    (dict(prompts=[[-1]]), "outside"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(cache="ring"), "kind='ring'"),
    (dict(page_size=0), "page_size"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), r"temperature.*got nan"),
    (dict(temperature=float("inf")), r"temperature.*got inf"),
    (dict(temperature=1e39), r"temperature.*float32.*got 1e\+39"),  # inf in float32
    (dict(seed=2**63), r"seed=9223372036854775808"),
    (dict(seed=1.5), r"seed=1\.5"),
    (dict(prompts=np.ones((2, 3), np.float32)), r"prompts\.dtype=float32"),
    (dict(prompts=jnp.ones((2, 3), bool)), r"prompts\.dtype=bool"),
    (dict(prompts=np.arange(3)), r"\[batch, seq\].*prompts\.shape=\(3,\).*prompts\[None\]"),
    (dict(prompts=jnp.zeros((1, 2, 3), jnp.int32)), r"prompts\.shape=\(1, 2, 3\)"),
    (dict(prompts=np.zeros((2, 0), np.int32)), r"non-empty.*prompts\.shape=\(2, 0\)"),
    (dict(prompts=np.array([[1, 96]], np.uint8)), r"outside \[0, 96\).*max 96"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
])
def test_generate_rejects_bad_arguments(model, kwargs, match):
    call = dict(prompts=PROMPTS, max_new_tokens=4) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        llama.generate(model, call.pop("prompts"), call.pop("max_new_tokens"), **call)


def test_zero_new_tokens(model):
    assert llama.generate(model, PROMPTS, 0) == [[], [], []]


def test_generate_checks_memory_before_allocating(model, monkeypatch):
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: (1 << 20, "test device"))
    with pytest.raises(memory.InsufficientMemoryError,
                       match=r"needs \d+\.\d\d GiB, test device has 0\.00 GiB free"):
        llama.generate(model, PROMPTS, 100_000, allow_beyond_max_positions=True)


def test_check_fits():
    memory.check_fits(1024)
    with pytest.raises(memory.InsufficientMemoryError, match=r"needs .* GiB, .* GiB free") as e:
        memory.check_fits(1 << 62, what="a test buffer")
    assert e.value.required == 1 << 62 and e.value.available < 1 << 62
    free, where = memory.device_free_bytes()
    assert free is not None and free > 0 and "CPU" in where


@pytest.mark.parametrize("overrides", [
    {}, dict(tie_word_embeddings=True), dict(attention_bias=True, mlp_bias=True, head_dim=32)])
def test_estimate_counts_the_weights_exactly(overrides):
    config = dataclasses.replace(CONFIG, **overrides)
    model = nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    est = memory.estimate_inference_memory(config, batch=3, max_len=40)
    assert est.weights == 4 * params
    assert est.kv_cache == 2 * 2 * 3 * 40 * config.num_key_value_heads * config.head_dim * 4
    assert est.activations > 0 and est.total == est.weights + est.kv_cache + est.activations
    half = memory.estimate_inference_memory(dataclasses.asdict(config), batch=3, max_len=40,
                                            param_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert half.weights * 2 == est.weights and half.kv_cache * 2 == est.kv_cache


def test_steps_donate_the_cache(model):
    graphdef, state = nnx.split(model)
    cache = _make_cache("paged", batch=4, max_len=16)
    tokens = jnp.ones((4, 8), jnp.int32)
    params = sampling.SamplingParams().arrays()
    seen = jnp.zeros((4, CONFIG.vocab_size), bool)
    greedy = sampling.SamplingParams().greedy
    first, seen, new = llama.prefill_step(state, cache, tokens, jnp.full((4,), 8, jnp.int32),
                                          jax.random.key(0), params, seen, graphdef=graphdef,
                                          greedy=greedy)
    assert cache.k_pages[0].is_deleted() and not new.k_pages[0].is_deleted()
    np.testing.assert_array_equal(np.asarray(seen).sum(-1), [1, 1, 1, 1])  # the new token
    _, _, newer = llama.decode_step(state, new, first, jnp.ones((4,), bool), jax.random.key(0),
                                    jnp.asarray(1, jnp.int32), params, seen, graphdef=graphdef,
                                    greedy=greedy)
    assert new.k_pages[0].is_deleted() and seen.is_deleted()  # the mask too, in place
    np.testing.assert_array_equal(np.asarray(newer.lengths), [9, 9, 9, 9])


@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_generate_takes_a_2d_int_array_of_prompts(model, kind):
    gen = np.random.default_rng()
    ids = gen.integers(0, CONFIG.vocab_size, (3, 7))
    dtype = np.uint8 if kind == "numpy" else np.int32  # a narrow dtype works too
    prompts = np.asarray(ids, dtype) if kind == "numpy" else jnp.asarray(ids, jnp.int32)
    expected = llama.generate(model, ids.tolist(), 5)
    assert llama.generate(model, prompts, 5) == expected
    tokens, stats = llama.generate_with_stats(model, prompts, 5)
    assert tokens == expected and stats.batch == 3 and stats.prompt_tokens == 21


SHORT = dataclasses.replace(CONFIG, max_position_embeddings=16)


def test_sequences_beyond_max_positions_are_refused_before_any_work(monkeypatch):
    model = _random_model(SHORT)
    gen = np.random.default_rng()
    prompts = [gen.integers(0, 96, 5).tolist(), gen.integers(0, 96, 12).tolist()]

    def no_work(*args, **kwargs):
        raise AssertionError("the memory check ran: the refusal came too late")

    with monkeypatch.context() as m:
        m.setattr(memory, "check_fits", no_work)
        # prompt + new tokens: 12 + 5 = 17 > 16
        with pytest.raises(ValueError, match=r"prompts\[1\] has 12 tokens; with "
                                             r"max_new_tokens=5 .* 17 positions.*"
                                             r"max_position_embeddings=16"):
            llama.generate(model, prompts, 5)
        with pytest.raises(ValueError, match=r"17 positions.*max_position_embeddings=16"):
            llama.generate_with_stats(model, np.asarray([prompts[1] + [3] * 5]), 0)
        with pytest.raises(ValueError, match=r"tokens\.shape=\(2, 17\) has 17 positions.*"
                                             r"max_position_embeddings=16"):
            model(jnp.asarray(gen.integers(0, 96, (2, 17)), jnp.int32))
    # Exactly at the limit runs; beyond it runs when asked to (e.g. for a RoPE scaling that
    # extends the range: SHORT has linear scaling 2.0).
    assert [len(r) for r in llama.generate(model, prompts, 4)] == [4, 4]
    assert [len(r) for r in llama.generate(model, prompts, 5,
                                           allow_beyond_max_positions=True)] == [5, 5]
    logits = model(jnp.asarray(gen.integers(0, 96, (1, 17)), jnp.int32),
                   allow_beyond_max_positions=True)
    assert logits.shape == (1, 17, 96) and np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-50, 5e-324])
def test_a_temperature_below_float32_normals_is_greedy(model, temperature):
    # float32 flushes or rounds these to 0 (or divides logits into +inf): before, the token
    # sampled was index 0 whatever the logits said.
    assert sampling.SamplingParams(temperature).greedy
    greedy = llama.generate(model, PROMPTS, 4)
    assert llama.generate(model, PROMPTS, 4, temperature=temperature, seed=7) == greedy


def test_a_tiny_normal_temperature_samples_the_largest_logit():
    # 1e-37 is a normal float32, but logits / 1e-37 overflow to +inf; sample() must still
    # pick the largest logit, never the first of the overflowing ones.
    gen = np.random.default_rng()
    logits = gen.uniform(20.0, 60.0, (16, 50)).astype(np.float32)
    want = logits.argmax(-1)
    for temperature in (1e-37, 1e-38, jnp.float32(1e-37)):
        got = sampling.sample(jnp.asarray(logits), jax.random.key(int(gen.integers(1 << 30))),
                              temperature=temperature)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert not sampling.SamplingParams(1e-37).greedy


def _min_p_reference(x, min_p):
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.where(p < min_p * p.max(-1, keepdims=True), -np.inf, x)


@pytest.mark.parametrize("vocab, temperature, top_k, top_p, min_p", [
    (50, 1.0, None, None, 0.1), (50, 0.8, 10, 0.9, 0.05),
    # More tokens than the candidates top-k / top-p look at first: the full sort decides.
    (700, 1.0, 300, None, None), (700, 1.0, None, 0.95, None), (700, 1.5, 400, 0.9, 0.01),
    (700, 1.0, 20, 0.99, None)])
def test_filters_with_traced_parameters_match_reference(vocab, temperature, top_k, top_p, min_p):
    gen = np.random.default_rng()
    logits = gen.normal(0, 1.0, (5, vocab)).astype(np.float32)
    ref = _filter_reference(logits, temperature, top_k, top_p)
    if min_p is not None:
        ref = _min_p_reference(ref, min_p)
    traced = jax.jit(lambda x, k, p, m: sampling.filter_logits(
        x, temperature=temperature, top_k=k, top_p=p, min_p=m))
    got = np.asarray(traced(jnp.asarray(logits), 0 if top_k is None else top_k,
                            1.0 if top_p is None else top_p, 0.0 if min_p is None else min_p))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    kept = np.isfinite(ref)
    np.testing.assert_allclose(got[kept], ref[kept], rtol=1e-6)
    assert kept.sum(-1).min() >= 1 and kept.sum(-1).max() < vocab


def test_min_p_and_repetition_penalty_match_transformers():
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    torch = pytest.importorskip("torch", reason="needs torch")
    gen = np.random.default_rng()
    logits = gen.normal(0, 2, (4, 64)).astype(np.float32)
    ids = gen.integers(0, 64, (4, 9))
    scores = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids),
                                                                torch.tensor(logits))
    seen = np.zeros((4, 64), bool)
    np.put_along_axis(seen, ids, True, axis=-1)
    penalised = sampling.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), 1.3)
    np.testing.assert_allclose(np.asarray(penalised), scores.numpy(), rtol=1e-6)
    assert not np.allclose(np.asarray(penalised), logits)
    scores = transformers.MinPLogitsWarper(0.2)(None, torch.tensor(logits))
    got = sampling.filter_logits(jnp.asarray(logits), temperature=1.0, min_p=jnp.float32(0.2))
    np.testing.assert_array_equal(np.isinf(np.asarray(got)), np.isinf(scores.numpy()))


def test_greedy_repetition_penalty_matches_a_step_by_step_reference(model):
    """Each new token is the argmax of the full forward's last logits after the penalty
    over every token so far (prompt included), as transformers' greedy search does."""
    penalty = 5.0
    prompt = np.random.default_rng().integers(0, CONFIG.vocab_size, 6).tolist()
    seq = list(prompt)
    graphdef, state = nnx.split(model)
    for _ in range(6):
        # One shape for every step (causal: the padding after the last token changes nothing).
        padded = jnp.asarray([seq + [0] * (12 - len(seq))], jnp.int32)
        logits = np.asarray(_full_logits(state, padded, graphdef=graphdef))[0, len(seq) - 1]
        logits = logits.astype(np.float64)
        for t in set(seq):
            logits[t] = logits[t] * penalty if logits[t] < 0 else logits[t] / penalty
        seq.append(int(np.argmax(logits)))
    got = llama.generate(model, [prompt], 6, repetition_penalty=penalty)[0]
    assert got == seq[len(prompt):]
    assert len(set(got)) == 6  # the penalty, strong here, keeps tokens from repeating


def test_sampling_parameters_are_traced_and_validated(model):
    hot = dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    first = llama.generate(model, PROMPTS, 4, seed=1, **hot)
    assert llama.generate(model, PROMPTS, 4, seed=1, **hot) == first
    with _count_traces() as events:  # other values reuse the compiled steps
        llama.generate(model, PROMPTS, 4, seed=1, **(hot | dict(top_k=3, min_p=0.3,
                                                                repetition_penalty=2.0)))
        llama.generate(model, PROMPTS, 4, seed=1, **(hot | dict(top_k=None, top_p=None)))
    assert not [e for e in events if e.startswith("/jax/core/compile")], events
    for bad, match in [(dict(min_p=1.5), r"min_p.*got 1\.5"), (dict(min_p=-0.1), "min_p"),
                       (dict(repetition_penalty=0.0), r"repetition_penalty.*got 0\.0"),
                       (dict(repetition_penalty=float("nan")), "repetition_penalty"),
                       (dict(top_k=True), r"top_k.*got True")]:
        with pytest.raises(ValueError, match=match):
            llama.generate(model, PROMPTS, 4, **bad)


def test_on_tokens_streams_every_step_in_order(model):
    calls = []
    tokens, stats = llama.generate_with_stats(model, PROMPTS, 6,
                                              on_tokens=lambda i, t: calls.append((i, t)))
    assert [i for i, _ in calls] == list(range(6))
    streamed = np.stack([t for _, t in calls], axis=1)
    assert streamed.tolist() == tokens


def test_warm_up_leaves_the_tokens_unchanged(model):
    """The warm-up prefill runs on no tokens: nothing is written, the same tokens follow."""
    expected = llama.generate(model, PROMPTS, 6, cache="contiguous")
    for cache in ("paged", "contiguous"):
        tokens, stats = llama.generate_with_stats(model, PROMPTS, 6, cache=cache, warm_up=True)
        assert tokens == expected and stats.prefill_seconds > 0
