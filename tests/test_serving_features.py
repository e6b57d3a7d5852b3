"""The serving engine's per-request logit settings, on the device: log-probabilities,
OpenAI's presence and frequency penalties and logit bias, and grammar constraints, each
against a float64 reference from the model's own logits or a validator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cases import serving as cases
from cases.logprobs import check_logprobs, greedy_with_penalties

from forge_jax.generation import SamplingParams
from forge_jax.serving import engine as serving

TEXTS = ["Hello there! How", "The quick brown fox", "Numbers 0123"]


@pytest.fixture(scope="module")
def engine(chat_model, chat_tokenizer):
    e = cases.engine(chat_model, chat_tokenizer).start()
    yield e
    e.shutdown()


def _run(engine, prompt, max_tokens, **sampling):
    stream = engine.submit(prompt, serving.RequestParams(
        max_tokens=max_tokens, sampling=SamplingParams(**sampling), ignore_eos=True))
    outs = list(stream)
    ids = [t for o in outs for t in o.token_ids]
    return ids, [lp for o in outs for lp in o.logprobs], outs[-1].finish_reason


def test_logprobs_equal_the_models_log_softmax(engine, chat_model, chat_tokenizer):
    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    streams = [engine.submit(p, serving.RequestParams(
        max_tokens=6, sampling=SamplingParams(logprobs=k), ignore_eos=True))
        for p, k in zip(prompts, (3, 0, None), strict=True)]
    results = [list(s) for s in streams]
    for prompt, outs, k in zip(prompts, results, (3, 0), strict=False):
        ids = [t for o in outs for t in o.token_ids]
        entries = [lp for o in outs for lp in o.logprobs]
        check_logprobs(chat_model, prompt, ids, entries, k)
    assert all(not o.logprobs for o in results[2])  # not asked: none
    plain = cases.greedy(chat_model, chat_tokenizer, prompts[:1], 6)[0]
    assert [t for o in results[0] for t in o.token_ids][:len(plain)] == plain


def test_penalties_and_bias_follow_openais_formula(engine, chat_model, chat_tokenizer):
    prompt = chat_tokenizer.encode(TEXTS[1])
    free, _, _ = _run(engine, prompt, 8)
    for settings in (dict(frequency_penalty=2.0), dict(presence_penalty=1.5),
                     dict(frequency_penalty=-1.0, presence_penalty=0.5),
                     dict(logit_bias={free[0]: -100.0}),
                     dict(logit_bias={str(free[2]): 30.0}, frequency_penalty=0.7)):
        bias = {int(k): v for k, v in settings.get("logit_bias", {}).items()}
        want = greedy_with_penalties(chat_model, prompt, 8,
                                     presence=settings.get("presence_penalty", 0.0),
                                     frequency=settings.get("frequency_penalty", 0.0),
                                     bias=bias)
        got, _, reason = _run(engine, prompt, 8, **settings)
        assert got == want, settings
    assert _run(engine, prompt, 8, logit_bias={free[0]: -100.0})[0][0] != free[0]
    assert set(_run(engine, prompt, 5, logit_bias={7: 100.0})[0]) == {7}


def test_penalty_settings_are_checked():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty="1"),
                dict(logit_bias={"x": 1}), dict(logit_bias={3: 101}), dict(logit_bias=[1])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]}},
     "required": ["name", "age", "colour"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate_with_sampling(engine, chat_tokenizer, schema):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")

    from forge_jax.generation.constraints import Constraint

    prompt = chat_tokenizer.encode(TEXTS[0])
    for seed in range(3):
        ids, _, reason = _run(engine, prompt, 100, temperature=1.0, seed=seed,
                              constraint=Constraint.json_schema(schema))
        assert reason == "stop"
        jsonschema.validate(json.loads(chat_tokenizer.decode(ids)), schema)


def test_regex_and_choice_constraints(engine, chat_tokenizer):
    pytest.importorskip("llguidance")
    from forge_jax.generation.constraints import Constraint, ConstraintError

    prompt = chat_tokenizer.encode(TEXTS[2])
    ids, _, _ = _run(engine, prompt, 40, temperature=1.0, seed=1,
                     constraint=Constraint.regex(r"[0-9]{3}-[a-z]{2}"))
    text = chat_tokenizer.decode([t for t in ids if t not in engine.eos])
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    seen = set()
    for seed in range(6):
        ids, _, _ = _run(engine, prompt, 20, temperature=1.5, seed=seed,
                         constraint=Constraint.choice(["yes", "no", "maybe not"]))
        seen.add(chat_tokenizer.decode([t for t in ids if t not in engine.eos]))
    assert seen <= {"yes", "no", "maybe not"} and seen
    with pytest.raises(ConstraintError, match="regex"):
        engine.submit(prompt, serving.RequestParams(
            sampling=SamplingParams(constraint=Constraint.regex("a(b"))))
    assert not engine.has_work()  # refused before any work


def test_constrained_and_free_requests_share_steps(engine, chat_model, chat_tokenizer):
    pytest.importorskip("llguidance")
    from forge_jax.generation.constraints import Constraint

    prompts = [chat_tokenizer.encode(t) for t in TEXTS]
    free = [engine.submit(p, serving.RequestParams(max_tokens=10, ignore_eos=True))
            for p in prompts]
    bound = [engine.submit(p, serving.RequestParams(
        max_tokens=60, sampling=SamplingParams(
            temperature=0.8, seed=i, constraint=Constraint.json_schema(SCHEMAS[0]))))
        for i, p in enumerate(prompts)]
    want = cases.greedy(chat_model, chat_tokenizer, prompts, 10)
    for stream, w in zip(free, want, strict=True):
        ids, _, _ = stream.result()
        assert ids[:len(w)] == w
    for stream in bound:
        ids, text, reason = stream.result()
        assert reason == "stop"
        assert set(json.loads(text)) == {"name", "age", "colour"}
    assert np.isfinite(engine.stats.steps)
