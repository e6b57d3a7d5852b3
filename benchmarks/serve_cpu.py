"""The serving engine's throughput and time to first token on CPU, against sequential
``llama.generate`` in the same process.

Builds a Llama with random weights in SmolLM2-135M's shape (``--quick``: a tiny one) and
sends bursts of ``concurrency`` requests straight to :class:`forge_jax.serving.engine.Engine`
(no HTTP: this measures the engine's batching, not uvicorn), each a ``--prompt-tokens``
prompt (random ids; the first ``--shared-tokens`` the same in every prompt, a system
prompt) and ``--new-tokens`` greedy tokens without eos. Reports per concurrency and with the
prefix cache on and off: output tokens/s over the burst, the speed-up over sequential
``generate`` of the same requests one at a time, and time to first token p50 / p99 (from
``submit`` to the first token reaching the caller). Every shape is compiled before timing.

On a shared machine, ``--repeats N`` interleaves the contenders: each round times sequential
``generate`` and then every row once, and each row reports its best round and the ratio of
the best rates (the load average and a memory-bandwidth probe, :func:`bandwidth_probe`, are
printed at the start and the end). ``--phases`` adds
where the engine's step loop spent its time at each row (``EngineStats.phase_seconds``).
``--overlap off`` runs the engine with ``overlap=False`` (each step's tokens read before the
next step is scheduled), ``--overlap both`` adds those rows beside the default ones.

Usage::

    python benchmarks/serve_cpu.py [--concurrency 1 4 16 64] [--repeats 3] [--phases]
    python benchmarks/serve_cpu.py --quick     # tiny shape, seconds: a smoke test
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from _cpu import QUICK, SMOL, random_llama

from forge_jax.models import llama
from forge_jax.serving import engine as serving


def prompts_for(n: int, args, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, args.shared_tokens).tolist()
    return [shared + rng.integers(3, vocab, args.prompt_tokens - args.shared_tokens).tolist()
            for _ in range(n)]


def sequential(model, prompts, new_tokens: int) -> float:
    """Output tokens/s of ``generate`` over the prompts one at a time (compiled first)."""
    start = time.perf_counter()
    for p in prompts:
        llama.generate(model, [p], new_tokens, eos_token_id=())
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def bandwidth_probe(vocab: int, hidden: int, rows: int = 16) -> float:
    """Milliseconds of a ``[rows, hidden] x [vocab, hidden]^T`` product (the shape's vocabulary
    projection), best of 5: a probe of the machine's memory bandwidth. Other tenants of a
    shared host can halve it without moving the load average, and the memory-bound sequential
    baseline then slows more than batched decode, which inflates the ratios: compare the
    probe at the start and the end of a run, and across runs."""
    x, w = jnp.ones((rows, hidden), jnp.float32), jnp.ones((vocab, hidden), jnp.float32)
    product = jax.jit(lambda x, w: x @ w.T)
    product(x, w).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        product(x, w).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def burst(engine, prompts, new_tokens: int) -> tuple[float, list[float]]:
    """Output tokens/s of one burst of requests, and each request's time to first token.

    Each stream is read by its own thread, as by concurrent clients: a single reader going
    through the streams one after another would see stream k's first token only once
    streams 0 .. k-1 had ended, and report about the burst's length for every request."""
    params = serving.RequestParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    streams = [(time.perf_counter(), engine.submit(p, params)) for p in prompts]
    ttft = [float("nan")] * len(streams)

    def read(i: int, submitted: float, stream) -> None:
        for out in stream:
            if out.token_ids and ttft[i] != ttft[i]:  # NaN: no token yet
                ttft[i] = time.perf_counter() - submitted

    readers = [threading.Thread(target=read, args=(i, *s)) for i, s in enumerate(streams)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    return len(prompts) * new_tokens / (time.perf_counter() - start), ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape: a smoke test")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--shared-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--sequential-requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved rounds; each row reports its best")
    parser.add_argument("--phases", action="store_true",
                        help="also print the engine's seconds per step phase, per row")
    parser.add_argument("--no-prefix-cache-off", dest="cache_off", action="store_false",
                        help="only the rows with the prefix cache on")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                        help="the engine's overlap (both: a row for each)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's weights and compute (from_pretrained's default on "
                             "CPU: float32)")
    parser.add_argument("--layers", type=int, default=None,
                        help="fewer layers than the shape's (a faster run on a loaded machine)")
    args = parser.parse_args()
    shape = dict(QUICK if args.quick else SMOL)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    model = random_llama(shape, jnp.dtype(args.dtype))
    vocab = model.config.vocab_size
    seq_prompts = prompts_for(args.sequential_requests, args, vocab, 0)
    llama.generate(model, seq_prompts[:1], args.new_tokens, eos_token_id=())  # compile
    max_len = args.prompt_tokens + args.new_tokens
    overlaps = {"on": (True,), "off": (False,), "both": (True, False)}[args.overlap]
    rows = [(caching, c, overlap) for caching in ((True, False) if args.cache_off else (True,))
            for c in args.concurrency for overlap in overlaps]
    engines = {}
    for caching, c, overlap in rows:  # every variant compiled before the first timed round
        pages = c * -(-max_len // 16) + 64
        engine = serving.Engine(model, None, serving.EngineConfig(
            max_batch_tokens=args.max_batch_tokens, max_seqs=max(args.concurrency),
            num_pages=pages, max_model_len=max_len, prefix_caching=caching, eos_token_ids=(),
            overlap=overlap)).start()
        burst(engine, prompts_for(c, args, vocab, 1), args.new_tokens)
        engines[caching, c, overlap] = engine
    load = os.getloadavg()
    probe = bandwidth_probe(vocab, shape["hidden_size"])
    seq, best = 0.0, {}
    for round_ in range(args.repeats):
        seq = max(seq, sequential(model, seq_prompts, args.new_tokens))
        for row in rows:
            engine, c = engines[row], row[1]
            engine.prefix_cache.clear()  # each burst meets only its own prefix
            before = dict(getattr(engine.stats, "phase_seconds", {}))  # older engines: none
            rate, ttft = burst(engine, prompts_for(c, args, vocab, 2 + round_),
                               args.new_tokens)
            phases = {k: v - before[k] for k, v in before and engine.stats.phase_seconds.items()}
            if rate > best.get(row, (0.0,))[0]:
                best[row] = (rate, ttft, phases)
    for engine in engines.values():
        engine.shutdown()
    print(f"# JAX {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"{'quick' if args.quick else 'SmolLM2-135M shape'}, "
          f"{shape['num_hidden_layers']} layers, {args.dtype}; prompts of "
          f"{args.prompt_tokens} tokens ({args.shared_tokens} shared), {args.new_tokens} new "
          f"tokens each, greedy; max {args.max_batch_tokens} tokens per step; best of "
          f"{args.repeats} interleaved rounds; load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"# memory-bandwidth probe (a 16-row vocabulary product): {probe:.2f} ms at the "
          f"start, {bandwidth_probe(vocab, shape['hidden_size']):.2f} ms at the end")
    print(f"sequential generate: {seq:.1f} tokens/s")
    print("| prefix cache | overlap | concurrency | tokens/s | x sequential | TTFT p50 (s) "
          "| TTFT p99 (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    onoff = {True: "on", False: "off"}
    for caching, c, overlap in rows:
        rate, ttft, _ = best[caching, c, overlap]
        print(f"| {onoff[caching]} | {onoff[overlap]} | {c} | {rate:.1f} | {rate / seq:.2f} | "
              f"{np.percentile(ttft, 50):.3f} | {np.percentile(ttft, 99):.3f} |")
    if args.phases:
        print("\nseconds per phase of the best burst (EngineStats.phase_seconds):")
        for caching, c, overlap in rows:
            phases = best[caching, c, overlap][2]
            print(f"  cache {onoff[caching]}, overlap {onoff[overlap]}, concurrency {c}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))


if __name__ == "__main__":
    main()
