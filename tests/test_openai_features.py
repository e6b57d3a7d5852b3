"""The OpenAI-shape conversions of the server's generation features: which sampling fields
and grammar a request's parameters ask for, tool calls parsed out of replies, and the
``logprobs`` objects of both endpoints."""

from __future__ import annotations

import json

import pytest

from forge_jax.generation.sampling import TokenLogprob
from forge_jax.serving import openai_features as features

llguidance = pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}}}}


def test_sampling_fields_of_the_parameters():
    fields = features.sampling_fields(
        {"presence_penalty": 0.5, "frequency_penalty": 0, "logit_bias": {"12": -100},
         "logprobs": True, "top_logprobs": 3}, chat=True)
    assert fields == {"presence_penalty": 0.5, "logit_bias": {12: -100.0}, "logprobs": 3}
    assert features.sampling_fields({"logprobs": False}, chat=True) == {}
    assert features.sampling_fields({"logprobs": 0}, chat=False) == {"logprobs": 0}
    assert features.sampling_fields({"logprobs": 2}, chat=False) == {"logprobs": 2}


@pytest.mark.parametrize("values, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "json_schema"),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "array"}}, "json_schema"),
    ({"guided_regex": "[a-z]+"}, "regex"),
    ({"guided_choice": ["a", "b"]}, "choice"),
    ({"guided_grammar": 'start: "x"'}, "grammar"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice"),
    ({"structured_outputs": {"json_object": True}}, "json_object"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "json_schema"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, None),
    ({"tools": [WEATHER]}, None),
])
def test_the_constraint_a_request_asks_for(values, kind):
    found = features.constraint(values)
    assert (found and found.kind) == kind


def test_constraint_conflicts_and_bad_values_name_the_parameter():
    with pytest.raises(features.FeatureError, match="one structured-output option") as e:
        features.constraint({"guided_regex": "a", "guided_choice": ["b"]})
    assert e.value.param == "guided_choice"
    with pytest.raises(features.FeatureError, match="choices") as e:
        features.constraint({"guided_choice": []})
    assert e.value.param == "guided_choice"
    with pytest.raises(features.FeatureError, match="not among the tools"):
        features.constraint({"tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}})
    with pytest.raises(features.FeatureError, match="needs tools"):
        features.constraint({"tool_choice": "required"})


def test_tool_constraints_describe_the_calls():
    named = features.tool_constraint({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})
    assert named == TIME["function"]["parameters"]
    required = features.tool_constraint({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert [c["properties"]["name"] for c in required["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]


def test_tool_calls_parsed_from_replies():
    values = {"tools": [WEATHER, TIME]}
    content, calls = features.tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', values)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = features.tool_calls('{"name": "get_time", "parameters": {"zone": "utc"}}',
                                         values)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "utc"}
    assert features.tool_calls("Just text.", values) == ("Just text.", [])
    assert features.tool_calls('{"name": "unknown", "arguments": {}}', values)[1] == []
    assert features.tool_calls("<tool_call>x</tool_call>", {"tools": [WEATHER],
                                                             "tool_choice": "none"})[1] == []
    named = {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "get_weather"}}}
    content, calls = features.tool_calls('{"city": "Rome"}', named)
    assert content is None and calls[0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city": "Rome"}'}


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join({1: "Hel", 2: "lo", 3: " w\u00e9", 4: "!"}[i] for i in ids)


def test_logprobs_objects_have_openais_shapes():
    entries = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))),
               TokenLogprob(3, -2.0, ((4, -0.25), (3, -2.0)))]
    chat = features.chat_logprobs(_Tokenizer(), entries)
    assert chat["content"][1] == {
        "token": " w\u00e9", "logprob": -2.0, "bytes": list(" w\u00e9".encode()),
        "top_logprobs": [{"token": "!", "logprob": -0.25, "bytes": [33]},
                         {"token": " w\u00e9", "logprob": -2.0,
                          "bytes": list(" w\u00e9".encode())}]}
    text = features.completion_logprobs(_Tokenizer(), [TokenLogprob(2, None)] + entries,
                                        offset=5)
    assert text == {"tokens": ["lo", "Hel", " w\u00e9"], "token_logprobs": [None, -0.5, -2.0],
                    "top_logprobs": [None, {"Hel": -0.5, "lo": -1.5},
                                     {"!": -0.25, " w\u00e9": -2.0}],
                    "text_offset": [5, 7, 10]}
