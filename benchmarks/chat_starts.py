"""A first and a second start of ``forge-jax chat``: process start to the first token.

Runs ``forge-jax chat --checkpoint CKPT --compilation-cache DIR`` with one user message on
stdin, in pairs: a first start with ``DIR`` empty (what a new user, or a new model, pays:
tracing, compiling, converting a GGUF file) and then a second start with ``DIR`` as the
first left it (the kept executables of ``generation.compiled_cache`` and, for a GGUF file,
its kept conversion, ``models.checkpoints.gguf_cache``). Each time is from just before the
process is spawned to the first byte of the reply on its stdout; the pairs alternate, so a
change in the host's load reaches both. The C++ CPU kernel built at first use
(``~/.cache/forge_jax/cpu_kernels``) is built once per machine and is not cleared.

Usage::

    python benchmarks/chat_starts.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


def start(checkpoint: str, cache: pathlib.Path, max_new_tokens: int) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to the process's end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge_jax.cli", "chat", "--checkpoint", checkpoint,
         "--compilation-cache", str(cache), "--max-new-tokens", str(max_new_tokens),
         "--no-stats"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdin.write(b"Hi\n")
    proc.stdin.close()
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - t0
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"forge-jax chat failed (exit {proc.returncode})")
    return ttft, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory or .gguf")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    import jax

    print(f"forge-jax chat --checkpoint {args.checkpoint}; jax {jax.__version__}; "
          f"{os.cpu_count()} CPUs")
    ratios = []
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory() as tmp:
            cache = pathlib.Path(tmp) / "cache"
            load = os.getloadavg()[0]
            first = start(args.checkpoint, cache, args.max_new_tokens)
            second = start(args.checkpoint, cache, args.max_new_tokens)
        ratios.append(second[0] / first[0])
        print(f"pair {pair + 1} (load average {load:.1f} -> {os.getloadavg()[0]:.1f}): "
              f"first token {first[0]:6.2f} s (process {first[1]:6.2f} s), second "
              f"{second[0]:6.2f} s (process {second[1]:6.2f} s): {ratios[-1]:.2f}")
    print(f"second / first, median of {len(ratios)}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
