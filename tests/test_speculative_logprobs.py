"""Log-probabilities with speculative decoding in ``generate``: each kept token's from the
target's logits at the verify row that drew it, checked against the model's float64
``log_softmax`` over the whole sequence, and equal to one-token decoding's at temperature 0
(drafts kept or refused, from prompt lookup or a draft model)."""

from __future__ import annotations

import numpy as np
import pytest
from cases.logprobs import check_logprobs

from forge_jax.generation import SamplingParams, SpeculativeConfig, generate_with_stats
from forge_jax.generation import speculative as spec
from forge_jax.kv_cache import CacheSpec

REPETITIVE = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
              "the lazy dog. The quick brown")


def _oracle(want_by_prompt, shift):
    """Prompt lookup replaced by the greedy continuation itself (shifted: always wrong)."""
    def propose(history, config):
        for prompt, w in want_by_prompt.items():
            if tuple(history[:len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                return [(t + shift) % 400 for t in w[done:done + config.num_tokens]]
        raise AssertionError("unknown history")
    return propose


@pytest.mark.parametrize("drafts", ["right", "wrong", "target as draft model"])
def test_greedy_logprobs_equal_one_token_decodings(chat_model, chat_tokenizer, monkeypatch,
                                                   drafts):
    """Right drafts are all kept (their logprobs come from the verify rows after them), wrong
    ones all refused; the target drafting for itself keeps every draft too."""
    prompts = [chat_tokenizer.encode(REPETITIVE), chat_tokenizer.encode("Hello there! How")]
    sampling = SamplingParams(logprobs=3)
    cache = CacheSpec(page_size=8)
    want, plain = generate_with_stats(chat_model, prompts, 16, sampling=sampling,
                                      eos_token_id=(), cache=cache)
    by_prompt = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    if drafts == "target as draft model":
        config = SpeculativeConfig(num_tokens=4, draft_model=chat_model)
    else:
        monkeypatch.setattr(spec, "propose_ngram", _oracle(by_prompt, int(drafts == "wrong")))
        config = SpeculativeConfig(num_tokens=4)
    got, stats = generate_with_stats(chat_model, prompts, 16, sampling=sampling,
                                     eos_token_id=(), cache=cache, speculative=config)
    assert got == want
    kept = 0 if drafts == "wrong" else stats.draft_tokens
    assert stats.draft_tokens > 0 and stats.accepted_tokens == kept
    for prompt, generated, entries, before in zip(prompts, got, stats.logprobs,
                                                  plain.logprobs, strict=True):
        check_logprobs(chat_model, prompt, generated, entries, 3)
        assert [e.token for e in entries] == [e.token for e in before]
        np.testing.assert_allclose([e.logprob for e in entries],
                                   [e.logprob for e in before], atol=2e-5, rtol=1e-5)
        assert [[i for i, _ in e.top] for e in entries] == [[i for i, _ in e.top]
                                                             for e in before]


def test_logprobs_stop_with_the_tokens_at_an_eos(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(REPETITIVE), chat_tokenizer.encode("Hello there! How")]
    sampling, cache = SamplingParams(logprobs=3), CacheSpec(page_size=8)
    want, _ = generate_with_stats(chat_model, prompts, 16, eos_token_id=(), cache=cache,
                                  sampling=sampling)
    eos = [want[0][6]]
    got, stats = generate_with_stats(chat_model, prompts, 16, eos_token_id=eos, cache=cache,
                                     sampling=sampling,
                                     speculative=SpeculativeConfig(num_tokens=4))
    assert got[0] == want[0][:want[0].index(eos[0]) + 1]
    for prompt, generated, entries in zip(prompts, got, stats.logprobs, strict=True):
        check_logprobs(chat_model, prompt, generated, entries, 3)


def test_sampled_logprobs_are_before_the_temperature(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(REPETITIVE), chat_tokenizer.encode("Hello there! How")]
    sampling = SamplingParams(temperature=1.3, top_k=40, seed=5, logprobs=2)
    got, stats = generate_with_stats(chat_model, prompts, 16, sampling=sampling,
                                     eos_token_id=(), cache=CacheSpec(page_size=8),
                                     speculative=SpeculativeConfig(num_tokens=4))
    assert stats.draft_tokens > 0
    for prompt, generated, entries in zip(prompts, got, stats.logprobs, strict=True):
        check_logprobs(chat_model, prompt, generated, entries, 2)
