"""``forge-jax serve``'s OpenAI-compatible API on loopback, through the ``openai`` client:
greedy outputs equal ``llama.generate``'s, 32 concurrent streams with some cancelled,
OpenAI-shaped errors, metrics, and the command itself."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from cases import serving as cases

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

TEXTS = ["Hello there! How", "The quick brown fox jumps over the lazy dog. The quick",
         "Numbers 0123", "Caf\u00e9 cr\u00e8me", "I am fine, thank you."]


@pytest.fixture(scope="module")
def live(chat_model, chat_tokenizer):
    server, engine = cases.serve(chat_model, chat_tokenizer)
    yield server, engine
    server.stop()


def _post(url, body: bytes):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_and_chat_equal_generate(live, chat_model, chat_tokenizer):
    server, engine = live
    client = server.client()
    prompts = [chat_tokenizer.encode(t) for t in TEXTS[:2]]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    chat_ids = chat_tokenizer.encode(chat_tokenizer.apply_chat_template(messages),
                                     add_special_tokens=False)
    want = cases.greedy(chat_model, chat_tokenizer, prompts + [chat_ids], 16)
    eos = engine.eos
    r = client.completions.create(model=cases.MODEL, prompt=TEXTS[0], max_tokens=16,
                                  temperature=0)
    assert r.choices[0].token_ids == want[0]
    assert r.choices[0].text == cases.reply_text(chat_tokenizer, want[0], eos)
    assert r.usage.prompt_tokens == len(prompts[0]) and r.usage.completion_tokens == len(want[0])
    pieces = list(client.completions.create(model=cases.MODEL, prompt=prompts[1], max_tokens=16,
                                            temperature=0, stream=True))
    assert sum((p.choices[0].token_ids for p in pieces), []) == want[1]
    assert "".join(p.choices[0].text for p in pieces) == cases.reply_text(
        chat_tokenizer, want[1], eos)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=cases.MODEL, messages=messages, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content == cases.reply_text(chat_tokenizer, want[2], eos)
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=cases.MODEL, messages=messages,
                                                 max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want[2])
    assert [m.id for m in client.models.list().data] == [cases.MODEL]


def test_32_concurrent_streams_some_cancelled(live, chat_model, chat_tokenizer):
    server, engine = live
    prompts = [chat_tokenizer.encode(TEXTS[i % 5] + " " + TEXTS[(i * 3) % 5])[:8 + i]
               for i in range(32)]
    want = cases.greedy(chat_model, chat_tokenizer, prompts, 24)
    cancelled = {3, 11, 20, 29}

    def client_run(i):
        client = server.client()
        greedy = i % 4 != 1
        extra = {} if greedy else dict(temperature=0.8, top_p=0.9, seed=i,
                                       extra_body={"top_k": 50, "repetition_penalty": 1.1})
        stream = client.completions.create(
            model=cases.MODEL, prompt=prompts[i], max_tokens=8 + i % 17, stream=True,
            **(dict(temperature=0) if greedy else extra))
        ids, reason = [], None
        for chunk in stream:
            ids += chunk.choices[0].token_ids
            reason = chunk.choices[0].finish_reason
            if i in cancelled and ids:
                stream.response.close()  # the client goes away mid-stream
                return i, greedy, ids, "closed"
        return i, greedy, ids, reason

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client_run, range(32)))
    for i, greedy, ids, reason in results:
        if i in cancelled:
            assert reason == "closed"
            continue
        assert reason in ("stop", "length"), (i, reason)
        if greedy:
            assert ids == want[i][:8 + i % 17], i
        else:
            assert 1 <= len(ids) <= 8 + i % 17
    gauges = cases.wait_idle(engine)
    # No page is held but the prefix cache's, and those are all reclaimable.
    assert gauges["running"] == gauges["waiting"] == 0
    assert gauges["pages_used"] == gauges["pages_cached"] == gauges["pages_reclaimable"]
    assert engine.stats.finished["cancelled"] >= 1
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert "forge_jax_requests_running 0" in metrics
    assert f"forge_jax_pages_used {gauges['pages_used']}" in metrics
    assert "forge_jax_time_to_first_token_seconds_count" in metrics
    hit_rate = float(metrics.split("\nforge_jax_prefix_cache_hit_rate ")[1].split()[0])
    assert hit_rate > 0  # the prompts share prefixes (and the earlier test's)


def test_a_client_that_leaves_before_its_whole_answer_cancels_it(live, chat_tokenizer):
    server, engine = live
    before = dict(engine.stats.finished)
    generated = engine.stats.generated_tokens
    body = json.dumps({"prompt": chat_tokenizer.encode(TEXTS[1]), "max_tokens": 100,
                       "ignore_eos": True, "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while engine.stats.generated_tokens == generated:  # it runs: now leave
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.005)
    gauges = cases.wait_idle(engine)
    assert engine.stats.finished["cancelled"] == before["cancelled"] + 1
    assert engine.stats.finished["length"] == before["length"]  # it did not run to the end
    assert gauges["pages_used"] == gauges["pages_cached"]  # its own pages went back


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "gpt-4", "prompt": "Hi"}', 404, "does not exist"),
    (b'{"prompt": "Hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "Hi", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "Hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": "Hi", "n": 0}', 400, "n must be"),
    (b'{"prompt": "Hi", "wibble": 1}', 400, "wibble"),
    (b'{"prompt": [1, 2, 3], "max_tokens": 200}', 400, "context"),
])
def test_bad_inputs_get_openai_errors(live, body, status, fragment):
    server, _ = live
    code, answer = _post(f"{server.url}/v1/completions", body)
    assert code == status and fragment in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_errors_through_the_client_and_serving_goes_on(live, chat_tokenizer):
    server, engine = live
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=cases.MODEL, messages=[{"role": "robot",
                                                                     "content": "x"}])
    engine.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError, match="max_waiting"):
            client.completions.create(model=cases.MODEL, prompt="Hi", max_tokens=2)
    finally:
        engine.max_waiting = 1024
    code, answer = _post(f"{server.url}/v1/nowhere", b"{}")
    assert code == 404 and "error" in answer
    r = client.completions.create(model=cases.MODEL, prompt="Hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as h:
        assert json.loads(h.read()) == {"status": "ok"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_a_sharded_model_and_shuts_down(chat_checkpoint, chat_tokenizer,
                                                          chat_model):
    port = _free_port()
    command = [sys.executable, "-m", "forge_jax.cli", "serve", "--checkpoint",
               str(chat_checkpoint), "--port", str(port), "--model-name", "m",
               "--max-pages", "64", "--page-size", "8", "--max-model-len", "128",
               "--max-batch-tokens", "32", "--max-seqs", "32", "--mesh", "tp=2", "--no-warm-up"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        r = client.completions.create(model="m", prompt=TEXTS[0], max_tokens=4, temperature=0)
        [want] = cases.greedy(chat_model, chat_tokenizer, [chat_tokenizer.encode(TEXTS[0])], 4)
        assert r.choices[0].token_ids == want  # as unsharded generate's
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert "sharded over tp=2 (2 CPU devices)" in err
    assert "POST /v1/completions 200 prompt=" in err  # one line per request
    assert "shut down: 0 requests in flight finished, 0 cancelled" in err


@pytest.mark.parametrize("flags, fragment", [
    (["--mesh", "tp=3"], "num_attention_heads=4 does not split over a tensor axis of 3"),
    (["--mesh", "tp:2"], "a mesh is written like 'tp=4'"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: invalid choice: 'int4'"),
])
def test_bad_serve_flags_are_one_line(capsys, chat_checkpoint, no_model_load, flags, fragment):
    from cases.cli import assert_one_line_error, run

    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint), *flags),
                          fragment, prog="forge-jax serve")


def test_without_uvicorn_the_command_says_how_to_install_it(monkeypatch, capsys,
                                                             chat_checkpoint, no_model_load):
    from cases.cli import assert_one_line_error, run

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint)),
                          "needs uvicorn, starlette", "pip install", "[serve]",
                          prog="forge-jax serve")
