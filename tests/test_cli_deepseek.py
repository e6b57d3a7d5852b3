"""DeepSeek-V3, a model of its own (not a LlamaConfig), through ``forge-jax generate``,
``chat`` and ``serve`` on a random checkpoint transformers wrote: the tokens each command
gives equal those of :func:`forge_jax.generation.generate` in Python; ``export`` and
``compile`` (Llama-family steps only) refuse it in one line naming the model type."""

from __future__ import annotations

import re

import pytest
from cases.cli import assert_one_line_error, run

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)

from cases.hf_families import save_checkpoint  # noqa: E402
from test_deepseek import CONFIG  # noqa: E402

from forge_jax import generation  # noqa: E402
from forge_jax.models import deepseek  # noqa: E402
from forge_jax.text import api as text  # noqa: E402

PROMPT = [5, 17, 3, 44, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_files):
    tokenizer, vocab = tokenizer_files
    directory = tmp_path_factory.mktemp("deepseek_v3")
    save_checkpoint(directory, "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(CONFIG, vocab_size=vocab), seed=0, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="module")
def model(checkpoint):
    return deepseek.from_pretrained(checkpoint)


def _ids(line_start: str, out: str) -> list[int]:
    [line] = [line for line in out.splitlines() if line.startswith(line_start)]
    return [int(t) for t in re.findall(r"-?\d+", line.split(":", 1)[1])]


def test_generate_gives_the_python_tokens(capsys, checkpoint, model):
    rc, out, err = run(capsys, "generate", "--checkpoint", str(checkpoint), "--prompt-ids",
                       ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
                       "--no-compilation-cache")
    assert rc == 0, err
    assert f"{checkpoint}: deepseek_v3, 3 layers, hidden 64, 8 experts (top 2)" in out
    [want] = generation.generate(model, [PROMPT], 6, eos_token_id=())
    assert _ids("generated ids:", out) == want


def test_generate_quantized_gives_the_python_tokens(capsys, checkpoint):
    """``--quantize int4 --group-size 16``: the ids of Python's ``generate`` on the model
    ``from_pretrained(quantize=, group_size=)`` loads; a group size that does not divide
    DeepSeek-V3's own in features (the latent ranks, the experts') is refused first."""
    from forge_jax.models import llama

    args = ("generate", "--checkpoint", str(checkpoint), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--no-compilation-cache",
            "--quantize", "int4")
    rc, out, err = run(capsys, *args, "--group-size", "16")
    assert rc == 0, err
    assert "int4 linear layers" in out, out
    quantized = llama.from_pretrained(checkpoint, quantize="int4", group_size=16)
    [want] = generation.generate(quantized, [PROMPT], 6, eos_token_id=())
    assert _ids("generated ids:", out) == want
    assert_one_line_error(run(capsys, *args, "--group-size", "24"),
                          "--group-size 24", "[32, 64, 96]")


def test_generate_on_a_mesh_gives_the_python_tokens(capsys, checkpoint, model):
    """``--mesh dp=2,tp=2`` (conftest's CPU devices): checked by DeepSeek-V3's own sharding
    rules before loading (a tensor axis wider than the heads refused in one line), the
    tokens of the one-device model."""
    args = ("generate", "--checkpoint", str(checkpoint), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--no-compilation-cache")
    assert_one_line_error(run(capsys, *args, "--mesh", "tp=8"), "--mesh tp=8",
                          "{'num_attention_heads': 4}")
    rc, out, err = run(capsys, *args, "--mesh", "dp=2,tp=2")
    assert rc == 0, err
    assert "sharded over dp=2 x tp=2" in out, out
    [want] = generation.generate(model, [PROMPT], 6, eos_token_id=())
    assert _ids("generated ids:", out) == want


def test_chat_gives_the_python_reply(capsys, monkeypatch, checkpoint, model):
    import io

    from forge_jax.text.chat_session import ChatSession

    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    rc, out, err = run(capsys, "chat", "--checkpoint", str(checkpoint), "--max-new-tokens",
                       "5", "--temperature", "0", "--no-compilation-cache")
    assert rc == 0, err
    session = ChatSession(model, text.load_tokenizer(checkpoint), max_new_tokens=5)
    reply = session.send("hello there")
    assert len(session.tokenizer.encode(reply)) > 0 and out == f"{reply}\n", (reply, out)


def test_serve_answers_one_request_with_the_python_tokens(checkpoint, model):
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge_jax.cli", "serve", "--checkpoint", str(checkpoint),
         "--port", str(port), "--max-pages", "32", "--page-size", "4", "--max-model-len",
         "64", "--no-warm-up", "--no-compilation-cache"],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        body = json.dumps({"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 6,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "deepseek_v3, 3 layers" in err and "Traceback" not in err, err
    [want] = generation.generate(model, [PROMPT], 6, eos_token_id=())
    assert choice["token_ids"] == want, choice


# compile refuses a missing compiler (the aot extra) first: its case runs with the target tests.
@pytest.mark.parametrize("command", [
    ["export", "--out", "OUT"],
    pytest.param(["compile", "--target", "h100"], marks=pytest.mark.target("h100"))])
def test_export_and_compile_refuse_it_naming_the_model_type(capsys, tmp_path, checkpoint,
                                                            command):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    assert_one_line_error(run(capsys, *argv, "--checkpoint", str(checkpoint)),
                          "is a deepseek_v3 model", f"{command[0]} builds Llama-family",
                          prog=f"forge-jax {command[0]}")
