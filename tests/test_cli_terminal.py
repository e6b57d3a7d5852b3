"""``forge-jax`` in a real terminal (a pseudo-terminal from the ``pty`` module): the
progress bar never writes over a completion streaming to the same terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import tty

import pytest

from forge_jax.text import api as text

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pty")


def _read_all(fd) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def run_in_terminal(*argv, stdout_to_terminal=True, timeout=300):
    """``python -m forge_jax.cli ARGV`` with stderr (and stdout, unless piped) on a raw
    pseudo-terminal (no newline translation); returns (rc, terminal text, piped stdout)."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forge_jax.cli", *argv], stdin=subprocess.DEVNULL,
            stdout=slave if stdout_to_terminal else subprocess.PIPE, stderr=slave)
    finally:
        os.close(slave)
    # The terminal is read to its end first (a full pty buffer would block the child).
    screen = _read_all(master).decode("utf-8", "replace")
    os.close(master)
    piped = proc.stdout.read().decode("utf-8", "replace") if proc.stdout else ""
    return proc.wait(timeout=timeout), screen, piped


@pytest.fixture(scope="module")
def prompt_run(chat_checkpoint, chat_model, chat_tokenizer):
    argv = ("generate", "--checkpoint", str(chat_checkpoint), "--prompt", "Hello there",
            "--max-new-tokens", "24")
    expected = "Hello there" + text.generate_text(chat_model, chat_tokenizer, "Hello there",
                                                  max_new_tokens=24)
    return argv, expected


def test_streamed_completion_on_the_terminal_has_no_bar_over_it(prompt_run):
    argv, expected = prompt_run
    rc, screen, _ = run_in_terminal(*argv)
    assert rc == 0, screen
    assert "generating [" not in screen, screen
    assert expected + "\n" in screen, (expected, screen)  # streamed whole, in one piece
    # Asked for, the bar gives way too, and says so.
    rc, screen, _ = run_in_terminal(*argv, "--progress")
    assert rc == 0 and "generating [" not in screen, screen
    assert "no progress bar while the completion streams to this terminal" in screen, screen


def test_bar_on_the_terminal_when_the_completion_goes_elsewhere(prompt_run):
    argv, expected = prompt_run
    rc, screen, piped = run_in_terminal(*argv, stdout_to_terminal=False)
    assert rc == 0, screen
    assert "generating [" in screen and "24/24 tokens" in screen, screen
    assert expected + "\n" in piped, piped
    rc, screen, _ = run_in_terminal(*argv, "--no-stream")  # nothing streams: the bar shows
    assert rc == 0 and "generating [" in screen, screen
