"""The references of the log-probability and logit-adjustment tests: the model's logits over a
whole sequence (a plain forward pass, no cache) in float64, and OpenAI's penalties applied to
them on the host."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    logits = logits - logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def next_logits(model, ids) -> np.ndarray:
    """float64 ``[len(ids), vocab]``: the model's logits after each prefix of ``ids``."""
    return np.asarray(model(np.asarray([ids], np.int32)), np.float64)[0]


def reference_logprobs(model, prompt, generated) -> np.ndarray:
    """float64 ``[len(generated), vocab]``: the log-softmax at each generated position."""
    return log_softmax(next_logits(model, list(prompt) + list(generated[:-1]))[len(prompt) - 1:])


def check_logprobs(model, prompt, generated, entries, k, *, atol=2e-4):
    """``entries`` (TokenLogprob per generated token) against the reference: the sampled
    token's value, and the ``k`` alternatives ordered, equal to the reference's largest."""
    ref = reference_logprobs(model, prompt, generated)
    assert len(entries) == len(generated)
    for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
        assert entry.token == token
        np.testing.assert_allclose(entry.logprob, ref[i, token], atol=atol, rtol=1e-4)
        assert len(entry.top) == k
        ids = [t for t, _ in entry.top]
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, ref[i, ids], atol=atol, rtol=1e-4)
        np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:k], atol=atol, rtol=1e-4)


def greedy_with_penalties(model, prompt, n, *, presence=0.0, frequency=0.0, bias=None,
                          eos=()) -> list[int]:
    """Greedy tokens with OpenAI's penalties (over the generated tokens only) and logit
    bias applied to the float64 logits, one forward pass per token."""
    out: list[int] = []
    for _ in range(n):
        logits = next_logits(model, list(prompt) + out)[-1].copy()
        counts = np.bincount(np.asarray(out, np.int64), minlength=logits.shape[0])
        logits -= presence * (counts > 0) + frequency * counts
        for token, value in (bias or {}).items():
            logits[token] += value
        out.append(int(np.argmax(logits)))
        if out[-1] in eos:
            break
    return out
