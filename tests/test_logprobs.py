"""Log-probabilities of generated tokens: ``SamplingParams(logprobs=N)`` in ``generate`` and
the serving engine, checked against the model's own ``log_softmax`` over the whole sequence
(a float64 NumPy reference from a plain forward pass)."""

from __future__ import annotations

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
