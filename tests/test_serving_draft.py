"""A draft model in the serving engine: its drafts drawn on the device before each step
and verified in the same ragged step as the other requests' rows, its own page pool kept
in step with the target's (prefix-cached pages, refused drafts). Greedy output equals the
engine's without speculation for many concurrent requests."""

from __future__ import annotations

import pytest
from cases import serving as cases

from forge_jax.generation import SamplingParams, SpeculativeConfig
from forge_jax.serving import engine as serving

TEXTS = ["Hello there! How", "The quick brown fox jumps over the lazy dog. The quick brown",
         "Numbers 0123", "Caf\u00e9 cr\u00e8me", "I am fine, thank you."]
DRAFT_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    from cases.chat_checkpoint import write_checkpoint

    from forge_jax.models import llama

    return llama.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("draft"), seed=3,
                                                  sizes=DRAFT_SIZES))


def _prompts(tokenizer, n):
    return [tokenizer.encode(f"{i}: " + TEXTS[i % 5])[:8 + i % 5] for i in range(n)]


def _run(engine, prompts, max_tokens, **sampling):
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(seed=i, **sampling)))
        for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [s.result()[0] for s in streams]


def test_concurrent_greedy_requests_equal_the_output_without(chat_model, chat_tokenizer,
                                                             draft_model):
    prompts = _prompts(chat_tokenizer, 8) + [_prompts(chat_tokenizer, 1)[0]]  # one shared
    reference = _run(cases.engine(chat_model, chat_tokenizer), prompts, 12)
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(draft_model=draft_model, num_tokens=3))
    assert _run(engine, prompts, 12) == reference
    s = engine.stats
    assert engine.last_error is None and s.verified > 0
    assert 0 <= s.accepted_tokens < s.draft_tokens
    assert engine.manager.usage().used_pages == len(engine.prefix_cache)  # none leaked


def test_the_target_as_its_own_draft_keeps_every_draft(chat_model, chat_tokenizer):
    """The draft's pool holds what the target's does: drafting with the target itself, every
    greedy draft is kept, also for requests whose prefix came from the prefix cache."""
    prompts = _prompts(chat_tokenizer, 3)
    reference = _run(cases.engine(chat_model, chat_tokenizer), prompts, 10)
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(draft_model=chat_model, num_tokens=4))
    assert _run(engine, prompts, 10) == reference
    assert _run(engine, prompts, 10) == reference  # again, the prompts' pages cached
    s = engine.stats
    assert engine.prefix_cache.stats.hit_tokens > 0
    assert s.draft_tokens > 0 and s.accepted_tokens == s.draft_tokens
    from forge_jax.serving.metrics import Metrics

    text = Metrics(engine).render()  # /metrics, as for prompt lookup
    assert "forge_jax_spec_acceptance_rate 1.0" in text
    assert f"forge_jax_spec_draft_tokens_total {float(s.draft_tokens)}" in text
    # Sampled, p equals q up to rounding: nearly every draft is kept.
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(draft_model=chat_model, num_tokens=4))
    got = _run(engine, prompts, 10, temperature=0.9, top_p=0.95)
    assert [len(g) for g in got] == [10] * 3 and engine.last_error is None
    assert engine.stats.accepted_tokens > 0.9 * engine.stats.draft_tokens


def test_sampled_and_constrained_requests_beside_drafting_ones(chat_model, chat_tokenizer,
                                                                draft_model):
    prompts = _prompts(chat_tokenizer, 4)
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(draft_model=draft_model))
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=10, ignore_eos=True,
        sampling=SamplingParams(temperature=0.0 if i == 0 else 0.9, top_p=0.9, seed=i,
                                logprobs=1 if i == 3 else None)))
        for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    results = [s.result() for s in streams]
    assert [len(ids) for ids, _, _ in results] == [10] * 4
    assert engine.last_error is None and engine.stats.draft_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused(chat_model, chat_tokenizer):
    import dataclasses

    class Other:
        config = dataclasses.replace(chat_model.config, vocab_size=512)
        mesh = None

    with pytest.raises(ValueError, match="has 512 tokens, the target's 400"):
        cases.engine(chat_model, chat_tokenizer,
                     speculative=SpeculativeConfig(draft_model=Other()))


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_of_speculated_tokens_are_the_targets(chat_model, chat_tokenizer, draft_model,
                                                       sampled):
    """A speculating request with logprobs: each token's (kept drafts and the token after
    them) is the target model's log-softmax at its position, with the top alternatives."""
    from cases.logprobs import check_logprobs

    prompts = _prompts(chat_tokenizer, 3)
    for draft in (chat_model, draft_model):  # drafts kept; drafts refused
        engine = cases.engine(chat_model, chat_tokenizer,
                              speculative=SpeculativeConfig(draft_model=draft, num_tokens=3))
        streams = [engine.submit(p, serving.RequestParams(
            max_tokens=9, ignore_eos=True, sampling=SamplingParams(
                temperature=0.8 if sampled else 0.0, seed=i, logprobs=3)))
            for i, p in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        assert engine.last_error is None, engine.last_error
        assert engine.stats.draft_tokens > 0
        assert draft is not chat_model or engine.stats.accepted_tokens > 0
        for p, stream in zip(prompts, streams, strict=True):
            outputs = list(stream)
            ids = [t for o in outputs for t in o.token_ids]
            entries = [e for o in outputs for e in o.logprobs]
            assert len(ids) == 9
            check_logprobs(chat_model, p, ids, entries, 3)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_warm_up_compiles_the_speculative_steps(chat_model, chat_tokenizer, draft_model,
                                                method):
    """The server's warm-up (before ``/health`` says ready) compiles the verifying steps,
    greedy and sampled, so that speculating requests after it compile nothing new."""
    from forge_jax.serving import server

    config = (SpeculativeConfig(num_tokens=3) if method == "ngram"
              else SpeculativeConfig(draft_model=draft_model, num_tokens=3))
    engine = cases.engine(chat_model, chat_tokenizer, speculative=config).start()
    try:
        server.warm_up(engine)
        verifying = {key for key in engine.stats.compiled if key[-1] == 4}  # k + 1 rows
        assert {key[2] for key in verifying} == {True, False}
        assert engine.stats.draft_tokens == 0  # the warm-up's counters are reset
        before = set(engine.stats.compiled)
        for temperature in (0.0, 0.9):
            streams = [engine.submit(p, serving.RequestParams(
                max_tokens=6, ignore_eos=True, sampling=SamplingParams(temperature=temperature)),
                loop=None) for p in _prompts(chat_tokenizer, 2)]
            for stream in streams:
                assert len(stream.result()[0]) == 6
        assert set(engine.stats.compiled) == before
    finally:
        engine.shutdown()
