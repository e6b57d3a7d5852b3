"""``forge-jax serve`` as a command: SIGTERM during 8 long streams (each client gets its
final chunk and ``[DONE]``, new requests get 503, the log's counts are true, exit 0, no
traceback); the port, the chat template and the flags checked before the model loads; the
model's id, a GGUF file's own tokenizer and stop tokens, the API key from the environment;
the warm-up before ``/health`` says ready."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from cases import serving as cases
from cases.cli import assert_one_line_error, run

from forge_jax.cli import serve as serve_cli
from forge_jax.models import llama
from forge_jax.serving import http as serving_http
from forge_jax.serving import server as serving_server

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, body: dict, out: dict, first: threading.Event) -> None:
    """Reads one SSE completion: every finish_reason seen and whether ``[DONE]`` came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        out["status"] = response.status
        for line in response:
            line = line.decode().strip()
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                out.setdefault("tokens", []).extend(choice["token_ids"])
                if choice["token_ids"]:
                    first.set()
                if choice["finish_reason"] is not None:
                    out["finish"] = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001  (a cut stream is what the test looks for)
        out["error"] = repr(e)
    finally:
        conn.close()


def test_sigterm_during_8_long_streams(chat_checkpoint):
    port = _free_port()
    command = [sys.executable, "-m", "forge_jax.cli", "serve", "--checkpoint",
               str(chat_checkpoint), "--port", str(port), "--max-pages", "160",
               "--page-size", "8", "--max-model-len", "128", "--max-batch-tokens", "32",
               "--max-seqs", "16", "--no-warm-up", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    threads, signalled = [], False
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        results = [{} for _ in range(8)]
        firsts = [threading.Event() for _ in range(8)]
        for i in range(8):
            body = {"prompt": f"Hello there {i}! How", "max_tokens": 110, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            threads.append(threading.Thread(target=_stream, args=(port, body, results[i],
                                                                  firsts[i])))
            threads[-1].start()
        for event in firsts:  # every stream runs
            assert event.wait(120)
        proc.send_signal(signal.SIGTERM)
        signalled = True
        refused = _probe(port)  # while it drains (the next test checks it without a race)
        for t in threads:
            t.join(120)
    finally:
        if not signalled:
            proc.kill()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    for i, r in enumerate(results):
        assert r.get("status") == 200 and "error" not in r, (i, r)
        assert r.get("done") and r.get("finish") in ("length", "cancelled"), (i, r)
    # Those that finished in the 2 s and those cancelled then (here, on 2 shared cores, about
    # half each; the in-process test below cancels all of them).
    finished = sum(r["finish"] == "length" for r in results)
    cancelled = sum(r["finish"] == "cancelled" for r in results)
    assert f"shut down: {finished} requests in flight finished, {cancelled} cancelled" in err, err
    assert "8 running and 0 waiting get up to 2 s" in err, err
    assert refused in (503, None), refused


def _probe(port: int) -> int | None:
    """A new request's status while the server drains: 503 in OpenAI's shape (None: the
    server had already finished draining and closed)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=b'{"prompt": "Hi"}',
        headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as e:
        assert json.loads(e.read())["error"]["code"] == "shutting_down"
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return None
    return 200


def test_a_second_signal_cancels_every_stream_with_a_final_chunk(
        chat_model, chat_tokenizer, caplog, monkeypatch):
    from forge_jax.serving import batch_step

    step = batch_step.ragged_step

    def slow_step(*args, **kwargs):  # 100 tokens take 5 s at least: the drain lasts
        time.sleep(0.05)
        return step(*args, **kwargs)

    monkeypatch.setattr(batch_step, "ragged_step", slow_step)
    server, engine = cases.serve(chat_model, chat_tokenizer,
                                 server=dict(shutdown_timeout=600.0))
    port = int(server.url.rsplit(":", 1)[1])
    results = [{} for _ in range(4)]
    firsts = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=_stream, args=(port, {
        "prompt": f"Numbers {i}", "max_tokens": 100, "temperature": 0, "stream": True,
        "ignore_eos": True}, results[i], firsts[i])) for i in range(4)]
    with caplog.at_level(logging.INFO):
        for t in threads:
            t.start()
        for event in firsts:
            assert event.wait(120)
        server.server.handle_exit(signal.SIGTERM, None)  # what the signal calls: drain
        deadline = time.monotonic() + 30
        while not server.server.asgi_app.state.stopping:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _probe(port) == 503  # new requests are refused in OpenAI's shape
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.url}/health", timeout=30)
        assert json.loads(health.value.read()) == {"status": "shutting down"}
        assert all(not r.get("done") for r in results)  # nothing ended yet
        server.server.handle_exit(signal.SIGINT, None)  # and again: cancel the rest now
        for t in threads:
            t.join(120)
        server.thread.join(60)
    assert not server.thread.is_alive()  # the server stopped by itself
    for r in results:
        assert r["status"] == 200 and r["done"] and r["finish"] == "cancelled", r
    messages = [r.getMessage() for r in caplog.records]
    assert "shut down: 0 requests in flight finished, 4 cancelled" in messages, messages
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def _capture(monkeypatch):
    """Makes the command return instead of serving; the apps and engines it built."""
    built = []
    monkeypatch.setattr(serving_server, "run",
                        lambda app, sock, **kw: built.append((app, kw["engine"])))
    return built


def test_the_command_builds_an_app_named_after_the_checkpoint_with_the_env_api_key(
        monkeypatch, capsys, chat_checkpoint, chat_model):
    monkeypatch.setattr(llama, "from_pretrained", lambda *a, **kw: chat_model)
    monkeypatch.setenv("FORGE_JAX_API_KEY", "sk-env")
    built = _capture(monkeypatch)
    rc, _, err = run(capsys, "serve", "--checkpoint", str(chat_checkpoint), "--port", "0",
                     "--max-pages", "64", "--no-warm-up")
    assert rc == 0, err
    assert "API key required" in err and re.search(r"on http://127\.0\.0\.1:\d+/v1", err)
    [(app, engine)] = built
    with capsys.disabled():  # (uvicorn's log handlers take the stderr of their making)
        server = cases.LiveServer(app)
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-env", max_retries=0)
        assert [m.id for m in client.models.list().data] == [chat_checkpoint.name]
    finally:
        server.stop()


def test_a_gguf_checkpoint_is_served_with_its_own_tokenizer_and_stop_tokens(
        monkeypatch, capsys, tmp_path):
    from cases import chat_checkpoint, gguf_files

    original = chat_checkpoint.build_tokenizer()
    model = json.loads(original.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = set(chat_checkpoint.SPECIALS)
    config = dict(gguf_files.CONFIG, vocab_size=len(tokens),
                  bos_token_id=tokens.index("<s>"), eos_token_id=tokens.index("<|im_end|>"))
    file = tmp_path / "chat-q.gguf"
    gguf_files.write(file, gguf_files.random_llama(3, config), {}, config=config, tokenizer=dict(
        tokens=tokens, merges=merges, types=[3 if t in specials else 1 for t in tokens],
        chat_template=chat_checkpoint.TEMPLATE))
    built = _capture(monkeypatch)
    rc, _, err = run(capsys, "serve", "--checkpoint", str(file), "--port", "0",
                     "--max-pages", "32", "--page-size", "8", "--max-batch-tokens", "32",
                     "--no-warm-up")
    assert rc == 0, err
    assert "tokenizer: none" not in err
    [(app, engine)] = built
    assert engine.eos == {tokens.index("<|im_end|>")}
    with capsys.disabled():
        server = cases.LiveServer(app)
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["chat-q"]
        r = client.chat.completions.create(model="chat-q", max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert rendered.startswith("<s><|im_start|>user")
        want = original.encode(rendered, add_special_tokens=False).ids
        assert r.usage.prompt_tokens == len(want)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()


def test_a_port_in_use_is_found_before_the_model_loads(capsys, chat_checkpoint, no_model_load):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint),
                                  "--port", str(port)),
                              f"cannot listen on 127.0.0.1:{port}", "in use",
                              prog="forge-jax serve")


def test_a_broken_chat_template_is_found_at_start(capsys, tmp_path, chat_checkpoint,
                                                  no_model_load):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(chat_checkpoint, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content | nofilter }}{% endfor %}"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(broken), "--port", "0"),
                          "the chat template of", "cannot render", prog="forge-jax serve")


@pytest.mark.parametrize("flags, fragment", [
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--header-timeout", "nan"], "--header-timeout must be a finite number"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be"),
    (["--allowed-hosts", " , "], "--allowed-hosts names no host"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_bad_server_flags_are_one_line(capsys, chat_checkpoint, no_model_load, flags,
                                       fragment):
    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(chat_checkpoint), *flags),
                          fragment, prog="forge-jax serve")


def test_health_says_warming_up_until_the_steps_are_compiled(monkeypatch, chat_model,
                                                             chat_tokenizer):
    release = threading.Event()
    real = serving_server.warm_up

    def held(engine, **kwargs):
        release.wait(60)
        return real(engine, **kwargs)

    monkeypatch.setattr(serving_server, "warm_up", held)
    server, engine = cases.serve(chat_model, chat_tokenizer,
                                 http=serving_http.HTTPConfig(warm_up=True))
    try:
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.url}/health", timeout=30)
        assert health.value.code == 503
        assert json.loads(health.value.read()) == {"status": "warming up"}
        with pytest.raises(openai.InternalServerError, match="warming up"):
            server.client().completions.create(model=cases.MODEL, prompt="Hi", max_tokens=2)
        release.set()
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=30) as h:
                    assert json.loads(h.read()) == {"status": "ok"}
                    break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        # Row buckets 8, 16 and 32, greedy and sampled: six variants, compiled before ready;
        # the warm-up's own requests are not counted.
        assert len(engine.stats.compiled) == 6
        assert {key[2] for key in engine.stats.compiled} == {True, False}
        assert engine.stats.generated_tokens == 0 and sum(engine.stats.finished.values()) == 0
        r = server.client().completions.create(model=cases.MODEL, prompt="Hi", max_tokens=2,
                                               temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert serve_cli.default_model_name("ORG/NAME") == "ORG/NAME"
    finally:
        release.set()
        server.stop()
