"""Log-probabilities of generated tokens: ``SamplingParams(logprobs=N)`` in ``generate`` and
the serving engine, checked against the model's own ``log_softmax`` over the whole sequence
(a float64 NumPy reference from a plain forward pass)."""

from __future__ import annotations

import numpy as np
import pytest

from forge_jax.generation import SamplingParams, generate_with_stats
from forge_jax.generation.sampling import MAX_LOGPROBS

TEXTS = ["Hello there! How", "The quick brown fox"]


def _reference_logprobs(model, prompt, generated) -> np.ndarray:
    """float64 ``[len(generated), vocab]``: the log-softmax of the model's logits at each
    generated position (the sequence's forward pass, no cache)."""
    ids = np.asarray([prompt + generated[:-1]], np.int32)
    logits = np.asarray(model(ids), np.float64)[0, len(prompt) - 1:]
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def _check(model, prompt, generated, entries, k):
    ref = _reference_logprobs(model, prompt, generated)
    assert len(entries) == len(generated)
    for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
        assert entry.token == token
        np.testing.assert_allclose(entry.logprob, ref[i, token], atol=2e-4, rtol=1e-4)
        assert len(entry.top) == k
        ids = [t for t, _ in entry.top]
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, ref[i, ids], atol=2e-4, rtol=1e-4)
        # the k largest of the reference (ties aside)
        np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:k], atol=2e-4, rtol=1e-4)
        if k:  # greedy: the sampled token is the most likely
            assert ids[0] == token or np.isclose(values[0], entry.logprob, atol=1e-5)


def test_generate_greedy_logprobs_equal_the_models_log_softmax(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    out, stats = generate_with_stats(chat_model, prompts, 6,
                                     sampling=SamplingParams(logprobs=5), eos_token_id=())
    plain, _ = generate_with_stats(chat_model, prompts, 6, eos_token_id=())
    assert out == plain  # asking for logprobs changes nothing else
    for prompt, generated, entries in zip(prompts, out, stats.logprobs, strict=True):
        _check(chat_model, prompt, generated, entries, 5)


def test_generate_sampled_logprobs_are_before_the_temperature(chat_model, chat_tokenizer):
    prompt = chat_tokenizer.encode(TEXTS[1])
    sampling = SamplingParams(temperature=1.7, top_k=20, seed=3, logprobs=0)
    out, stats = generate_with_stats(chat_model, [prompt], 5, sampling=sampling,
                                     eos_token_id=())
    _check(chat_model, prompt, out[0], stats.logprobs[0], 0)


def test_logprobs_settings_are_checked():
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs must be an int in"):
        SamplingParams(logprobs=True)
