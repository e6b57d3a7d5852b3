"""Constrained requests (a JSON schema, a regex) in a speculating engine: each verify row is
masked by the grammar's state after the drafts before it, the drafts are cut where the
grammar refuses them (or replaced by the tokens it forces), and the matcher is advanced by
the kept tokens only. Greedy output equals the engine's without speculation; sampled output
stays valid; the masked rejection sampling keeps the masked target distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cases import serving as cases

from forge_jax.generation import SamplingParams, SpeculativeConfig
from forge_jax.generation import speculative as spec
from forge_jax.serving import engine as serving
from forge_jax.serving import speculation

pytest.importorskip("llguidance")

TEXTS = ["Hello there! How", "Numbers 0123", "The quick brown fox"]
# Repetitive: four objects of the same two keys (the forced keys and the repeated text are
# what the drafts guess).
ROWS = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "ok"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "colour"], "additionalProperties": False}


def _constraint(schema):
    from forge_jax.generation.constraints import Constraint

    return Constraint.json_schema(schema)


def _run(engine, prompts, schemas, **sampling):
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=100, sampling=SamplingParams(constraint=_constraint(schema), seed=i,
                                                **sampling)))
        for i, (p, schema) in enumerate(zip(prompts, schemas, strict=True))]
    while engine.has_work():
        engine.step()
    return [s.result() for s in streams]


def _validate(results, schemas):
    jsonschema = pytest.importorskip("jsonschema")
    for (_, text, reason), schema in zip(results, schemas, strict=True):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def reference(chat_model, chat_tokenizer):
    """Greedy constrained outputs without speculative decoding."""
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    schemas = [ROWS, ROWS, PERSON]
    results = _run(cases.engine(chat_model, chat_tokenizer), prompts, schemas)
    _validate(results, schemas)
    return prompts, schemas, results


def test_greedy_json_schema_output_equals_the_output_without(chat_model, chat_tokenizer,
                                                             reference):
    prompts, schemas, want = reference
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(num_tokens=4))
    got = _run(engine, prompts, schemas)
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]
    _validate(got, schemas)
    s = engine.stats
    assert engine.last_error is None and not s.not_speculating
    # The repeated keys and values are drafted and kept: far fewer steps than tokens.
    assert 0.5 < s.accepted_tokens / s.draft_tokens <= 1
    assert s.steps < sum(len(ids) for ids, _, _ in got) / 2
    assert engine.manager.usage().used_pages == len(engine.prefix_cache)  # none leaked


def _digit_swapped(tokenizer, want_by_prompt):
    """Drafts of the right continuation with every digit changed: valid for the grammar,
    refused by the model at the first changed digit (the rows after it are masked by a
    grammar state the output never reaches)."""
    digits = {tokenizer.encode(str(d))[-1]: d for d in range(10)}
    swap = {t: tokenizer.encode(str((d + 3) % 10))[-1] for t, d in digits.items()}

    def propose(history, config):
        for prompt, w in want_by_prompt.items():
            if tuple(history[:len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                return [swap.get(t, t) for t in w[done:done + config.num_tokens]]
        raise AssertionError("unknown history")
    return propose


def test_drafts_the_model_refuses_roll_the_grammar_back(chat_model, chat_tokenizer,
                                                        reference, monkeypatch):
    prompts, schemas, want = reference
    monkeypatch.setattr(spec, "propose_ngram", _digit_swapped(
        chat_tokenizer, {tuple(p): ids for p, (ids, _, _) in zip(prompts, want, strict=True)}))
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(num_tokens=4))
    got = _run(engine, prompts, schemas)
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]
    s = engine.stats
    assert engine.last_error is None and 0 < s.accepted_tokens < s.draft_tokens


def test_grammar_drafts_cut_where_the_grammar_refuses(chat_tokenizer):
    from forge_jax.generation.constraints import GrammarTokenizer
    from forge_jax.serving.requests import Request, RequestParams

    grammar = GrammarTokenizer(chat_tokenizer, 400, [1])
    r = Request(0, [5], RequestParams(), None, 0, 0.0)
    r.matcher = _constraint(ROWS).matcher(grammar)
    valid = chat_tokenizer.encode('[{"id": 1, "ok": true}', add_special_tokens=False)
    # A right prefix, then a token the grammar refuses: only the prefix is drafted.
    drafts = speculation.grammar_drafts(r, valid[:10] + chat_tokenizer.encode("x")[-1:], 12)
    assert drafts == valid[:10] and len(r.draft_masks) == 10
    for i, mask in enumerate(r.draft_masks[:-1]):  # each mask allows the next right token
        assert (mask[valid[i + 1] // 32] >> (valid[i + 1] % 32)) & 1
    assert r.matcher.forced() == valid[:8]  # rolled back: '[{"id": ' is forced again
    # Nothing valid proposed: the grammar's forced tokens are the drafts.
    assert speculation.grammar_drafts(r, [], 5) == valid[:5]


def test_sampled_constrained_requests_stay_valid(chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    schemas = [ROWS, PERSON, ROWS]
    engine = cases.engine(chat_model, chat_tokenizer,
                          speculative=SpeculativeConfig(num_tokens=4))
    got = _run(engine, prompts, schemas, temperature=1.0, top_p=0.95)
    _validate(got, schemas)
    s = engine.stats
    assert engine.last_error is None and s.accepted_tokens > 0
    assert engine.manager.usage().used_pages == len(engine.prefix_cache)


def test_masked_rejection_sampling_keeps_the_masked_distribution():
    """The first token of a verified row whose draft the grammar allows is distributed as the
    target's masked (then top-p filtered) distribution, from a float64 reference."""
    import jax
    import jax.numpy as jnp

    from forge_jax.serving import batch_step

    rng = np.random.default_rng(0)
    vocab, k, draws = 12, 2, 6000
    logits = rng.normal(0.0, 1.5, (1, k + 1, vocab)).astype(np.float32)
    allowed = np.zeros((vocab,), bool)
    allowed[[1, 4, 5, 8, 11]] = True
    words = np.zeros((1, k + 1, 1), np.int32)
    words[..., 0] = np.int32(sum(1 << int(t) for t in np.flatnonzero(allowed)))
    mask = batch_step.allowed_tokens(jnp.asarray(words.reshape(-1, 1)), vocab)
    masked = jnp.where(mask.reshape(1, k + 1, vocab), logits, -jnp.inf)
    drafts = jnp.asarray([[4, 5]], jnp.int32)

    def first(seed):
        sampling = dict(temperature=jnp.full((1,), 0.8), top_k=jnp.zeros((1,), jnp.int32),
                        top_p=jnp.full((1,), 0.95), min_p=jnp.zeros((1,)),
                        seed=seed[None], step=jnp.zeros((1,), jnp.int32))
        out, _ = batch_step.verify_rows(masked, drafts, jnp.asarray([2]), sampling,
                                        greedy=False)
        return out[0, 0]

    tokens = np.asarray(jax.jit(jax.vmap(first))(jnp.arange(draws, dtype=jnp.uint32)))
    assert set(tokens.tolist()) <= set(np.flatnonzero(allowed).tolist())
    z = np.where(allowed, logits[0, 0].astype(np.float64) / 0.8, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < 0.95  # top-p: the smallest set reaching 0.95
    want = np.zeros_like(p)
    want[order[keep]] = p[order[keep]]
    want /= want.sum()
    freq = np.bincount(tokens, minlength=vocab) / draws
    tolerance = 4 * np.sqrt(want * (1 - want) / draws) + 1e-3  # four standard deviations
    assert np.all(np.abs(freq - want) <= tolerance), (freq, want)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    from cases.chat_checkpoint import write_checkpoint

    from forge_jax.models import llama

    return llama.from_pretrained(write_checkpoint(
        tmp_path_factory.mktemp("draft"), seed=3, sizes=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)))


def test_with_a_draft_model_constrained_requests_take_the_grammars_drafts(
        chat_model, chat_tokenizer, draft_model, reference):
    """Beside requests the draft model drafts for, a constrained request's drafts are the
    grammar's, from the host (with a one-hot ``q``): greedy output as without speculation,
    sampled output valid."""
    prompts, schemas, want = reference
    engine = cases.engine(chat_model, chat_tokenizer, speculative=SpeculativeConfig(
        draft_model=draft_model, num_tokens=3))
    free = engine.submit(prompts[2], serving.RequestParams(max_tokens=12, ignore_eos=True))
    got = _run(engine, prompts[:2], schemas[:2])
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want[:2]]
    assert free.result()[0] == cases.greedy(chat_model, chat_tokenizer, prompts[2:], 12)[0]
    s = engine.stats
    assert engine.last_error is None and not s.not_speculating
    assert 0 < s.accepted_tokens < s.draft_tokens  # the random draft's are mostly refused
    sampled = _run(engine, prompts[:2], schemas[:2], temperature=1.0)
    _validate(sampled, schemas[:2])
    assert engine.last_error is None
    assert engine.manager.usage().used_pages == len(engine.prefix_cache)
