"""Controlling ``forge-jax chat``: Ctrl-C during a reply stops that reply
and the conversation goes on with it; Ctrl-C at the prompt, ``/exit`` and ``/quit`` end the
chat cleanly; an unknown ``/command`` is reported, not sent to the model; on a terminal,
``readline`` edits lines and keeps a history; a chat template that raises, and an empty
``--system``, are one-line errors before the model loads."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest
from cases.chat_checkpoint import write_checkpoint

from forge_jax import cli
from forge_jax.models import llama
from forge_jax.text.chat_session import ChatSession


class Lines:
    """stdin that gives ``lines``, then raises KeyboardInterrupt (Ctrl-C at the prompt) or
    ends (``then=None``)."""

    def __init__(self, *lines, then=KeyboardInterrupt):
        self.lines, self.then = [f"{line}\n" for line in lines], then

    def isatty(self):
        return False

    def readline(self):
        if self.lines:
            return self.lines.pop(0)
        if self.then is not None:
            raise self.then
        return ""


class CtrlCOnPiece(io.StringIO):
    """stdout that sends this process SIGINT (Ctrl-C) as reply piece number ``n`` arrives."""

    def __init__(self, n):
        super().__init__()
        self.n, self.pieces = n, 0

    def write(self, text):
        written = super().write(text)
        if text and text != "\n":
            self.pieces += 1
            if self.pieces == self.n:
                signal.raise_signal(signal.SIGINT)
        return written


def chat(capsys, monkeypatch, *argv, stdin, stdout=None):
    monkeypatch.setattr("sys.stdin", stdin)
    if stdout is not None:
        monkeypatch.setattr("sys.stdout", stdout)
    try:
        # Greedy (the checkpoint's generation_config.json sets no do_sample, so chat would
        # sample): the replies are compared with a greedy session's.
        rc = cli.main(["chat", "--temperature", "0", *argv])
    except KeyboardInterrupt:  # not pytest's to handle: it would end the whole run
        pytest.fail("Ctrl-C escaped forge-jax chat as KeyboardInterrupt")
    out, err = capsys.readouterr()
    return rc, (stdout.getvalue() if stdout is not None else out), err


def test_ctrl_c_during_a_reply_stops_it_and_the_conversation_goes_on(
        capsys, monkeypatch, chat_checkpoint, chat_model, chat_tokenizer):
    first, second = "Tell me a story about a small robot.", "Hello there!"
    # (SIG_IGN where the run itself was started in the background, as by nohup)
    handler = signal.getsignal(signal.SIGINT)
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                        "--max-new-tokens", "40", stdin=Lines(first, second, then=None),
                        stdout=CtrlCOnPiece(2))
    assert rc == 0, err
    # The same conversation through the Python API: two pieces of the first reply, then
    # its stream closed; the second turn follows it.
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=40)
    whole = list(ChatSession(chat_model, chat_tokenizer, max_new_tokens=40).stream(first))
    assert len(whole) > 2, whole  # the reply was cut short, not finished
    stream = session.stream(first)
    kept = [next(stream), next(stream)]
    stream.close()
    assert out == "".join(kept) + "\n" + session.send(second) + "\n", (out, kept)
    assert err.count("[reply stopped; the conversation keeps it as far as it got]") == 1, err
    # The second turn reused the cache the stopped one left.
    reused = [int(n) for n in re.findall(r"\((\d+) kept in the cache\)", err)]
    assert len(reused) == 2 and reused[1] > 0, err
    assert signal.getsignal(signal.SIGINT) is handler  # restored


def test_ctrl_c_at_the_prompt_ends_cleanly(capsys, monkeypatch, chat_checkpoint):
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                        "--max-new-tokens", "4", "--no-stats", stdin=Lines("Hello there!"))
    assert rc == 0 and "Traceback" not in err, err
    assert len(out.splitlines()) == 1, out  # the one reply


@pytest.mark.parametrize("command", ["/exit", "/quit", "  /quit  "])
def test_exit_and_quit_end_the_chat(capsys, monkeypatch, chat_checkpoint, command):
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                        "--max-new-tokens", "4", "--no-stats",
                        stdin=Lines("Hello there!", command, "Hello again!"))
    assert rc == 0, err
    assert len(out.splitlines()) == 1, out  # nothing after the command


def test_unknown_commands_are_reported_not_sent(capsys, monkeypatch, chat_checkpoint,
                                                chat_model, chat_tokenizer):
    lines = ["/foo", "/reset now", "/help", "//etc holds the configuration", "/usr/bin is a path"]
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                        "--max-new-tokens", "6", "--no-stats", stdin=Lines(*lines, then=None))
    assert rc == 0, err
    assert "[unknown command /foo: not sent to the model; /reset, /help, /exit, /quit are " \
           "known, and // sends a message that starts with /]" in err, err
    assert "[/reset takes no arguments, got 'now']" in err, err
    assert "  /reset  start the conversation over" in err and "  /exit   end the chat" in err
    # Two messages reached the model: the one escaped with //, and the path.
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=6)
    expected = [session.send("/etc holds the configuration"), session.send("/usr/bin is a path")]
    assert out == "".join(f"{reply}\n" for reply in expected), (out, expected)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded the model before refusing the input")

    monkeypatch.setattr(llama, "from_pretrained", refuse)


def _with_template(directory, template):
    write_checkpoint(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) | {"chat_template": template}
    config_file.write_text(json.dumps(config))
    return directory


REFUSES_SYSTEM = ("{% if messages[0]['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}"
                  "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                  "{% endfor %}")


@pytest.mark.parametrize("template, argv, fragments", [
    (REFUSES_SYSTEM, ["--system", "Be brief."],
     ["--system: the chat template of", "refuses a system message", "System role not supported"]),
    ("{{ raise_exception('This model cannot chat') }}", [],
     ["cannot render a conversation", "This model cannot chat"]),
    ("{% if %}oops{% endif %}", [], ["cannot render a conversation", "the chat template failed"]),
    (None, ["--system", ""], ["--system is empty ('')"]),
    (None, ["--system", "  "], ["--system is empty ('  ')"]),
])
def test_template_errors_and_an_empty_system_message_before_loading(
        capsys, monkeypatch, tmp_path, no_model_load, chat_checkpoint, template, argv, fragments):
    ckpt = chat_checkpoint if template is None else _with_template(tmp_path / "ckpt", template)
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(ckpt), *argv,
                        stdin=Lines("Hello there!", then=None))
    assert rc == 2 and out == "", (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("forge-jax chat: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_a_template_that_refuses_only_a_system_message_chats_without_one(
        capsys, monkeypatch, tmp_path):
    ckpt = _with_template(tmp_path / "ckpt", REFUSES_SYSTEM)
    rc, out, err = chat(capsys, monkeypatch, "--checkpoint", str(ckpt), "--max-new-tokens", "3",
                        "--no-stats", stdin=Lines("Hello there!", then=None))
    assert rc == 0 and len(out.splitlines()) == 1, (out, err)


@pytest.mark.skipif(sys.platform == "win32" or importlib.util.find_spec("readline") is None,
                    reason="needs a POSIX pty and readline")
def test_readline_history_on_a_terminal(chat_checkpoint):
    """Up-arrow brings back the last line (readline's history), so an unknown command typed
    once and recalled is reported twice; without readline the arrow's escape sequence would
    be sent to the model as a message."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "forge_jax.cli", "chat", "--checkpoint",
                             str(chat_checkpoint), "--max-new-tokens", "4", "--no-stats"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    screen = b""

    def read_until(pattern, timeout=120):
        nonlocal screen
        deadline = time.monotonic() + timeout
        while not re.search(pattern, screen) and time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                screen += os.read(master, 4096)
            except OSError:  # the child has closed the terminal
                break
        return re.search(pattern, screen)

    try:
        assert read_until(rb"> "), screen  # the model loaded; the prompt is up
        os.write(master, b"/foo\r")
        assert read_until(rb"unknown command /foo"), screen
        os.write(master, b"\x1b[A\r")  # up-arrow: the last line again
        assert read_until(rb"(?s)unknown command /foo.*unknown command /foo", timeout=30), screen
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=60) == 0, screen
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert b"Traceback" not in screen, screen


# A chat whose model load never ends on its own (a large checkpoint): it says when the load
# has started, then waits. Ctrl-C reaches it as in a terminal: a process started in the
# background of a non-interactive shell (a CI runner's `cmd &`) inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler.
_SLOW_LOAD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from forge_jax import cli
from forge_jax.models import llama

def slow_load(*args, **kwargs):
    print("loading", flush=True)
    time.sleep(120)

llama.from_pretrained = slow_load
sys.exit(cli.main(["chat", "--checkpoint", sys.argv[1]]))
"""


def test_ctrl_c_while_the_model_loads_is_one_line_and_exit_code_130(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "chat")
    child = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD, str(checkpoint)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert child.stdout.readline().strip() == "loading"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [line for line in err.splitlines() if line.strip()][-1] == \
        "forge-jax chat: interrupted"
