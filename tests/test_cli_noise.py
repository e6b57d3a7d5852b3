"""The libraries' log lines (jaxlib's C++ logs, the CUDA plugin's configuration error,
libtpu's) are kept off ``forge-jax``'s stderr unless ``--verbose``; everything else, and
chat's prompt without its end of line, passes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from forge_jax.cli import _noise

_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795855961.566213   29304 cudart_stub.cc:31] Could not find cuda drivers on "
    b"your machine, GPU will not be used.",
    b"WARNING: Logging before InitGoogle() is written to STDERR",
    b"E0000 00:00:1795855964.440725   29304 common_lib.cc:554] INVALID_ARGUMENT: Error: "
    b"unexpected worker hostname",
    b"=== Source Location Trace: === ",
    b"learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327",
    b"Failed to find host bounds for accelerator type: WARNING: could not determine TPU",
    b"INFO:jax._src.compilation_cache:Resetting cache at <empty>.",
]


def test_the_filter_drops_the_noise_and_passes_the_rest_at_once():
    read_in, write_in = os.pipe()
    read_out, write_out = os.pipe()
    thread = threading.Thread(target=_noise._forward, args=(read_in, write_out))
    thread.start()
    for line in _LINES[:4]:
        os.write(write_in, line + b"\n")
    os.write(write_in, b"forge-jax generate: error: --top-k must be >= 1, got 0\n")
    os.write(write_in, b"> ")  # chat's prompt: passed before its line ends
    assert os.read(read_out, 1000) == (b"forge-jax generate: error: --top-k must be >= 1, "
                                       b"got 0\n> ")
    for line in _LINES[4:]:
        os.write(write_in, line + b"\n")
    os.write(write_in, b"Exit\n")
    os.close(write_in)
    thread.join(10)
    os.close(write_out)
    assert os.read(read_out, 1000) == b"Exit\n"


_CHILD = """
import sys
import forge_jax.cli
print("--- main", file=sys.stderr, flush=True)  # what JAX's import printed is before
sys.exit(forge_jax.cli.main(sys.argv[1:]))
"""


def _stderr_after_main(*argv):
    result = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True,
                            text=True, timeout=300, env={
                                k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    assert result.returncode == 0, result.stderr
    return result.stderr.split("--- main\n", 1)[1].splitlines()


def test_a_commands_stderr_holds_no_library_noise_unless_verbose():
    argv = ("generate", "--prompt", "12+34=", "--max-new-tokens", "2")
    quiet = _stderr_after_main(*argv)
    assert [ln for ln in quiet if _noise.NOISE.fullmatch(ln)] == [], quiet
    assert not any("Jax plugin configuration error" in ln or "Traceback" in ln
                   for ln in quiet), quiet
    verbose = _stderr_after_main(*argv, "--verbose")
    noisy = [ln for ln in verbose if _noise.NOISE.fullmatch(ln)
             or "Jax plugin configuration error" in ln]
    # The filter only takes lines away; what it took here is the noise --verbose shows
    # (none on a machine whose JAX has no device plugin to fail and no libtpu to warn).
    assert set(quiet) <= set(verbose)
    assert len(quiet) < len(verbose) or not noisy, (quiet, verbose)
