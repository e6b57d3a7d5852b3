"""``forge-jax serve``'s generation features through the ``openai`` client against a live
server of the test checkpoint: logprobs (equal to the model's log-softmax at temperature 0,
ordered), echo, logit bias, structured output that parses and validates (``jsonschema``)
with sampling on, vLLM's guided options, and tool calls (the chat template receives the
tools; ``required`` and named functions give arguments valid for their schema)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cases import serving as cases
from cases.logprobs import reference_logprobs

from forge_jax.text import api as text

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# A ChatML template that lists the tools in a system turn and renders tool calls and
# results, as tool-calling checkpoints' templates do.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools: {% for t in tools %}"
    "{{ t['function']['name'] }} {% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('tool_calls') %}{% for c in message['tool_calls'] %}<tool_call>"
    "{{ c['function']['name'] }} {{ c['function']['arguments'] }}</tool_call>{% endfor %}"
    "{% endif %}{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
    "required": ["zone"], "additionalProperties": False}}}
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
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["point", "tags"], "additionalProperties": False},
]
MESSAGES = [{"role": "user", "content": "Hello there! How"}]


@pytest.fixture(scope="module")
def live(chat_model, chat_tokenizer):
    tokenizer = text.Tokenizer(chat_tokenizer.backend, special_tokens=chat_tokenizer.special_tokens,
                               chat_template=TOOLS_TEMPLATE,
                               generation_config=chat_tokenizer.generation_config)
    server, engine = cases.serve(chat_model, tokenizer)
    yield server, engine, tokenizer
    server.stop()


def test_chat_logprobs_equal_the_models_log_softmax(live, chat_model):
    server, engine, tokenizer = live
    client = server.client()
    ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    r = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    got = r.choices[0].token_ids
    ref = reference_logprobs(chat_model, ids, got)
    content = r.choices[0].logprobs.content
    assert len(content) == len(got)
    for i, entry in enumerate(content):
        np.testing.assert_allclose(entry.logprob, ref[i, got[i]], atol=2e-4, rtol=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        np.testing.assert_allclose(tops, np.sort(ref[i])[::-1][:3], atol=2e-4, rtol=1e-4)
        assert entry.token == tokenizer.decode([got[i]], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
    chunks = list(client.chat.completions.create(
        model=cases.MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    plain = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].token_ids == got


def test_completions_logprobs_and_echo(live, chat_model):
    server, engine, tokenizer = live
    client = server.client()
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=cases.MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    got = choice.token_ids
    assert len(lp.tokens) == len(ids) + len(got)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_logprobs(chat_model, ids[:1], ids[1:] + got)
    np.testing.assert_allclose(lp.token_logprobs[1:],
                               [ref[i, t] for i, t in enumerate(ids[1:] + got)],
                               atol=2e-4, rtol=1e-4)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    pieces = list(client.completions.create(model=cases.MODEL, prompt=prompt, max_tokens=4,
                                            temperature=0, logprobs=0, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert sum((p.choices[0].logprobs.token_logprobs for p in pieces), []) == \
        lp.token_logprobs


def test_logit_bias_and_penalties_change_the_output(live):
    server, _, _ = live
    client = server.client()
    r = client.completions.create(model=cases.MODEL, prompt="Numbers 0123", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    first = r.choices[0].token_ids[0]
    biased = client.completions.create(model=cases.MODEL, prompt="Numbers 0123", max_tokens=4,
                                       temperature=0, logit_bias={str(first): -100},
                                       extra_body={"ignore_eos": True})
    assert biased.choices[0].token_ids[0] != first
    forced = client.completions.create(model=cases.MODEL, prompt="Numbers 0123", max_tokens=4,
                                       temperature=0.8, logit_bias={"7": 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].token_ids == [7] * 4


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_responses_validate_with_sampling(live, schema):
    server, _, _ = live
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model=cases.MODEL, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=cases.MODEL, prompt="Hello", max_tokens=100,
                                  temperature=1.0, seed=5,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_json_object_and_guided_choice(live):
    server, _, _ = live
    client = server.client()
    r = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=100,
                                       temperature=0.7, seed=1,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # (an open object may run to the limit)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    for seed in range(3):
        r = client.chat.completions.create(
            model=cases.MODEL, messages=MESSAGES, max_tokens=10, temperature=1.5, seed=seed,
            extra_body={"guided_choice": ["yes", "no", "not sure"]})
        assert r.choices[0].message.content in ("yes", "no", "not sure")
    chunks = list(client.chat.completions.create(
        model=cases.MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(streamed) == 4 and streamed.isdigit()


def test_an_invalid_grammar_is_a_400_before_any_work(live):
    server, engine, _ = live
    client = server.client()
    before = engine.stats.prompt_tokens
    for extra in ({"guided_regex": "a(b"}, {"guided_grammar": "start: undefined_rule"},
                  {"guided_json": {"type": "nonsense"}},
                  {"guided_regex": "a", "guided_choice": ["b"]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=5,
                                           extra_body=extra)
        assert e.value.body["param"] in extra, e.value.body
    assert engine.stats.prompt_tokens == before and not engine.has_work()


def test_tools_reach_the_template_and_required_calls_validate(live):
    server, _, tokenizer = live
    client = server.client()
    plain = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=1,
                                           temperature=0)
    with_tools = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES,
                                                max_tokens=1, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice="none")
    tools_prompt = tokenizer.encode(tokenizer.apply_chat_template(
        MESSAGES, tools=[WEATHER, TIME]), add_special_tokens=False)
    assert with_tools.usage.prompt_tokens == len(tools_prompt) > plain.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        r = client.chat.completions.create(model=cases.MODEL, messages=MESSAGES, max_tokens=70,
                                           temperature=1.0, seed=seed, tools=[WEATHER, TIME],
                                           tool_choice="required")
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    r = client.chat.completions.create(
        model=cases.MODEL, messages=MESSAGES, max_tokens=70, temperature=1.0, seed=7,
        tools=[WEATHER, TIME], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    chunks = list(client.chat.completions.create(
        model=cases.MODEL, messages=MESSAGES, max_tokens=70, temperature=1.0, seed=7,
        stream=True, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.arguments for c in calls] == [call.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call and its result go back in the conversation.
    back = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model=cases.MODEL, messages=back, max_tokens=3,
                                       temperature=0)
    rendered = tokenizer.encode(tokenizer.apply_chat_template(
        [dict(m, content=m["content"] or "") for m in back]), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(rendered)
