"""Speculative decoding in the serving engine: drafts verified in the same ragged step as
the other requests' rows. Greedy output equals the engine's (and ``generate``'s) without
it, for many concurrent requests, whether the drafts are right (all kept: fewer steps) or
wrong (all refused, their pages given back); sampled requests run to their limits."""

from __future__ import annotations

import pytest
from cases import serving as cases

from forge_jax.generation import SamplingParams, SpeculativeConfig
from forge_jax.generation import speculative as spec
from forge_jax.serving import engine as serving

TEXTS = ["Hello there! How", "The quick brown fox jumps over the lazy dog. The quick brown",
         "Numbers 0123", "Caf\u00e9 cr\u00e8me", "I am fine, thank you."]


def _prompts(tokenizer, n):
    """Prompts none of which starts another (the oracle tells them apart by prefix)."""
    return [tokenizer.encode(f"{i}: " + TEXTS[i % 5])[:8 + i % 5] for i in range(n)]


def _run(engine, prompts, max_tokens, **sampling):
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=max_tokens, ignore_eos=True, sampling=SamplingParams(**sampling)))
        for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.result()[0] for s in streams]


def _oracle(want_by_prompt, shift):
    def propose(history, config):
        for prompt, w in want_by_prompt.items():
            if tuple(history[:len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                return [(t + shift) % 400 for t in w[done:done + config.num_tokens]]
        raise AssertionError("unknown history")
    return propose


def test_16_concurrent_greedy_requests_equal_the_output_without(chat_model, chat_tokenizer,
                                                                 monkeypatch):
    prompts = _prompts(chat_tokenizer, 16)
    assert len({tuple(p) for p in prompts}) == 16
    reference = _run(cases.engine(chat_model, chat_tokenizer), prompts, 12)
    by_prompt = {tuple(p): w for p, w in zip(prompts, reference, strict=True)}
    for shift, kept in ((0, True), (1, False), (None, None)):
        if shift is not None:
            monkeypatch.setattr(spec, "propose_ngram", _oracle(by_prompt, shift))
        else:
            monkeypatch.undo()
        engine = cases.engine(chat_model, chat_tokenizer,
                              speculative=SpeculativeConfig(num_tokens=3))
        got = _run(engine, prompts, 12)
        assert got == reference, shift
        s = engine.stats
        assert engine.last_error is None and s.verified > 0
        if kept:
            assert s.accepted_tokens == s.draft_tokens > 0
        elif kept is False:
            assert s.accepted_tokens == 0 and s.draft_tokens > 0
        assert engine.manager.usage().used_pages == len(engine.prefix_cache)  # none leaked


def test_sampled_and_constrained_requests_beside_speculating_ones(chat_model, chat_tokenizer):
    prompts = _prompts(chat_tokenizer, 4)
    engine = cases.engine(chat_model, chat_tokenizer, speculative=SpeculativeConfig())
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=10, ignore_eos=True,
        sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=i,
                                logprobs=1 if i == 3 else None)))
        for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    results = [s.result() for s in streams]
    assert [len(ids) for ids, _, _ in results] == [10] * 4
    assert engine.last_error is None


def test_speculative_config_is_checked():
    with pytest.raises(TypeError, match="speculative must be"):
        serving.EngineConfig(speculative="ngram")


def test_metrics_report_the_acceptance(chat_model, chat_tokenizer, monkeypatch):
    from forge_jax.serving.metrics import Metrics

    prompts = _prompts(chat_tokenizer, 2)
    reference = _run(cases.engine(chat_model, chat_tokenizer), prompts, 9)
    monkeypatch.setattr(spec, "propose_ngram", _oracle(
        {tuple(p): w for p, w in zip(prompts, reference, strict=True)}, 0))
    engine = cases.engine(chat_model, chat_tokenizer, speculative=SpeculativeConfig(num_tokens=4))
    assert _run(engine, prompts, 9) == reference
    text = Metrics(engine).render()
    assert "forge_jax_spec_acceptance_rate 1.0" in text
    # 9 tokens each: the prefill's, then 4 kept drafts and one more, then 2 and one more.
    assert "forge_jax_spec_tokens_per_step 4.0" in text
    assert f"forge_jax_spec_accepted_tokens_total {float(engine.stats.accepted_tokens)}" in text


def test_bad_serve_speculative_flags_are_one_line(capsys, chat_checkpoint, no_model_load):
    pytest.importorskip("uvicorn")
    from cases.cli import assert_one_line_error, run

    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint),
                              "--speculative", "ngram", "--num-speculative-tokens", "0"),
                          "--num-speculative-tokens must be >= 1, got 0", prog="forge-jax serve")
