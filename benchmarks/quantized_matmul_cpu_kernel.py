"""The CPU quantized-matmul kernel's loop on one core, without JAX or threads, against
another version of it, alternated in one run.

Builds ``quantized_matmul_cpu_kernel.cc`` (beside this script) around a version of
``forge_jax/ops/quantized_matmul_cpu.cc`` with the flags the package builds it with
(``-O3 -march=native``), runs each build in turn ``--rounds`` times and keeps each
figure's best round. For a decode step's product shapes (SmolLM2-135M's Q4_1 GGUF, one
row of activations): ns per group of 32 weights with the weight in cache (the loop's
instructions: stable on a loaded host), and the microseconds and GB/s streaming it from
memory; then the machine's memory read bandwidth on 1 and 2 threads (a decode step reads
96.5 MB of that file's weights: bandwidth / 96.5 MB is the step's floor).

Usage::

    python benchmarks/quantized_matmul_cpu_kernel.py                   # this checkout
    python benchmarks/quantized_matmul_cpu_kernel.py --against main    # and main's kernel
    python benchmarks/quantized_matmul_cpu_kernel.py --against old.cc --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import subprocess
import tempfile

import _cpu  # noqa: F401  (puts the repository root on sys.path)
import jax

from forge_jax.ops import quantized_matmul_cpu as cpu

HERE = pathlib.Path(__file__).resolve().parent
DRIVER = HERE / "quantized_matmul_cpu_kernel.cc"


def _source(against: str, tmp: pathlib.Path) -> pathlib.Path:
    """A file, or the kernel's source at a git revision of this repository."""
    if pathlib.Path(against).is_file():
        return pathlib.Path(against).resolve()
    text = subprocess.run(["git", "show", f"{against}:forge_jax/ops/quantized_matmul_cpu.cc"],
                          cwd=HERE, capture_output=True, text=True, check=True).stdout
    out = tmp / f"kernel-{against.replace('/', '_')}.cc"
    out.write_text(text)
    return out


def _build(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    cxx = cpu._compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler ($CXX, c++, g++ or clang++)")
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", f"-I{jax.ffi.include_dir()}",
           f'-DKERNEL_SOURCE="{source}"', str(DRIVER), "-o", str(out), "-pthread"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def _run(binary: pathlib.Path) -> dict[str, tuple[float, str]]:
    lines = subprocess.run([str(binary)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return {name: (float(value), unit) for name, value, unit in (ln.split() for ln in lines)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None,
                        help="another kernel source: a file or a git revision (e.g. main)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; jax {jax.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        builds = {"this checkout": _build(cpu._SOURCE, tmp / "this")}
        if args.against:
            builds[args.against] = _build(_source(args.against, tmp), tmp / "against")
        best: dict[tuple[str, str], float] = {}
        units: dict[str, str] = {}
        for _ in range(args.rounds):
            for name, binary in builds.items():
                for figure, (value, unit) in _run(binary).items():
                    units[figure] = unit
                    keep = max if unit == "GB/s" else min
                    best[name, figure] = keep(best.get((name, figure), value), value)
    names = list(builds)
    print(f"\n| best of {args.rounds} rounds | " + " | ".join(names)
          + (" | ratio |" if len(names) > 1 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) > 1)))
    for figure, unit in units.items():
        values = [best[n, figure] for n in names]
        ratio = f" | {values[0] / values[1]:.3f}" if len(values) > 1 else ""
        print(f"| {figure} ({unit}) | " + " | ".join(f"{v:.3f}" for v in values) + ratio + " |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
