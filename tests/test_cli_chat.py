"""``forge-jax chat`` (stdin in, streamed replies out), ``forge-jax generate``'s streamed
text, generation_config.json and the persistent compilation cache, through
``forge_jax.cli.main`` on the test chat checkpoint."""

from __future__ import annotations

import argparse
import io
import re

import jax
from cases.chat_checkpoint import write_checkpoint

from forge_jax import cli
from forge_jax.cli._compilation_cache import compilation_cache_dir
from forge_jax.text import api as text
from forge_jax.text.chat_session import ChatSession


def run(capsys, monkeypatch, *argv, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_chat_reads_stdin_and_keeps_the_conversation(capsys, monkeypatch, chat_checkpoint,
                                                     chat_model, chat_tokenizer):
    turns = ["Hello there!", "Tell me a story about a robot.", "/reset", "", "Hello there!"]
    rc, out, err = run(capsys, monkeypatch, "chat", "--checkpoint", str(chat_checkpoint),
                       "--max-new-tokens", "8", "--system", "Be brief.", "--temperature", "0",
                       stdin="\n".join(turns) + "\n")
    assert rc == 0, err
    session = ChatSession(chat_model, chat_tokenizer,
                          system="Be brief.", max_new_tokens=8)
    first, second = session.send(turns[0]), session.send(turns[1])
    session.reset()
    third = session.send(turns[4])
    assert out == f"{first}\n{second}\n{third}\n"
    assert third == first  # /reset started over
    assert "[conversation reset]" in err
    kept = [int(n) for n in re.findall(r"\((\d+) kept in the cache\)", err)]
    assert len(kept) == 3 and kept[0] == 0 and kept[1] > 0 and kept[2] == 0, err
    lines = re.findall(r"\[(compiled in [\d.]+ s, then )?first token \d+ ms; prefilled \d+ of "
                       r"\d+ tokens", err)
    assert len(lines) == 3 and lines[0] and not lines[1], err  # compile reported apart


def test_chat_context_full_and_errors(capsys, monkeypatch, tmp_path, chat_checkpoint):
    rc, out, err = run(capsys, monkeypatch, "chat", "--checkpoint", str(chat_checkpoint),
                       "--max-context", "40", "--max-new-tokens", "30",
                       stdin="Hi\nTell me a story about a small robot who learns to paint.\n")
    assert rc == 0, err
    assert "[context full: the reply stopped at 40 tokens" in err
    assert re.search(r"\[context full: the conversation with this message has \d+ tokens and "
                     r"the context holds 40", err), err
    plain = write_checkpoint(tmp_path / "plain", chat_template=False)
    for argv, fragment in [(["--checkpoint", str(plain)], "has no chat template"),
                           (["--checkpoint", str(chat_checkpoint), "--top-p", "0"], "--top-p"),
                           (["--checkpoint", str(chat_checkpoint), "--min-p", "2"], "--min-p"),
                           (["--checkpoint", str(chat_checkpoint), "--repetition-penalty", "0"],
                            "--repetition-penalty"),
                           (["--checkpoint", str(tmp_path / "missing")], "does not exist")]:
        rc, out, err = run(capsys, monkeypatch, "chat", *argv, stdin="Hi\n")
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("forge-jax chat: error: ") and fragment in err, err


def test_generate_streams_text_and_reports_time_to_first_token(capsys, monkeypatch, chat_checkpoint,
                                                               chat_model, chat_tokenizer):
    args = ("generate", "--checkpoint", str(chat_checkpoint), "--prompt", "Hello there",
            "--max-new-tokens", "10")
    rc, out, err = run(capsys, monkeypatch, *args)
    assert rc == 0, err
    expected = text.generate_text(chat_model, chat_tokenizer, "Hello there",
                                  max_new_tokens=10)
    lines = out.splitlines()
    assert lines[1] == "Hello there" + expected  # streamed, after the description line
    assert f"completion: {expected!r}" in out
    assert re.search(r"^time to first token: [\d.]+ ms", out, re.M)
    rc, out, err = run(capsys, monkeypatch, *args, "--no-stream")
    assert rc == 0 and not any(line == "Hello there" + expected for line in out.splitlines())


def test_generate_uses_generation_config(capsys, monkeypatch, tmp_path, chat_model,
                                         chat_tokenizer):
    greedy = text.generate_ids(chat_model, chat_tokenizer, [chat_tokenizer.encode("Hello there")],
                               max_new_tokens=10)[1][0]
    stop = next(i for i, t in enumerate(greedy) if i > 0 and t not in greedy[:i])
    path = write_checkpoint(tmp_path / "g", generation_config={
        "eos_token_id": greedy[stop], "max_new_tokens": 10})
    rc, out, err = run(capsys, monkeypatch, "generate", "--checkpoint", str(path),
                       "--prompt", "Hello there")
    assert rc == 0, err
    assert f"generated ids: {greedy[:stop + 1]}" in out


def test_compilation_cache_is_written_and_jax_is_restored(capsys, monkeypatch, tmp_path,
                                                          chat_checkpoint):
    cache = tmp_path / "jax_cache"
    before = jax.config.jax_compilation_cache_dir
    # Every chat runs the same two steps (the prefill in chunks of one shape): forget the
    # ones the tests before compiled, so that this run compiles and writes them.
    jax.clear_caches()
    rc, out, err = run(capsys, monkeypatch, "chat", "--checkpoint", str(chat_checkpoint),
                       "--max-new-tokens", "2", "--compilation-cache", str(cache), stdin="Hi\n")
    assert rc == 0, err
    # the prefill kept as an executable of its own (generation.compiled_cache)
    assert any(p.name.startswith("prefill-") for p in (cache / "steps").iterdir())
    assert jax.config.jax_compilation_cache_dir == before
    # A second run in this process compiles nothing (jit's own cache): where the cache
    # goes is checked on the resolver.
    def where(**flags):
        args = argparse.Namespace(**(dict(no_compilation_cache=False, compilation_cache=None)
                                     | flags))
        return compilation_cache_dir(args)

    monkeypatch.setenv("FORGE_JAX_COMPILATION_CACHE", str(tmp_path / "from_env"))
    assert where() == tmp_path / "from_env"
    assert where(compilation_cache=str(cache)) == cache
    assert where(no_compilation_cache=True) is None
    for off in ("off", "0", ""):
        monkeypatch.setenv("FORGE_JAX_COMPILATION_CACHE", off)
        assert where() is None
    monkeypatch.delenv("FORGE_JAX_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert where() == tmp_path / "xdg" / "forge_jax" / "jax"
