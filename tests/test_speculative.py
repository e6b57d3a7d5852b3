"""Speculative decoding in ``generate``: prompt-lookup drafts verified in one step. Greedy
output equals one-token decoding; sampled output is distributed as the target model's (the
verifier's rejection sampling against exact distributions, many draws)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forge_jax.generation import SamplingParams, SpeculativeConfig, generate_with_stats
from forge_jax.generation import speculative as spec
from forge_jax.kv_cache import CacheSpec

REPETITIVE = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over "
              "the lazy dog. The quick brown")


def test_ngram_proposals():
    config = SpeculativeConfig(num_tokens=3, max_ngram=2)
    assert spec.propose_ngram([1, 2, 3, 4, 9, 1, 2], config) == [3, 4, 9]
    assert spec.propose_ngram([5, 1, 7, 8, 1], config) == [7, 8, 1]  # 1-gram, latest match
    assert spec.propose_ngram([1, 2, 3], config) == []
    assert spec.propose_ngram([4, 4], config) == [4]
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_greedy_output_equals_one_token_decoding(chat_model, chat_tokenizer, kind):
    prompts = [chat_tokenizer.encode(REPETITIVE), chat_tokenizer.encode("Hello there! How"),
               chat_tokenizer.encode("Numbers 0123456789 and symbols 0123")]
    cache = CacheSpec(kind=kind, page_size=8)
    want, _ = generate_with_stats(chat_model, prompts, 24, cache=cache, eos_token_id=())
    got, stats = generate_with_stats(chat_model, prompts, 24, cache=cache, eos_token_id=(),
                                     speculative=SpeculativeConfig(num_tokens=4))
    assert got == want
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    eos = [want[0][5]]  # stops at its first eos, as without speculation
    want, _ = generate_with_stats(chat_model, prompts, 24, cache=cache, eos_token_id=eos)
    got, _ = generate_with_stats(chat_model, prompts, 24, cache=cache, eos_token_id=eos,
                                 speculative=SpeculativeConfig(num_tokens=3))
    assert got == want


def test_right_drafts_are_kept_and_wrong_ones_cost_nothing(chat_model, chat_tokenizer,
                                                           monkeypatch):
    """Drafts from an oracle (the greedy continuation itself) are all kept: 24 tokens in
    ceil(23 / 5) steps after the prefill's (the last step verifies the 2 drafts there is room
    for: 4 + 4 + 4 + 4 + 2 per sequence); drafts off by one token are all refused and the
    output is still the greedy one."""
    prompts = [chat_tokenizer.encode("Hello there! How"), chat_tokenizer.encode("Numbers 01")]
    want, _ = generate_with_stats(chat_model, prompts, 24, eos_token_id=())
    by_prompt = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

    def oracle(shift):
        def propose(history, config):
            for prompt, w in by_prompt.items():
                if tuple(history[:len(prompt)]) == prompt:
                    done = len(history) - len(prompt)
                    return [(t + shift) % 400 for t in w[done:done + config.num_tokens]]
            raise AssertionError("unknown history")
        return propose

    monkeypatch.setattr(spec, "propose_ngram", oracle(0))
    got, stats = generate_with_stats(chat_model, prompts, 24, eos_token_id=(),
                                     speculative=SpeculativeConfig(num_tokens=4))
    assert got == want
    assert stats.decode_steps == 5 and stats.accepted_tokens == stats.draft_tokens == 2 * 18
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_step == 23 / 5
    monkeypatch.setattr(spec, "propose_ngram", oracle(1))
    got, stats = generate_with_stats(chat_model, prompts, 24, eos_token_id=(),
                                     speculative=SpeculativeConfig(num_tokens=4))
    assert got == want and stats.accepted_tokens == 0 and stats.decode_steps == 23


def test_speculative_refuses_what_it_does_not_apply(chat_model):
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate_with_stats(chat_model, [[5, 6]], 4, speculative=SpeculativeConfig(),
                            sampling=SamplingParams(repetition_penalty=1.2))


def test_rejection_sampling_keeps_the_target_distribution():
    """Two positions over a 5-token vocabulary, each draft fixed: the first output token's
    frequencies over many keys match the target's softmax, whatever the draft."""
    logits = jnp.asarray([[[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, 0.2, 0.1, 0.0, 1.5]]] * 4000,
                         jnp.float32)  # [b, 2, 5]
    params = SamplingParams(temperature=0.8).arrays()
    p = np.exp(np.float64([2.0, 1.0, 0.5, -1.0, 0.0]) / 0.8)
    p /= p.sum()
    for draft in (0, 3):
        drafts = jnp.full((4000, 1), draft, jnp.int32)
        out, count = jax.jit(spec.verify_drafts, static_argnames="greedy")(
            logits, drafts, jnp.ones((4000,), jnp.int32), jax.random.key(draft), params,
            greedy=False)
        first = np.asarray(out)[:, 0]
        freq = np.bincount(first, minlength=5) / 4000
        np.testing.assert_allclose(freq, p, atol=0.03)  # ~4 standard errors
        kept = np.asarray(count) == 2
        assert np.all(first[kept] == draft) and np.all(first[~kept] != draft)
        np.testing.assert_allclose(kept.mean(), p[draft], atol=0.03)


def test_sampled_speculative_generation_runs_to_its_limit(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(REPETITIVE), chat_tokenizer.encode("Hello")]
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4)
    got, stats = generate_with_stats(chat_model, prompts, 20, sampling=sampling,
                                     eos_token_id=(), speculative=SpeculativeConfig())
    assert [len(g) for g in got] == [20, 20]
    assert all(0 <= t < chat_model.config.vocab_size for g in got for t in g)
    again, _ = generate_with_stats(chat_model, prompts, 20, sampling=sampling,
                                   eos_token_id=(), speculative=SpeculativeConfig())
    assert again == got  # the seed decides


@pytest.mark.parametrize("flags, fragment", [
    (["--speculative", "eagle"], "--speculative: invalid choice: 'eagle'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be >= 1, got 0"),
    (["--speculative", "ngram", "--repetition-penalty", "1.3"],
     "--speculative does not apply --repetition-penalty"),
])
def test_bad_speculative_flags_are_one_line(capsys, chat_checkpoint, no_model_load, flags,
                                            fragment):
    from cases.cli import assert_one_line_error, run

    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(chat_checkpoint),
                              "--prompt", "Hi", *flags), fragment, prog="forge-jax generate")
