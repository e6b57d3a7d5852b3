"""The serving engine (forge_jax.serving.engine) without HTTP: greedy outputs equal
``llama.generate``'s under chunked prefill, preemption and the prefix cache; compiled
variants stay few; refusals, cancellation and stop strings."""

from __future__ import annotations

import threading

import pytest
from cases import serving as cases

from forge_jax.generation import SamplingParams
from forge_jax.kv_cache import CacheSpec
from forge_jax.serving import batch_step as serving_step
from forge_jax.serving import engine as serving

TEXTS = ["Hello there! How", "The quick brown fox jumps over the lazy dog. The quick",
         "Numbers 0123", "user assistant system: tell me a story about a small robot who",
         "Caf\u00e9 cr\u00e8me", "I am fine, thank you. Hello there! How are you today?"]


def _run(engine, prompts, params):
    streams = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
    while engine.has_work():
        engine.step()
    return [s.result() for s in streams]


@pytest.fixture(scope="module")
def prompts(chat_tokenizer):
    return [chat_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(chat_model, chat_tokenizer, prompts):
    return cases.greedy(chat_model, chat_tokenizer, prompts, 24)


def test_greedy_equals_generate_with_chunked_prefill(chat_model, chat_tokenizer, prompts,
                                                     reference):
    # 16 tokens per step: the longer prompts are prefilled in chunks beside decodes. A
    # 512-token context is 64 pages of 8, but these requests need fewer than 16 each: the
    # block tables are 16 pages wide (the same variants as a 128-token context).
    engine = cases.engine(chat_model, chat_tokenizer, max_batch_tokens=16, max_model_len=512)
    assert max(len(p) for p in prompts) > 16 and engine.pages_per_seq == 64
    before = serving_step.ragged_step._cache_size()
    results = _run(engine, prompts, [serving.RequestParams(max_tokens=24)] * len(prompts))
    for (ids, text, reason), want in zip(results, reference, strict=True):
        assert ids == want
        assert reason == ("stop" if want[-1] in engine.eos else "length")
        assert text == cases.reply_text(chat_tokenizer, want, engine.eos)
    # Row buckets 8 and 16, greedy: at most two compiled variants for all of that traffic.
    assert {k[0] for k in engine.stats.compiled} <= {8, 16}
    assert {k[1][1] for k in engine.stats.compiled} == {serving.MIN_TABLE_PAGES}
    assert serving_step.ragged_step._cache_size() - before <= len(engine.stats.compiled) <= 2
    usage = engine.manager.usage()
    assert usage.num_sequences == 0 and usage.used_pages == len(engine.prefix_cache)


def test_preemption_with_a_small_pool_keeps_greedy_outputs(chat_model, chat_tokenizer,
                                                           prompts):
    # Twelve requests of 30-100 tokens need more than the pool's 64 pages of 8 at once.
    long = [p * 2 for p in prompts] + [p * 3 for p in prompts]
    want = cases.greedy(chat_model, chat_tokenizer, long, 24)
    engine = cases.engine(chat_model, chat_tokenizer)
    results = _run(engine, long, [serving.RequestParams(max_tokens=24)] * len(long))
    assert [ids for ids, _, _ in results] == want
    assert engine.stats.preemptions > 0
    assert engine.prefix_cache.stats.evicted_pages > 0  # cached pages went first
    assert engine.manager.usage().num_sequences == 0


def test_prefix_cache_prefills_a_shared_prefix_once(chat_model, chat_tokenizer, reference):
    system = chat_tokenizer.encode(TEXTS[3] + " " + TEXTS[1])  # several full pages
    prompts = [system + chat_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:3]]
    want = cases.greedy(chat_model, chat_tokenizer, prompts, 8)
    engine = cases.engine(chat_model, chat_tokenizer)
    first = _run(engine, prompts[:1], [serving.RequestParams(max_tokens=8)])
    rest = _run(engine, prompts[1:], [serving.RequestParams(max_tokens=8)] * 2)
    assert [ids for ids, _, _ in first + rest] == want
    stats = engine.prefix_cache.stats
    shared_pages = len(system) // engine.page_size
    assert stats.reused_pages >= 2 * shared_pages and stats.hit_tokens >= 2 * shared_pages * 8
    # What the cache keeps is reclaimable: no request holds it, evict gives it all back.
    cached = len(engine.prefix_cache)
    assert engine.prefix_cache.reclaimable() == cached > 0
    assert engine.manager.usage().used_pages == cached
    assert engine.prefix_cache.evict(engine.manager.num_pages) == cached
    assert engine.manager.usage().free_pages == engine.manager.num_pages


def test_a_burst_sharing_a_prefix_prefills_it_once(chat_model, chat_tokenizer):
    # Submitted together: the second and third wait for the first to compute the shared
    # pages (32 tokens per step, so that takes two steps) and then reuse all of them.
    system = chat_tokenizer.encode(TEXTS[3] + " " + TEXTS[1])
    prompts = [system + chat_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:3]]
    want = cases.greedy(chat_model, chat_tokenizer, prompts, 8)
    engine = cases.engine(chat_model, chat_tokenizer)
    shared = len(system) // engine.page_size
    assert shared * engine.page_size > engine.max_batch_tokens
    results = _run(engine, prompts, [serving.RequestParams(max_tokens=8)] * 3)
    assert [ids for ids, _, _ in results] == want
    assert engine.prefix_cache.stats.reused_pages == 2 * shared
    assert engine.stats.prompt_tokens == sum(map(len, prompts)) - 2 * shared * engine.page_size
    phases = engine.stats.phase_seconds
    assert set(phases) == set(serving.PHASES) and phases["device"] > 0


def test_a_burst_shares_the_prefix_pages_its_first_step_computes(chat_model, chat_tokenizer):
    # The first request's rows write the shared pages and the others' rows read them in the
    # same step (each layer writes the step's keys before it attends): one step admits all
    # three, and the shared prefix is computed once.
    system = chat_tokenizer.encode(TEXTS[3])
    tails = [chat_tokenizer.encode(t, add_special_tokens=False) for t in ("Hi", "Ok then", "No")]
    prompts = [system + t for t in tails]
    want = cases.greedy(chat_model, chat_tokenizer, prompts, 8)
    engine = cases.engine(chat_model, chat_tokenizer, max_batch_tokens=64)
    shared = len(system) // engine.page_size
    rest = [len(p) - shared * engine.page_size for p in prompts]
    assert shared >= 2 and len(prompts[0]) + sum(rest[1:]) <= engine.max_batch_tokens
    streams = [engine.submit(p, serving.RequestParams(max_tokens=8)) for p in prompts]
    engine.step()
    assert [r.computed for r in engine._running] == [len(p) for p in prompts]
    assert engine.stats.prompt_tokens == len(prompts[0]) + sum(rest[1:])
    assert engine.prefix_cache.stats.reused_pages == 2 * shared
    while engine.has_work():
        engine.step()
    assert [s.result()[0] for s in streams] == want


def test_a_lone_request_decodes_in_one_row_steps(chat_model, chat_tokenizer, prompts,
                                                 reference):
    engine = cases.engine(chat_model, chat_tokenizer, min_batch_tokens=1)
    [(ids, _, _)] = _run(engine, prompts[:1], [serving.RequestParams(max_tokens=24)])
    assert ids == reference[0]
    assert {k[0] for k in engine.stats.compiled} == {1, 8}  # the prompt, then its decodes


def test_row_buckets_are_powers_of_two_and_three_quarters_of_them_from_192():
    bucket = serving_step.row_bucket
    assert [bucket(n, 1) for n in (1, 3, 9, 100, 128)] == [1, 4, 16, 128, 128]
    assert [bucket(n, 1) for n in (129, 145, 192, 193, 300, 385)] == [192, 192, 192, 256, 384,
                                                                     512]
    assert bucket(150, 256) == 256 and bucket(3, 8) == 8  # never under the smallest bucket


def test_page_keys_extend_the_keys_they_are_given():
    from forge_jax.serving.prefix_cache import page_keys

    tokens = list(range(100, 140))
    whole = page_keys(tokens, 8, 5)
    assert page_keys(tokens, 8, 5, whole[:2]) == whole and len(set(whole)) == 5
    changed = page_keys(tokens[:8] + [7] + tokens[9:], 8, 5)  # page 1 differs, so all after
    assert changed[0] == whole[0] and not set(changed[1:]) & set(whole)


def test_per_request_sampling_is_seeded_and_mixes_with_greedy(chat_model, chat_tokenizer,
                                                              prompts, reference):
    # 8 tokens per step: one row bucket, so the sampling step compiles once.
    engine = cases.engine(chat_model, chat_tokenizer, max_batch_tokens=8)
    sampled = serving.RequestParams(
        max_tokens=12, sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95,
                                               min_p=0.01, repetition_penalty=1.2),
        seed=7, ignore_eos=True)
    greedy = serving.RequestParams(max_tokens=24)
    a = _run(engine, [prompts[2], prompts[0]], [sampled, greedy])
    b = _run(engine, [prompts[2], prompts[0]], [sampled, serving.RequestParams(
        max_tokens=12, seed=1, sampling=SamplingParams(temperature=1.5), ignore_eos=True)])
    assert a[0][0] == b[0][0] and len(a[0][0]) == 12  # the same seed, the same tokens
    assert a[1][0] == reference[0]  # a greedy row beside sampled ones is still greedy
    assert {k[0] for k in engine.stats.compiled} == {8}


def test_stop_strings_and_stop_ids(chat_model, chat_tokenizer, prompts, reference):
    engine = cases.engine(chat_model, chat_tokenizer)
    full = cases.reply_text(chat_tokenizer, reference[0], engine.eos)
    stop = full[5:8]
    [(ids, text, reason)] = _run(engine, prompts[:1], [serving.RequestParams(
        max_tokens=24, stop=(stop,))])
    assert reason == "stop" and text == full[:full.find(stop)]
    [(ids, text, reason)] = _run(engine, prompts[:1], [serving.RequestParams(
        max_tokens=24, stop_token_ids=(reference[0][3],))])
    assert reason == "stop" and ids == reference[0][:reference[0].index(reference[0][3]) + 1]


def test_refusals_name_the_numbers(chat_model, chat_tokenizer):
    engine = cases.engine(chat_model, chat_tokenizer, num_pages=4, max_model_len=64)
    with pytest.raises(serving.RequestRefused, match=r"60 tokens and max_tokens is 8: 68 "
                                                     r"tokens, more than the context of 64"):
        engine.submit([5] * 60, serving.RequestParams(max_tokens=8))
    with pytest.raises(serving.RequestRefused, match=r"needs 5 pages of 8 tokens, the pool "
                                                     r"has 4"):
        engine.submit([5] * 30, serving.RequestParams(max_tokens=8))
    with pytest.raises(serving.RequestRefused, match="outside the vocabulary"):
        engine.submit([10**6], serving.RequestParams())
    with pytest.raises(ValueError, match="top_p"):
        serving.RequestParams(sampling=SamplingParams(top_p=1.5))
    with pytest.raises(TypeError, match="sampling must be a forge_jax.generation"):
        serving.RequestParams(sampling=dict(top_p=0.5))
    engine.max_waiting = 0
    with pytest.raises(serving.QueueFull, match="max_waiting=0"):
        engine.submit([5], serving.RequestParams())


def test_cancel_from_another_thread_frees_the_pages(chat_model, chat_tokenizer, prompts):
    engine = cases.engine(chat_model, chat_tokenizer, prefix_caching=False).start()
    try:
        stream = engine.submit(prompts[3], serving.RequestParams(max_tokens=100,
                                                                 ignore_eos=True))
        events = iter(stream)
        first = next(events)
        threading.Thread(target=stream.cancel).start()
        rest = list(events)
        assert first.finish_reason is None and rest[-1].finish_reason == "cancelled"
        assert sum(len(o.token_ids) for o in [first, *rest]) < 100
        gauges = cases.wait_idle(engine)
        assert gauges["pages_used"] == 0 and gauges["running"] == 0
    finally:
        assert engine.shutdown() == {"finished": 0, "cancelled": 0}


def test_a_sharded_model_serves_the_same_tokens():
    from forge_jax import sharding
    from forge_jax.models import TINY_DIR, llama
    from forge_jax.text import api as text

    tokenizer = text.load_tokenizer(TINY_DIR)
    prompts = [tokenizer.encode(p) for p in ["99+1=", "505+816=", "123+459="]]
    want = llama.generate(llama.from_pretrained(TINY_DIR), prompts, 6, eos_token_id=())
    model = llama.from_pretrained(TINY_DIR, mesh=sharding.make_mesh("tp=2"))
    engine = serving.Engine(model, tokenizer, serving.EngineConfig(
        max_batch_tokens=32, min_batch_tokens=8, num_pages=32, eos_token_ids=(),
        cache=CacheSpec(page_size=8)))
    assert engine.cache.k_pages[0].sharding.spec[0] == "tp"  # the pool split by KV head
    results = _run(engine, prompts, [serving.RequestParams(max_tokens=6)] * 3)
    assert [ids for ids, _, _ in results] == want
    assert engine.cache.k_pages[0].sharding.spec[0] == "tp"


def test_an_int8_model_serves_its_own_greedy_tokens(chat_checkpoint, chat_tokenizer, prompts):
    from forge_jax.models import llama

    model = llama.from_pretrained(chat_checkpoint, quantize="int8")
    want = cases.greedy(model, chat_tokenizer, prompts[:3], 12)
    engine = cases.engine(model, chat_tokenizer)
    results = _run(engine, prompts[:3], [serving.RequestParams(max_tokens=12)] * 3)
    assert [ids for ids, _, _ in results] == want


def test_a_bfloat16_model_serves_its_own_greedy_tokens(chat_checkpoint, chat_tokenizer,
                                                       prompts):
    # bfloat16 weights, products and pages: the engine's tokens are generate's of the same
    # bfloat16 model.
    import jax.numpy as jnp

    from forge_jax.models import llama

    model = llama.from_pretrained(chat_checkpoint, dtype=jnp.bfloat16)
    want = cases.greedy(model, chat_tokenizer, prompts[:4], 12)
    engine = cases.engine(model, chat_tokenizer)
    assert engine.cache.k_pages[0].dtype == jnp.bfloat16
    results = _run(engine, prompts[:4], [serving.RequestParams(max_tokens=12)] * 4)
    assert [ids for ids, _, _ in results] == want


def test_shutdown_counts_the_requests_it_finished_and_cancelled(chat_model, chat_tokenizer,
                                                                prompts):
    params = serving.RequestParams(max_tokens=40, ignore_eos=True)
    engine = cases.engine(chat_model, chat_tokenizer, prefix_caching=False).start()
    streams = [engine.submit(p, params) for p in prompts[:2]]
    assert engine.shutdown(wait=120) == {"finished": 2, "cancelled": 0}
    assert [s.result()[2] for s in streams] == ["length"] * 2
    engine = cases.engine(chat_model, chat_tokenizer, prefix_caching=False).start()
    streams = [engine.submit(p, params) for p in prompts[:3]]
    assert engine.shutdown() == {"finished": 0, "cancelled": 3}
    assert [s.result()[2] for s in streams] == ["cancelled"] * 3
    assert engine.manager.usage().used_pages == 0


def test_a_failed_step_ends_its_requests_with_error(monkeypatch, chat_model, chat_tokenizer,
                                                    prompts, reference):
    engine = cases.engine(chat_model, chat_tokenizer).start()
    try:
        def boom(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(serving_step, "ragged_step", boom)
        [*_, last] = engine.submit(prompts[0], serving.RequestParams(max_tokens=24))
        assert last.finish_reason == "error" and "RuntimeError: boom" in last.error
        assert engine.manager.usage().num_sequences == 0  # its pages went back
        monkeypatch.undo()
        ids, _, _ = engine.submit(prompts[0], serving.RequestParams(max_tokens=24)).result()
        assert ids == reference[0]  # and the engine goes on
    finally:
        engine.shutdown()


def _drive(engine, plan: dict) -> list:
    """Steps ``engine`` by hand (no thread): at step k, ``plan[k]``'s actions, each
    ``(prompt, params)`` to submit or the index of a stream to cancel."""
    streams, k = [], 0
    while k <= max(plan) or engine.has_work():
        for action in plan.get(k, ()):
            if isinstance(action, int):
                streams[action].cancel()
            else:
                streams.append(engine.submit(*action))
        engine.step()
        k += 1
    return [s.result() for s in streams]


def test_overlapped_steps_give_the_tokens_of_unoverlapped_ones(chat_model, chat_tokenizer,
                                                               prompts, reference):
    # Arrivals while others decode or prefill in chunks, a stop id (the overlapped engine has
    # already dispatched a row for that request when it reads the stop), a seeded sampler
    # (its key folds in the index of the token being drawn), an argmax under a strong
    # repetition penalty just before the model would repeat its last token (a token fed
    # from the device counts as seen), and cancellations mid-prefill and mid-decode.
    greedy = serving.RequestParams(max_tokens=24)
    sampled = serving.RequestParams(
        max_tokens=16, sampling=SamplingParams(temperature=0.9, top_k=40,
                                               repetition_penalty=1.3),
        seed=3, ignore_eos=True)
    stop_id = reference[2][2]
    k, j = next((k, j) for k, r in enumerate(reference) for j in range(len(r) - 1)
                if r[j] == r[j + 1])
    repeat = prompts[k] + reference[k][:j]
    assert reference[k][j] not in repeat
    plan = {0: [(prompts[0], greedy), (prompts[1], sampled),
                (prompts[2], serving.RequestParams(max_tokens=24, stop_token_ids=(stop_id,)))],
            2: [(prompts[3], greedy), (prompts[4], greedy)],
            1: [(repeat, serving.RequestParams(
                max_tokens=3, sampling=SamplingParams(repetition_penalty=1e3)))],
            3: [4], 6: [(prompts[5], serving.RequestParams(max_tokens=8))], 9: [5]}
    sync = cases.engine(chat_model, chat_tokenizer, overlap=False)
    want = _drive(sync, plan)
    before = serving_step.ragged_step._cache_size()
    engine = cases.engine(chat_model, chat_tokenizer)
    assert engine.overlap
    got = _drive(engine, plan)
    for results in (want, got):
        (a, _, ra), (b, _, rb), (c, _, rc), (g, _, _), (d, _, rd), (e, _, re), (f, _, rf) = \
            results
        assert (a, ra) == (reference[0], "stop" if reference[0][-1] in sync.eos else "length")
        assert len(b) == 16 and rb == "length"
        assert c == reference[2][:reference[2].index(stop_id) + 1] and rc == "stop"
        assert rd == re == "cancelled" and d == reference[3][:len(d)]
        assert len(e) < len(reference[4]) and e == reference[4][:len(e)]
        assert f == reference[5][:8] and rf in ("stop", "length")
        assert g[0] == reference[k][j] != g[1]  # penalized: not repeated
    assert [r for i, r in enumerate(got) if i not in (4, 5)] == [
        r for i, r in enumerate(want) if i not in (4, 5)]  # the sampled ones too
    # Feeding tokens from the device compiles no variant of its own.
    assert serving_step.ragged_step._cache_size() - before <= len(
        engine.stats.compiled - sync.stats.compiled)
    for e in (sync, engine):
        usage = e.manager.usage()
        assert usage.num_sequences == 0 and usage.used_pages == len(e.prefix_cache)
