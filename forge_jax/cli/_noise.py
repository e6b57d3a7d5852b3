"""The libraries' log lines a user cannot act on, kept off ``forge-jax``'s stderr unless
``--verbose``: the C++ log lines of jaxlib, its CUDA plugin and libtpu (``cudart_stub``,
``E0000 ... common_lib.cc``, the absl and InitGoogle preambles, libtpu's host-bounds
warning and source-location traces), JAX's plugin-configuration error on a machine
without the plugin's device, and the compilation cache's ``Resetting cache at``.

They are written to file descriptor 2 by C++ code as well as by Python, so the filter sits
on the descriptor: a pipe read by a thread that passes every other line (and a partial
line, such as chat's ``> `` prompt, as soon as it cannot be the start of a noise line) on to
the real stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

# Whole lines: absl/glog-formatted C++ log lines ("I0000 00:00:1795855961.566213   29304
# cudart_stub.cc:31] ..."), their preambles, libtpu's own lines.
NOISE = re.compile(
    r"[IWEF]\d{4} [\d:.]+\s+\d+ [\w.-]+:\d+\] .*"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    r"STDERR"
    r"|WARNING: Logging before InitGoogle\(\) is written to STDERR"
    r"|=== Source Location Trace: ===\s*"
    r"|learning/\S+:\d+"
    r"|Failed to find host bounds for accelerator type: .*"
    r"|(?:INFO:\S+:)?Resetting cache at .*")
# The first characters of the noise lines: a partial line starting otherwise is passed on
# at once (chat's "> " prompt); one starting so waits for its end of line.
_STARTS = tuple("IWEF=lR")


class _PluginErrors(logging.Filter):
    """JAX's ``Jax plugin configuration error`` (a CUDA plugin without CUDA), with its
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Jax plugin configuration error")


def _forward(read_fd: int, out_fd: int) -> None:
    pending = b""
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        kept = [ln for ln in lines
                if not NOISE.fullmatch(ln.decode(errors="replace").rstrip("\r"))]
        out = b"".join(ln + b"\n" for ln in kept)
        if pending and not pending.decode(errors="replace").startswith(_STARTS):
            out, pending = out + pending, b""
        if out:
            os.write(out_fd, out)
    if pending and not NOISE.fullmatch(pending.decode(errors="replace")):
        os.write(out_fd, pending)


@contextlib.contextmanager
def filtered(enabled: bool = True) -> Iterator[None]:
    """Inside the block, stderr (file descriptor 2, so C++ writes too) without the noise
    lines above; nothing changes when not ``enabled`` or when ``sys.stderr`` is not the
    descriptor (a test's captured stream)."""
    try:
        on_fd2 = enabled and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        on_fd2 = False
    if not on_fd2:
        yield
        return
    xla_bridge = logging.getLogger("jax._src.xla_bridge")
    plugin_filter = _PluginErrors()
    xla_bridge.addFilter(plugin_filter)
    sys.stderr.flush()
    real = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    thread = threading.Thread(target=_forward, args=(read_fd, real), daemon=True,
                              name="forge-jax-stderr-filter")
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the thread reads to its end
        thread.join(timeout=5)
        os.close(read_fd)
        os.close(real)
        xla_bridge.removeFilter(plugin_filter)
