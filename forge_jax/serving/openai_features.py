"""The OpenAI API's generation features in OpenAI's shapes, for the HTTP server
(:mod:`forge_jax.serving.http`): what a request's checked parameters ask of the sampling
(penalties, logit bias, logprobs, a grammar constraint from ``response_format``, vLLM's
``guided_*``/``structured_outputs`` or ``tool_choice``), the ``logprobs`` objects of a
response, and the tool calls parsed out of a reply.

* :func:`sampling_fields`: the :class:`~forge_jax.generation.SamplingParams` fields a
  request's parameters set beyond temperature and the filters.
* :func:`constraint`: the grammar a request asks for, if any (one at most).
* :func:`chat_logprobs` / :func:`completion_logprobs`: the ``logprobs`` of a choice or
  chunk, from the engine's :class:`~forge_jax.generation.sampling.TokenLogprob` entries.
* :func:`tool_calls`: a reply's text as OpenAI's ``tool_calls`` (Hermes' ``<tool_call>``
  tags, or the JSON object a constrained reply is).

Errors are :class:`FeatureError` (a ValueError naming the parameter): the server answers
them 400 in OpenAI's shape.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence

from forge_jax.generation.sampling import MAX_LOGPROBS, TokenLogprob

# vLLM's names of the structured-output options: the older top-level ``guided_*`` and the
# newer ``structured_outputs`` object's keys.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class FeatureError(ValueError):
    """A parameter this module cannot serve as given (``param`` names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _constraints():
    from forge_jax.generation import constraints

    return constraints


def sampling_fields(values: Mapping, *, chat: bool) -> dict:
    """The :class:`~forge_jax.generation.SamplingParams` fields that ``values`` (a request's
    checked parameters) set: ``presence_penalty``, ``frequency_penalty``, ``logit_bias``
    (its string keys as ids), ``logprobs`` (chat: ``top_logprobs`` when ``logprobs`` is
    true; completions: the ``logprobs`` count) and ``constraint`` (:func:`constraint`)."""
    fields = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if values.get(name):
            fields[name] = float(values[name])
    if values.get("logit_bias"):
        fields["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
    logprobs = values.get("logprobs")
    if chat and logprobs:
        fields["logprobs"] = int(values.get("top_logprobs") or 0)
    elif not chat and logprobs is not None and logprobs is not False:
        fields["logprobs"] = int(logprobs)
    if fields.get("logprobs", 0) > MAX_LOGPROBS:
        raise FeatureError(f"at most {MAX_LOGPROBS} alternatives per token, got "
                           f"{fields['logprobs']}", "logprobs")
    found = constraint(values)
    if found is not None:
        fields["constraint"] = found
    return fields


def constraint(values: Mapping):
    """The :class:`~forge_jax.generation.constraints.Constraint` a request asks for:
    ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark) or their newer
    ``structured_outputs`` object, or ``tool_choice`` ``"required"`` or a named function
    (:func:`tool_constraint`). None: free text. :class:`FeatureError` when two are given
    or one is malformed (the grammar itself is checked by the engine)."""
    found = []
    fmt = values.get("response_format")
    if fmt and fmt.get("type") == "json_object":
        found.append(("response_format", ("json_object", None)))
    elif fmt and fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        found.append(("response_format", ("json_object", None) if schema is None
                      else ("json", schema)))
    for name, kind in GUIDED.items():
        if values.get(name) is not None:
            found.append((name, (kind, values[name])))
    structured = values.get("structured_outputs")
    if structured:
        if not isinstance(structured, Mapping):
            raise FeatureError(f"structured_outputs must be an object, got "
                               f"{structured!r:.80}", "structured_outputs")
        for key, value in structured.items():
            if key not in STRUCTURED_KEYS:
                raise FeatureError(f"structured_outputs.{key} is not served; known: "
                                   f"{', '.join(STRUCTURED_KEYS)}", "structured_outputs")
            if value is not None and value is not False:
                found.append(("structured_outputs",
                              ("json_object", None) if key == "json_object" else (key, value)))
    tool = tool_constraint(values)
    if tool is not None:
        found.append(("tool_choice", ("json", tool)))
    if len(found) > 1:
        raise FeatureError(f"one structured-output option at most, got "
                           f"{', '.join(name for name, _ in found)}", found[1][0])
    if not found:
        return None
    name, (kind, value) = found[0]
    c = _constraints()
    try:
        if kind == "json_object":
            return c.Constraint.json_object()
        if kind == "json":
            return c.Constraint.json_schema(value)
        if kind == "regex":
            return c.Constraint.regex(value)
        if kind == "choice":
            return c.Constraint.choice(value)
        return c.Constraint.grammar(value)
    except c.ConstraintError as e:
        raise FeatureError(str(e), name) from None


# -- tools ----------------------------------------------------------------------------------

def _functions(values: Mapping) -> dict[str, dict]:
    """name -> the function's JSON schema of its arguments, from ``tools``."""
    out = {}
    for tool in values.get("tools") or ():
        function = tool.get("function") or {}
        out[function.get("name")] = function.get("parameters") or {"type": "object"}
    return out


def tool_choice(values: Mapping) -> str | None:
    """``"none"``, ``"auto"``, ``"required"`` or the named function's name; None without
    tools. (OpenAI's default: ``"auto"`` when there are tools.)"""
    if not values.get("tools"):
        if values.get("tool_choice") not in (None, "none"):
            raise FeatureError("tool_choice needs tools", "tool_choice")
        return None
    choice = values.get("tool_choice", "auto")
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        if name not in _functions(values):
            raise FeatureError(f"tool_choice names the function {name!r}, which is not among "
                               f"the tools ({', '.join(map(repr, _functions(values)))})",
                               "tool_choice")
        return name
    return choice


def tool_constraint(values: Mapping) -> dict | None:
    """The JSON schema a reply follows under ``tool_choice``: ``"required"``, a call
    ``{"name": ..., "arguments": {...}}`` of one of the tools (its arguments valid for its
    schema); a named function, that function's arguments object. None otherwise."""
    choice = tool_choice(values)
    if choice in (None, "none", "auto"):
        return None
    functions = _functions(values)
    if choice != "required":
        return functions[choice]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, schema in functions.items()]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def template_variables(values: Mapping) -> dict:
    """The chat template's extra variables: ``tools`` (the request's list, as transformers
    passes it) when there are tools."""
    return {"tools": list(values["tools"])} if values.get("tools") else {}


_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call(name: str, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parse_call(text: str, functions: Mapping) -> dict | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, Mapping) or call.get("name") not in functions:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return _call(call["name"], arguments)


def tool_calls(text: str, values: Mapping) -> tuple[str | None, list[dict]]:
    """A reply's ``(content, tool_calls)`` under the request's ``tool_choice``.

    A named function: the reply is its arguments. ``"required"``: the reply is one call
    object. ``"auto"``: the calls in Hermes' ``<tool_call>{"name": ..., "arguments": ...}
    </tool_call>`` tags (the text outside them is the content, None if blank), or a reply
    that is such an object whole (Llama 3's form; ``"parameters"`` read as the
    arguments). ``"none"`` or no tools: ``(text, [])``.
    """
    choice = tool_choice(values)
    if choice in (None, "none"):
        return text, []
    functions = _functions(values)
    if choice not in ("auto", "required"):
        return None, [_call(choice, text)]
    tagged = _TOOL_CALL_TAG.findall(text)
    calls = [c for c in (_parse_call(t, functions) for t in tagged) if c is not None]
    if calls:
        content = _TOOL_CALL_TAG.sub("", text).strip()
        return content or None, calls
    call = _parse_call(text.strip(), functions)
    if call is not None:
        return None, [call]
    return text, []


# -- logprobs -------------------------------------------------------------------------------

def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _entry(tokenizer, token: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``."""
    return {"content": [dict(_entry(tokenizer, e.token, e.logprob),
                             top_logprobs=[_entry(tokenizer, t, v) for t, v in e.top])
                        for e in entries]}


def completion_logprobs(tokenizer, entries: Sequence[TokenLogprob], *,
                        offset: int = 0) -> dict:
    """A completion choice's (or chunk's) ``logprobs``: ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}``; an entry whose ``logprob`` is None (the prompt's
    first token, echoed) has a null log-probability and alternatives. ``offset``: the text
    offset of the first token (the characters before it in the choice's text)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text = _token_text(tokenizer, e.token)
        tokens.append(text)
        values.append(e.logprob)
        tops.append(None if e.logprob is None else {
            _token_text(tokenizer, t): v for t, v in e.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def constraint_param(values: Mapping) -> str | None:
    """The parameter that asked for a request's grammar (for a 400 naming it)."""
    for name in ("response_format", *GUIDED, "structured_outputs", "tool_choice"):
        if values.get(name) is not None:
            return name
    return None


# -- a choice's fields ----------------------------------------------------------------------

class Choice:
    """The OpenAI fields of one choice, streamed or whole: its text (``echo``'s prompt
    first), its ``logprobs`` if asked for, and its tool calls.

    Args:
      values: the request's checked parameters.
      tokenizer: the checkpoint's :class:`~forge_jax.text.Tokenizer` (the tokens' text).
      chat: a chat completion (``message``/``delta``) or a text one (``text``).
      echo: completions' echoed prompt: ``(text, entries)``, ``entries`` the prompt's
        :class:`TokenLogprob` (None without logprobs).
    """

    def __init__(self, values: Mapping, tokenizer, *, chat: bool,
                 echo: tuple[str, list | None] | None = None):
        self.values, self.tokenizer, self.chat = values, tokenizer, chat
        asked = values.get("logprobs")
        self.logprobs = asked is not None and asked is not False  # (0 is a count: asked)
        self.echo = echo
        # With tools the reply is read whole before it is sent (a call is parsed from it).
        self.tools = chat and tool_choice(values) not in (None, "none")
        self.text: list[str] = []
        self.offset = 0  # characters of text sent so far (completions' text_offset)

    def _logprobs(self, entries) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, entries)
        return completion_logprobs(self.tokenizer, entries, offset=self.offset)

    def piece(self, text: str, entries, reason: str | None) -> dict:
        """A streamed chunk's choice fields (``delta`` or ``text``, ``logprobs``,
        ``finish_reason``) for the new ``text`` and its tokens' ``entries``."""
        if not self.chat:
            if self.echo is not None:  # the prompt goes first, once
                (prompt, prompt_entries), self.echo = self.echo, None
                text = prompt + text
                entries = (prompt_entries or []) + list(entries)
            fields = {"text": text, "logprobs": self._logprobs(entries), "finish_reason": reason}
            self.offset += len(text)
            return fields
        if not self.tools:
            return {"delta": {"content": text}, "logprobs": self._logprobs(entries),
                    "finish_reason": reason}
        self.text.append(text)
        if reason is None:
            return {"delta": {}, "logprobs": self._logprobs(entries), "finish_reason": None}
        content, calls = tool_calls("".join(self.text), self.values)
        delta: dict = {"content": content}
        if calls:
            delta["tool_calls"] = [dict(c, index=j) for j, c in enumerate(calls)]
            reason = "tool_calls" if reason == "stop" else reason
        return {"delta": delta, "logprobs": self._logprobs(entries), "finish_reason": reason}

    def whole(self, text: str, entries, reason: str | None) -> dict:
        """A whole choice's fields (``message`` or ``text``, ``logprobs``,
        ``finish_reason``)."""
        if not self.chat:
            return self.piece(text, entries, reason)
        message: dict = {"role": "assistant", "content": text}
        if self.tools:
            content, calls = tool_calls(text, self.values)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"message": message, "logprobs": self._logprobs(entries),
                "finish_reason": reason}
