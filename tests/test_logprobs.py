"""Log-probabilities of generated tokens: ``SamplingParams(logprobs=N)`` in ``generate`` and
the serving engine, checked against the model's own ``log_softmax`` over the whole sequence
(a float64 NumPy reference from a plain forward pass)."""

from __future__ import annotations

import numpy as np
import pytest
from cases.logprobs import check_logprobs

from forge_jax.generation import SamplingParams, generate_with_stats
from forge_jax.generation.sampling import MAX_LOGPROBS

TEXTS = ["Hello there! How", "The quick brown fox"]


def test_generate_greedy_logprobs_equal_the_models_log_softmax(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    out, stats = generate_with_stats(chat_model, prompts, 6,
                                     sampling=SamplingParams(logprobs=5), eos_token_id=())
    plain, _ = generate_with_stats(chat_model, prompts, 6, eos_token_id=())
    assert out == plain  # asking for logprobs changes nothing else
    for prompt, generated, entries in zip(prompts, out, stats.logprobs, strict=True):
        check_logprobs(chat_model, prompt, generated, entries, 5)


def test_generate_sampled_logprobs_are_before_the_temperature(chat_model, chat_tokenizer):
    prompt = chat_tokenizer.encode(TEXTS[1])
    sampling = SamplingParams(temperature=1.7, top_k=20, seed=3, logprobs=0)
    out, stats = generate_with_stats(chat_model, [prompt], 5, sampling=sampling,
                                     eos_token_id=())
    check_logprobs(chat_model, prompt, out[0], stats.logprobs[0], 0)


def test_logprobs_settings_are_checked():
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        SamplingParams(logprobs=True)


def test_sequence_logprobs_score_every_token(chat_model, chat_tokenizer):
    from cases.logprobs import log_softmax, next_logits

    from forge_jax.generation.scoring import sequence_logprobs

    ids = chat_tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    entries = sequence_logprobs(chat_model, ids, 4)
    assert entries[0].token == ids[0] and entries[0].logprob is None and not entries[0].top
    ref = log_softmax(next_logits(chat_model, ids))[:-1]  # [len - 1, vocab]
    for i, e in enumerate(entries[1:]):
        assert e.token == ids[i + 1]
        np.testing.assert_allclose(e.logprob, ref[i, ids[i + 1]], atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose([v for _, v in e.top], np.sort(ref[i])[::-1][:4],
                                   atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="k must be an int"):
        sequence_logprobs(chat_model, ids, 21)
