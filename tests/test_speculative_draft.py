"""Speculative decoding with a draft model: a smaller model of the same vocabulary drafts
tokens with its own KV cache and the target verifies them in one step. Greedy output equals
one-token decoding; sampled drafts are accepted with ``min(1, p / q)`` and rejected ones
redrawn from the residual, which keeps the target's distribution (checked against exact
distributions over many draws)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forge_jax.generation import SamplingParams, SpeculativeConfig, generate_with_stats
from forge_jax.generation import speculative as spec
from forge_jax.kv_cache import CacheSpec

DRAFT_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "Hello there! How",
         "Numbers 0123456789 and symbols 0123"]


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    from cases.chat_checkpoint import write_checkpoint

    from forge_jax.models import llama

    return llama.from_pretrained(write_checkpoint(tmp_path_factory.mktemp("draft"), seed=3,
                                                  sizes=DRAFT_SIZES))


def test_config_takes_a_draft_model(chat_model):
    config = SpeculativeConfig(draft_model=chat_model, num_tokens=2)
    assert config.method == "draft"
    assert SpeculativeConfig().method == "ngram"
    with pytest.raises(ValueError, match="method='draft' takes a draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="method='draft' takes a draft_model"):
        SpeculativeConfig(method="ngram", draft_model=chat_model)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_greedy_output_equals_one_token_decoding(chat_model, chat_tokenizer, draft_model,
                                                 kind):
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    cache = CacheSpec(kind=kind, page_size=8)
    want, _ = generate_with_stats(chat_model, prompts, 20, cache=cache, eos_token_id=())
    got, stats = generate_with_stats(
        chat_model, prompts, 20, cache=cache, eos_token_id=(),
        speculative=SpeculativeConfig(draft_model=draft_model, num_tokens=3))
    assert got == want
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens < stats.draft_tokens
    eos = [want[1][4]]  # stops at its first eos, as without speculation
    want, _ = generate_with_stats(chat_model, prompts, 20, cache=cache, eos_token_id=eos)
    got, _ = generate_with_stats(chat_model, prompts, 20, cache=cache, eos_token_id=eos,
                                 speculative=SpeculativeConfig(draft_model=draft_model))
    assert got == want


def test_the_target_as_its_own_draft_keeps_every_draft(chat_model, chat_tokenizer):
    """A draft that is the target proposes the greedy continuation: every draft is kept
    (19 tokens after the prefill's in ceil(19 / 4) steps), and the output is unchanged."""
    prompts = [chat_tokenizer.encode(t) for t in TEXTS[1:]]
    want, _ = generate_with_stats(chat_model, prompts, 20, eos_token_id=())
    got, stats = generate_with_stats(
        chat_model, prompts, 20, eos_token_id=(),
        speculative=SpeculativeConfig(draft_model=chat_model, num_tokens=3))
    assert got == want
    assert stats.decode_steps == 5 and stats.acceptance_rate == 1.0
    # Sampled, p equals q (up to rounding): nearly every draft is kept.
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=1)
    got, stats = generate_with_stats(
        chat_model, prompts, 20, eos_token_id=(), sampling=sampling,
        speculative=SpeculativeConfig(draft_model=chat_model, num_tokens=3))
    assert [len(g) for g in got] == [20, 20] and stats.acceptance_rate > 0.9


def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution():
    """One draft position over 5 tokens, the draft drawn from a q unlike p: the first output
    token's frequencies match p, and a draft is kept with probability sum(min(p, q))."""
    n = 6000
    p_logits = np.float64([2.0, 1.0, 0.5, -1.0, 0.0])
    p = np.exp(p_logits / 0.8)
    p /= p.sum()
    q = np.float64([0.05, 0.1, 0.45, 0.3, 0.1])
    rng = np.random.default_rng(0)
    drafts = rng.choice(5, size=n, p=q)
    logits = jnp.asarray(np.broadcast_to(np.stack([p_logits, p_logits[::-1]]), (n, 2, 5)),
                         jnp.float32)
    params = SamplingParams(temperature=0.8).arrays()
    out, count = jax.jit(spec.verify_drafts, static_argnames="greedy")(
        logits, jnp.asarray(drafts[:, None], jnp.int32), jnp.ones((n,), jnp.int32),
        jax.random.key(7), params, greedy=False,
        q=jnp.asarray(np.broadcast_to(q, (n, 1, 5)), jnp.float32))
    first = np.asarray(out)[:, 0]
    np.testing.assert_allclose(np.bincount(first, minlength=5) / n, p, atol=0.025)
    kept = np.asarray(count) == 2
    assert np.all(first[kept] == drafts[kept])
    np.testing.assert_allclose(kept.mean(), np.minimum(p, q).sum(), atol=0.025)
    # The one-hot q of prompt lookup's deterministic drafts is the degenerate case: kept
    # with probability p(d), as without q.
    onehot = np.eye(5)[drafts]
    _, count = jax.jit(spec.verify_drafts, static_argnames="greedy")(
        logits, jnp.asarray(drafts[:, None], jnp.int32), jnp.ones((n,), jnp.int32),
        jax.random.key(8), params, greedy=False,
        q=jnp.asarray(onehot[:, None], jnp.float32))
    np.testing.assert_allclose((np.asarray(count) == 2).mean(), (p * q).sum(), atol=0.025)


def test_draft_step_draws_from_the_distribution_it_returns(draft_model, chat_tokenizer):
    """The drafts of :func:`draft_step` are greedy continuations of the draft model when
    greedy; sampled, each q row is a distribution holding its draft."""
    from flax import nnx

    from forge_jax.generation.steps import step_statics
    from forge_jax.kv_cache import ContiguousKVCache

    prompt = chat_tokenizer.encode(TEXTS[1])
    want, _ = generate_with_stats(draft_model, [prompt], 5, eos_token_id=())
    graphdef, state = nnx.split(draft_model)
    for greedy in (True, False):
        cfg = draft_model.config
        kv = ContiguousKVCache.create(num_layers=cfg.num_hidden_layers, batch=1, max_len=64,
                                      kv_heads=draft_model.kv_heads, head_dim=cfg.head_dim,
                                      dtype=jnp.float32)
        # The prompt but its last token in the cache, then (its last, the first new) drafted.
        history = prompt + want[0][:1]
        _, kv = draft_model.forward_cached(
            jnp.asarray([history[:-2]]), jnp.arange(len(history) - 2)[None],
            jnp.ones((1, len(history) - 2), bool), kv)
        params = SamplingParams(temperature=1.0 if not greedy else 0.0).arrays()
        drafts, q, kv = spec.draft_step(
            state, kv, jnp.asarray([history[-2:]]), jnp.asarray([len(history) - 2]),
            jnp.asarray([True]), jax.random.key(0), params,
            **step_statics(graphdef, greedy), num_tokens=4)
        drafts, q = np.asarray(drafts), np.asarray(q, np.float64)
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.take_along_axis(q, drafts[..., None], -1) > 0)
        if greedy:
            assert drafts[0].tolist() == want[0][1:5]


def test_a_draft_of_another_vocabulary_is_refused(chat_model):
    import dataclasses

    class Other:
        config = dataclasses.replace(chat_model.config, vocab_size=512)
        mesh = None

    with pytest.raises(ValueError, match="has 512 tokens, the target's 400"):
        generate_with_stats(chat_model, [[5, 6]], 4,
                            speculative=SpeculativeConfig(draft_model=Other()))
    with pytest.raises(ValueError, match=r"differs from the target's in 2 .* 'b'=1"):
        spec.check_draft(chat_model, chat_model,
                         {"target": {"a": 0, "b": 1}, "draft": {"a": 0, "c": 1}})
