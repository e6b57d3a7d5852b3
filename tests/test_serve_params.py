"""Every request parameter of ``forge-jax serve``'s OpenAI API honoured or refused, on one
live server: each documented parameter with a wrong JSON type and with a value out of
OpenAI's range is a 400 in OpenAI's shape naming it; parameters not served yet are refused,
not ignored; ``n``, several prompts, ``seed``, ``stop`` and the default ``max_tokens`` are
honoured; and the client inputs that used to be plain-text 500s (a lone surrogate, a
401-digit ``max_tokens``, deeply nested JSON, ``stream_options`` that is not an object, a
chat template raising on the messages) are 4xx while the server keeps serving."""

from __future__ import annotations

import copy
import json
import threading
import urllib.error
import urllib.request

import pytest
from cases import serving as cases

from forge_jax.serving import openai_params

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")


class CountingTokenizer:
    """The checkpoint's tokenizer, counting the texts it encodes and naming the threads that
    encode them."""

    def __init__(self, tokenizer):
        self.inner, self.encoded, self.threads = tokenizer, 0, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, **kwargs):
        self.encoded += 1
        self.threads.add(threading.current_thread().name)
        return self.inner.encode(text, **kwargs)


@pytest.fixture(scope="module")
def live(chat_model, chat_tokenizer):
    tokenizer = CountingTokenizer(chat_tokenizer)
    e = cases.engine(chat_model, tokenizer)
    from forge_jax.serving import http as serving_http

    server = cases.LiveServer(serving_http.create_app(e, model_name=cases.MODEL,
                                                      tokenizer=tokenizer))
    yield server, e, tokenizer
    server.stop()


def post(server, route: str, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{server.url}/v1/{route}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def assert_error(answer: dict, status: int, code: int, *fragments, param=None):
    assert code == status, (code, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == {
        "message", "type", "param", "code"}, answer
    for fragment in fragments:
        assert fragment in answer["error"]["message"], (fragment, answer)
    if param is not None:
        assert (answer["error"]["param"] or "").startswith(param), answer


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TEXT = {"prompt": "Hi", "max_tokens": 2}
# Every documented parameter: (routes, a value of the wrong JSON type, a value of the right
# type out of OpenAI's range or not served (None: the type is the whole range)).
WALK = {
    "model": ("chat completions", 5, "gpt-4"),  # an unknown model: 404
    "messages": ("chat", "Hi", []),
    "prompt": ("completions", 5, ""),
    "max_tokens": ("chat completions", "16", 0),
    "max_completion_tokens": ("chat", 1.5, 0),
    "temperature": ("chat completions", "0", 2.5),
    "top_p": ("chat completions", "1", 1.5),
    "n": ("chat completions", 2.0, 129),
    "best_of": ("completions", "1", 21),
    "seed": ("chat completions", "1", 2**63),
    "stop": ("chat completions", 5, ["a", "b", "c", "d", "e"]),
    "stream": ("chat completions", "no", None),
    "stream_options": ("chat completions", "usage", {"include_usage": "yes"}),
    "user": ("chat completions", 5, None),
    "store": ("chat", "false", True),
    "metadata": ("chat", ["k"], {"k": 5}),
    "service_tier": ("chat", 5, "turbo"),
    "safety_identifier": ("chat", 5, None),
    "prompt_cache_key": ("chat", 5, None),
    "frequency_penalty": ("chat completions", "0", 2.5),
    "presence_penalty": ("chat completions", "0", -3),
    "logit_bias": ("chat completions", ["5"], {"5": 101}),
    "logprobs": ("chat completions", "true", None),
    "top_logprobs": ("chat", "1", 21),
    "echo": ("completions", "false", None),
    "suffix": ("completions", 5, None),
    "response_format": ("chat completions", "json", {"type": "xml"}),
    "tools": ("chat", {"type": "function"}, [{"type": "retrieval"}]),
    "tool_choice": ("chat", 5, "sometimes"),
    "parallel_tool_calls": ("chat", "true", None),
    "functions": ("chat", {"name": "f"}, None),
    "function_call": ("chat", None, "auto"),
    "modalities": ("chat", "text", ["audio"]),
    "audio": ("chat", "alloy", {"voice": "alloy"}),
    "prediction": ("chat", "x", {"type": "content"}),
    "reasoning_effort": ("chat", 5, "high"),
    "verbosity": ("chat", 5, "low"),
    "web_search_options": ("chat", "x", {}),
    "top_k": ("chat completions", "5", -2),
    "min_p": ("chat completions", "0.1", 1.5),
    "repetition_penalty": ("chat completions", "1", 0),
    "stop_token_ids": ("chat completions", "1", [-1]),
    "ignore_eos": ("chat completions", "false", None),
    "guided_json": ("chat completions", 5, None),
    "guided_regex": ("chat completions", 5, None),
    "guided_choice": ("chat completions", "a", []),
    "guided_grammar": ("chat completions", ["x"], None),
    "structured_outputs": ("chat completions", "json", {"xml": "x"}),
}
# Values each unserved parameter is refused with (its type and range are right).
NOT_SERVED = {"suffix": "end", "best_of": 3, "store": True, "functions": [{"name": "f"}]}


def test_the_walk_covers_every_parameter():
    assert set(WALK) == set(openai_params.PARAMS)


@pytest.mark.parametrize("name", sorted(WALK))
def test_every_parameter_with_a_wrong_type_and_out_of_range(live, name):
    server, engine, _ = live
    routes, wrong, out = WALK[name]
    for route in routes.split():
        base = dict(CHAT if route == "chat" else TEXT)
        path = "chat/completions" if route == "chat" else "completions"
        cases_ = [wrong] + ([out] if out is not None else [])
        if name == "logprobs":
            cases_ = ["true"] + ([6] if route == "completions" else [1])
        for value in cases_:
            if value is None:
                continue
            body = dict(base, **{name: value})
            if name == "top_logprobs":
                body["logprobs"] = True
            code, answer, _ = post(server, path, body)
            want = 404 if name == "model" and value == out else 400
            if name == "top_logprobs":  # (logprobs itself is refused first: not served)
                assert_error(answer, 400, code)
                continue
            assert_error(answer, want, code, param=name if name not in (
                "messages", "prompt") else None)
    assert engine.stats.finished["stop"] + engine.stats.finished["length"] >= 0
    assert not engine.has_work()  # nothing was submitted


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_parameters_not_served_yet_are_refused_not_ignored(live, name):
    server, _, _ = live
    route = "chat" if "chat" in WALK[name][0] else "completions"
    values = NOT_SERVED[name]
    if name == "logprobs":
        values = values[0] if route == "chat" else values[1]
    body = dict(CHAT if route == "chat" else TEXT, **{name: values})
    if name == "top_logprobs":
        body["logprobs"] = True
    if name == "best_of":
        body["n"] = 2
    code, answer, _ = post(server, "chat/completions" if route == "chat" else "completions",
                           body)
    assert_error(answer, 400, code, "not supported", param=None)
    assert answer["error"]["code"] == "unsupported_parameter"


def test_defaults_of_unserved_parameters_are_accepted(live):
    server, _, _ = live
    body = dict(CHAT, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, logprobs=False,
                response_format={"type": "text"}, tool_choice="none", store=False,
                user="u", metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=True,
                modalities=["text"], temperature=0, stop=[], seed=None)
    code, answer, _ = post(server, "chat/completions", body)
    assert code == 200, answer
    body = dict(TEXT, echo=False, suffix="", logprobs=None, best_of=1, temperature=0)
    code, answer, _ = post(server, "completions", body)
    assert code == 200, answer


def test_n_and_several_prompts_seed_stop_and_max_tokens(live, chat_model, chat_tokenizer):
    server, engine, _ = live
    client = server.client()
    texts = ["Hello there! How", "Numbers 0123"]
    want = cases.greedy(chat_model, chat_tokenizer, [chat_tokenizer.encode(t) for t in texts], 6)
    r = client.completions.create(model=cases.MODEL, prompt=texts, n=2, max_tokens=6,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in r.choices] == [want[0], want[0], want[1], want[1]]
    lengths = [len(chat_tokenizer.encode(t)) for t in texts]
    assert r.usage.prompt_tokens == sum(lengths)
    assert r.usage.completion_tokens == 2 * len(want[0]) + 2 * len(want[1])
    # Streamed: every choice's tokens, chunks interleaved by index.
    chunks = list(client.completions.create(model=cases.MODEL, prompt=texts[0], n=3,
                                            max_tokens=6, temperature=0, stream=True))
    by_index = {}
    for c in chunks:
        by_index.setdefault(c.choices[0].index, []).extend(c.choices[0].token_ids)
    assert by_index == {0: want[0], 1: want[0], 2: want[0]}
    # A seed gives the same samples again; its n choices differ from each other.
    sampled = [client.completions.create(model=cases.MODEL, prompt=texts[0], n=2, seed=7,
                                         max_tokens=8, temperature=1.5, extra_body={
                                             "ignore_eos": True})
               for _ in range(2)]
    assert [c.token_ids for c in sampled[0].choices] == [c.token_ids for c in sampled[1].choices]
    assert sampled[0].choices[0].token_ids != sampled[0].choices[1].token_ids
    # A stop string ends the text before it.
    full = client.completions.create(model=cases.MODEL, prompt=texts[0], max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), text
    cut = client.completions.create(model=cases.MODEL, prompt=texts[0], max_tokens=12,
                                    temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]
    # Without max_tokens: the context the prompt leaves (128 tokens here).
    r = client.completions.create(model=cases.MODEL, prompt=texts[1], temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == engine.max_model_len


RELIABILITY = [
    # (route, raw body, status, fragment)
    ("completions", json.dumps({"prompt": "1+\ud800="}).encode(), 400, "lone surrogate"),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": "a\udfffb"}]}
                                    ).encode(), 400, "lone surrogate"),
    ("completions", b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 400 + b"}", 400,
     "max_tokens must be an integer in [1, 2147483647], got 1000"),
    ("completions", b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nests JSON"),
    ("completions", b'{"prompt": "Hi", "x": ' + b"[" * 80 + b"]" * 80 + b"}", 400,
     "deeper than 64"),
    ("completions", b'{"prompt": "Hi", "stream": true, "stream_options": "yes"}', 400,
     "stream_options must be an object"),
    ("completions", b'{"prompt": "Hi", "stream_options": {"include_usage": true}}', 400,
     "stream_options needs stream: true"),
    ("chat/completions", json.dumps({"messages": [{"role": "assistant", "content": "Hi"}]}
                                    ).encode(), 400, "must not start with the assistant"),
    ("completions", json.dumps({"prompt": [5, 100000]}).encode(), 400, "outside the vocab"),
    ("completions", b'{"prompt": "Hi", "stream": "no"}', 400, "stream must be true or false"),
    ("completions", b'{"prompt": "Hi", "ignore_eos": "false"}', 400, "ignore_eos must be"),
    ("completions", b"[1, 2]", 400, "must be a JSON object"),
    ("completions", b"\xff\xfe{", 400, "not valid JSON"),
]


@pytest.mark.parametrize("route, body, status, fragment", RELIABILITY,
                         ids=[case[3].split()[0] + f"-{i}" for i, case in enumerate(RELIABILITY)])
def test_client_inputs_are_4xx_in_openai_shape(live, route, body, status, fragment):
    server, engine, _ = live
    code, answer, _ = post(server, route, body)
    assert_error(answer, status, code, fragment)
    assert not engine.has_work()  # nothing was left running (stream_options: no orphan)
    code, answer, _ = post(server, "completions", dict(TEXT, temperature=0))
    assert code == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_out_of_vocabulary_ids_are_not_a_context_error(live):
    server, _, _ = live
    code, answer, _ = post(server, "completions", {"prompt": [[1, 2], [3, 10**6]]})
    assert_error(answer, 400, code, "prompt[1] has token id 1000000")
    assert answer["error"]["code"] == "invalid_token_id"


def test_text_longer_than_the_context_is_refused_before_tokenizing(live):
    server, _, tokenizer = live
    before = tokenizer.encoded
    code, answer, _ = post(server, "completions", {"prompt": "ab " * 400_000})
    assert_error(answer, 400, code, "1200000 characters", "context of 128 tokens")
    assert answer["error"]["code"] == "context_length_exceeded"
    code, answer, _ = post(server, "chat/completions", {"messages": [
        {"role": "user", "content": "x" * 600_000}, {"role": "user", "content": "y" * 600_000}]})
    assert_error(answer, 400, code, "1200000 characters")
    assert tokenizer.encoded == before  # neither was tokenized
    # A prompt that fits in characters but not in tokens is refused with the token count.
    code, answer, _ = post(server, "completions", {"prompt": "Hello there! " * 40})
    assert_error(answer, 400, code, "context", param="prompt")


def test_429_says_when_to_retry(live):
    server, engine, _ = live
    engine.max_waiting = 0
    try:
        code, answer, headers = post(server, "completions", TEXT)
    finally:
        engine.max_waiting = 1024
    assert_error(answer, 429, code, "max_waiting")
    assert headers["Retry-After"] == "1"


def test_text_is_tokenized_off_the_event_loop(live):
    server, _, tokenizer = live
    tokenizer.threads.clear()
    for route, body in (("completions", TEXT), ("chat/completions", CHAT)):
        code, answer, _ = post(server, route, body)
        assert code == 200, answer
    assert tokenizer.threads and all(name.startswith("forge-jax-tokenize")
                                     for name in tokenizer.threads), tokenizer.threads


def test_a_chat_template_raising_at_render_time_is_a_400(chat_model, chat_tokenizer):
    from forge_jax.serving import http as serving_http

    broken = copy.copy(chat_tokenizer)  # adds a number to the text: Jinja raises TypeError
    broken.chat_template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    engine = cases.engine(chat_model, broken)
    server = cases.LiveServer(serving_http.create_app(engine, model_name=cases.MODEL,
                                                      tokenizer=broken))
    try:
        code, answer, _ = post(server, "chat/completions", CHAT)
        assert_error(answer, 400, code, "cannot be rendered", "TypeError", param="messages")
        code, answer, _ = post(server, "completions", dict(TEXT, temperature=0))
        assert code == 200, answer
    finally:
        server.stop()
