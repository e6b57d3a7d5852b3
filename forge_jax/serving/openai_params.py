"""The parameters of an OpenAI ``/v1/chat/completions`` or ``/v1/completions`` request body,
read with strict JSON types and OpenAI's ranges (:func:`parse`).

Every documented parameter is either honoured or refused: a wrong type or a value out of
range is a 400 naming the parameter (``true`` is not ``"true"``, ``16`` is not ``16.5`` and
not ``"16"``); a parameter this server does not serve yet (``suffix``, ``best_of`` other
than ``n``, ``functions``, audio...) is a 400 saying so when it asks for anything but its
default, never silently ignored. Unknown parameters are a 400 too. Besides OpenAI's
parameters a request may carry vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids`` and ``ignore_eos``, and its structured-output options ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``
(:mod:`forge_jax.serving.openai_features` turns them, ``response_format`` and
``tool_choice`` into a grammar constraint).

Errors are :class:`APIError` (an HTTP status and OpenAI's error body).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from forge_jax.generation.sampling import SamplingParams
from forge_jax.serving import openai_features
from forge_jax.serving.requests import RequestParams

# Deeper JSON than this is refused (no documented parameter nests past a few levels; JSON
# schemas of tools or response formats stay well inside it).
MAX_JSON_DEPTH = 64
# OpenAI's limits.
MAX_STOP = 4
MAX_N = 128
SEED_RANGE = (-2**63, 2**63)
MAX_TOKENS = 2**31 - 1  # (any context is shorter; the engine says how much is left)


class APIError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
    ``headers`` go with the response (``Retry-After`` on a 429)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(name: str, want: str, value) -> APIError:
    return APIError(400, f"{name} must be {want}, got {_show(value)}", param=name)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the JSON types -----------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def integer(low: int | None = None, high: int | None = None):
    """A JSON integer in [low, high] (compared as Python ints: a 401-digit value is out of
    range, not an overflow)."""
    def check(name, v):
        if not _is_int(v) or (low is not None and v < low) or (high is not None and v > high):
            raise _bad(name, f"an integer in [{low}, {'inf' if high is None else high}]", v)
        return v
    return check


def number(low: float, high: float | None, *, low_open: bool = False):
    """A finite JSON number in [low, high] (``(low, high]`` with ``low_open``)."""
    def check(name, v):
        ok = _is_number(v) and math.isfinite(v) and (v > low if low_open else v >= low) and (
            high is None or v <= high)
        if not ok:
            raise _bad(name, f"a number in {'(' if low_open else '['}{low}, "
                             f"{'inf' if high is None else high}]", v)
        return float(v)
    return check


def boolean(name, v):
    if not isinstance(v, bool):
        raise _bad(name, "true or false (a JSON boolean)", v)
    return v


def string(name, v):
    if not isinstance(v, str):
        raise _bad(name, "a string", v)
    return v


def obj(name, v):
    if not isinstance(v, dict):
        raise _bad(name, "an object", v)
    return v


def array(name, v):
    if not isinstance(v, list):
        raise _bad(name, "an array", v)
    return v


def choice(*values):
    def check(name, v):
        if not isinstance(v, str) or v not in values:
            raise _bad(name, f"one of {', '.join(map(repr, values))}", v)
        return v
    return check


def _stop(name, v):
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(
            isinstance(s, str) and s for s in stops):
        raise _bad(name, f"a non-empty string or an array of at most {MAX_STOP} non-empty "
                         f"strings", v)
    return tuple(stops)


def _stream_options(name, v):
    obj(name, v)
    for key in v:
        if key not in ("include_usage", "include_obfuscation"):
            raise APIError(400, f"unknown stream_options field {key!r}; known: include_usage",
                           param=name)
        boolean(f"{name}.{key}", v[key])
    return v


def _logit_bias(name, v):
    obj(name, v)
    for key, bias in v.items():
        if not key.isdigit() or len(key) > 12:
            raise _bad(f"{name} key", "a token id written as a string of digits", key)
        number(-100, 100)(f"{name}[{key!r}]", bias)
    return v


def _metadata(name, v):
    obj(name, v)
    if len(v) > 16 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(x, str)
                              and len(x) <= 512 for k, x in v.items()):
        raise _bad(name, "an object of at most 16 string keys (<= 64 characters) and string "
                         "values (<= 512 characters)", v)
    return v


def _response_format(name, v):
    obj(name, v)
    kind = choice("text", "json_object", "json_schema")(f"{name}.type", v.get("type"))
    if kind == "json_schema":
        schema = obj(f"{name}.json_schema", v.get("json_schema"))
        string(f"{name}.json_schema.name", schema.get("name"))
        if "schema" in schema:
            obj(f"{name}.json_schema.schema", schema["schema"])
    return v


def _tools(name, v):
    array(name, v)
    for i, tool in enumerate(v):
        obj(f"{name}[{i}]", tool)
        choice("function")(f"{name}[{i}].type", tool.get("type"))
        function = obj(f"{name}[{i}].function", tool.get("function"))
        string(f"{name}[{i}].function.name", function.get("name"))
        if function.get("parameters") is not None:
            obj(f"{name}[{i}].function.parameters", function["parameters"])
    return v


def _tool_choice(name, v):
    if isinstance(v, str):
        return choice("none", "auto", "required")(name, v)
    obj(name, v)
    choice("function")(f"{name}.type", v.get("type"))
    string(f"{name}.function.name", obj(f"{name}.function", v.get("function")).get("name"))
    return v


def _strings(name, v):
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise _bad(name, "a non-empty array of non-empty strings", v)
    return v


def _structured_outputs(name, v):
    obj(name, v)
    checks = {"json": lambda n, x: x if isinstance(x, str) else obj(n, x), "regex": string,
              "choice": _strings, "grammar": string, "json_object": boolean}
    for key, x in v.items():
        if key not in checks:
            raise APIError(400, f"unknown {name} field {key!r}; known: "
                                f"{', '.join(checks)}", param=name)
        if x is not None:
            checks[key](f"{name}.{key}", x)
    return v


def _token_ids(name, v):
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise _bad(name, "an array of token ids (integers >= 0)", v)
    return tuple(v)


# -- the parameters -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Param:
    """One request parameter: its check (returns the value to use), the routes that have it,
    and, for one not served yet, a predicate on the checked value that says it asks for
    more than the default (then the request is refused)."""

    check: Callable[[str, Any], Any]
    routes: str = "chat completions"
    refused_if: Callable[[Any], bool] | None = None
    why: str = ""


_NOT_SERVED = "is not supported by this server yet"
PARAMS: dict[str, Param] = {
    "model": Param(string),
    "messages": Param(array, routes="chat"),
    "prompt": Param(lambda n, v: v, routes="completions"),  # read by prompts()
    "max_tokens": Param(integer(1, MAX_TOKENS)),
    "max_completion_tokens": Param(integer(1, MAX_TOKENS), routes="chat"),
    "temperature": Param(number(0, 2)),
    "top_p": Param(number(0, 1)),
    "n": Param(integer(1, MAX_N)),
    "best_of": Param(integer(1, 20), routes="completions"),
    "seed": Param(integer(SEED_RANGE[0], SEED_RANGE[1] - 1)),
    "stop": Param(_stop),
    "stream": Param(boolean),
    "stream_options": Param(_stream_options),
    "user": Param(string),
    "store": Param(boolean, routes="chat", refused_if=bool,
                   why="store: true is not supported: this server stores nothing"),
    "metadata": Param(_metadata, routes="chat"),
    "service_tier": Param(choice("auto", "default", "flex", "scale", "priority"), routes="chat",
                          refused_if=lambda v: v not in ("auto", "default")),
    "safety_identifier": Param(string, routes="chat"),
    "prompt_cache_key": Param(string, routes="chat"),
    "frequency_penalty": Param(number(-2, 2)),
    "presence_penalty": Param(number(-2, 2)),
    "logit_bias": Param(_logit_bias),
    # chat: a boolean; completions: how many top alternatives (0 to 5).
    "logprobs": Param(lambda n, v: v),
    "top_logprobs": Param(integer(0, 20), routes="chat"),
    "echo": Param(boolean, routes="completions"),
    "suffix": Param(string, routes="completions", refused_if=bool),
    "response_format": Param(_response_format),
    "tools": Param(_tools, routes="chat"),
    "tool_choice": Param(_tool_choice, routes="chat"),
    "parallel_tool_calls": Param(boolean, routes="chat"),
    "functions": Param(array, routes="chat", refused_if=bool),
    "function_call": Param(lambda n, v: v, routes="chat",
                           refused_if=lambda v: v != "none"),
    "modalities": Param(array, routes="chat", refused_if=lambda v: v != ["text"],
                        why="modalities: only [\"text\"] is served"),
    "audio": Param(obj, routes="chat", refused_if=lambda v: True),
    "prediction": Param(obj, routes="chat", refused_if=lambda v: True),
    "reasoning_effort": Param(string, routes="chat", refused_if=lambda v: True),
    "verbosity": Param(string, routes="chat", refused_if=lambda v: True),
    "web_search_options": Param(obj, routes="chat", refused_if=lambda v: True),
    # vLLM's sampling extensions (the openai client's extra_body).
    "top_k": Param(integer(-1)),
    "min_p": Param(number(0, 1)),
    "repetition_penalty": Param(number(0, None, low_open=True)),
    "stop_token_ids": Param(_token_ids),
    "ignore_eos": Param(boolean),
    # vLLM's structured outputs: the older top-level names and the newer object.
    "guided_json": Param(lambda n, v: v if isinstance(v, str) else obj(n, v)),
    "guided_regex": Param(string),
    "guided_choice": Param(lambda n, v: _strings(n, v)),
    "guided_grammar": Param(string),
    "structured_outputs": Param(_structured_outputs),
}


def _check_logprobs(chat: bool, v):
    if chat:
        return boolean("logprobs", v)
    return integer(0, 5)("logprobs", v)


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A request body, checked.

    Attributes:
      chat: a chat request (``messages``) or a completions one (``prompts``).
      messages: the conversation, content parts joined into strings (chat).
      prompts: each prompt, a string or a list of token ids (completions).
      n: choices per prompt.
      stream, include_usage: server-sent events; a usage chunk at the end.
      max_tokens: new tokens at most (None: the context left).
      params: the engine's parameters, ``max_tokens`` aside (set per prompt).
      values: every parameter given, checked (what other modules read).
    """

    chat: bool
    messages: list[dict] | None
    prompts: list[str | list[int]] | None
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: RequestParams
    values: dict


def json_depth_ok(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests at most ``limit`` arrays/objects deep (iteratively)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return False
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def parse(body, *, chat: bool, model_name: str, vocab_size: int) -> ParsedRequest:
    """Checks an OpenAI request body (a decoded JSON value) against the route's parameters.

    Raises:
      APIError: 400 naming the first bad, unknown or unserved parameter; 404 for a model
        this server does not serve.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    route = "chat" if chat else "completions"
    for name in body:
        param = PARAMS.get(name)
        if param is None or route not in param.routes.split():
            raise APIError(400, f"unknown parameter {name!r} for /v1/"
                                f"{'chat/completions' if chat else 'completions'}", param=name)
    model = body.get("model")
    if model is not None:
        string("model", model)
        if model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{model_name!r}", param="model", code="model_not_found")
    values = {}
    for name, v in body.items():
        if v is None or name in ("model", "messages", "prompt"):
            continue
        param = PARAMS[name]
        v = _check_logprobs(chat, v) if name == "logprobs" else param.check(name, v)
        if param.refused_if is not None and param.refused_if(v):
            raise APIError(400, param.why or f"{name}={_show(v)} {_NOT_SERVED}", param=name,
                           code="unsupported_parameter")
        values[name] = v
    if chat and "top_logprobs" in values and not values.get("logprobs"):
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n = values.get("n", 1)
    best_of = values.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of={best_of} with n={n} {_NOT_SERVED} (best_of must equal "
                            f"n)", param="best_of", code="unsupported_parameter")
    stream = values.get("stream", False)
    if "stream_options" in values and not stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    max_tokens = values.get("max_completion_tokens", values.get("max_tokens"))
    messages = prompts = None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompts = _prompts(body.get("prompt"), vocab_size)
    return ParsedRequest(chat=chat, messages=messages, prompts=prompts, n=n, stream=stream,
                         include_usage=values.get("stream_options", {}).get("include_usage",
                                                                               False),
                         max_tokens=max_tokens, params=_request_params(values, chat),
                         values=values)


def _request_params(values: dict, chat: bool) -> RequestParams:
    temperature = values.get("temperature", 1.0)
    top_p = values.get("top_p")
    if top_p == 0:  # only the most probable token: greedy
        temperature, top_p = 0.0, None
    top_k = values.get("top_k")
    seed = values.get("seed")
    try:
        features = openai_features.sampling_fields(values, chat=chat)
    except openai_features.FeatureError as e:
        raise APIError(400, str(e), param=e.param) from None
    try:
        sampling = SamplingParams(
            temperature=temperature, top_k=None if top_k in (None, -1, 0) else top_k,
            top_p=top_p, min_p=values.get("min_p"),
            repetition_penalty=values.get("repetition_penalty"), **features)
        return RequestParams(
            max_tokens=1, sampling=sampling, seed=None if seed is None else seed % 2**32,
            stop_token_ids=values.get("stop_token_ids", ()), stop=values.get("stop", ()),
            ignore_eos=values.get("ignore_eos", False))
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _messages(messages) -> list[dict]:
    """The conversation with each message's content a string (text parts joined); other
    parts, and fields this server does not serve, refused."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty array of messages", messages)
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        obj(name, m)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                obj(f"{name}.content[{j}]", part)
                kind = part.get("type")
                if kind != "text":
                    raise APIError(400, f"{name}.content[{j}] is a {kind!r} part; only text "
                                        f"parts are served", param="messages",
                                   code="unsupported_parameter")
                parts.append(string(f"{name}.content[{j}].text", part.get("text")))
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"{name}.content", "a string or an array of text parts", content)
        for key in m:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise APIError(400, f"{name}.{key} {_NOT_SERVED}", param="messages",
                               code="unsupported_parameter")
        if "name" in m:
            string(f"{name}.name", m["name"])
        out.append(dict(m, content="" if content is None else content))
    return out


def _prompts(prompt, vocab_size: int) -> list[str | list[int]]:
    """A completions ``prompt``: a string, an array of strings, an array of token ids or an
    array of arrays of token ids; each one non-empty, token ids inside the vocabulary."""
    one = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt))
    if one:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        prompts = prompt
    else:
        raise _bad("prompt", "a string, an array of strings, an array of token ids or an "
                             "array of arrays of token ids, non-empty", prompt)
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"{where} is empty", param="prompt")
            continue
        if not p or not all(_is_int(t) for t in p):
            raise _bad(where, "a non-empty array of token ids", p)
        bad = next((t for t in p if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{where} has token id {bad}, outside the vocabulary [0, "
                                f"{vocab_size})", param="prompt", code="invalid_token_id")
    return prompts
