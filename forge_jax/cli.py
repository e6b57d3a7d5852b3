"""The ``forge-jax`` command line: ``info``, ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
import sys
import time


def _info(args: argparse.Namespace) -> int:
    from forge_jax import backends

    print(backends.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    """A short tour: each op once, checked against NumPy, with the implementation used."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import forge_jax as fj
    from forge_jax import dispatch

    key = iter(jax.random.split(jax.random.key(args.seed), 8))
    b, t, n, kv, h = 2, 8, 8, 2, 64
    q = jax.random.normal(next(key), (b, t, n, h))
    k = jax.random.normal(next(key), (b, t, kv, h))
    v = jax.random.normal(next(key), (b, t, kv, h))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def block(q, k, v, pos):
        q, k = fj.rope(q, pos), fj.rope(k, pos)
        return fj.attention(q, k, v)

    t0 = time.perf_counter()
    out = block(q, k, v, pos).block_until_ready()
    print(f"rope + causal GQA attention {tuple(out.shape)} under jit: "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms (incl. compile)")
    # A decode query (q_len 1) is bottom-right aligned: it sees every key.
    full, dec = fj.attention(q, k, v), fj.attention(q[:, -1:], k, v)
    err = float(jnp.abs(dec - full[:, -1:]).max())
    print(f"decode query (q_len 1) vs last row of the full causal pass: max |diff| {err:.1e}")
    x = jax.random.normal(next(key), (4, 256))
    w = jax.random.normal(next(key), (256,))
    y = fj.rms_norm(x, w, eps=1e-6)
    xn = np.asarray(x, np.float64)
    ref = np.asarray(w) * xn / np.sqrt((xn * xn).mean(-1, keepdims=True) + 1e-6)
    print(f"rms_norm max |err| vs NumPy float64: {np.abs(np.asarray(y) - ref).max():.2e}")
    print("\nimplementations used:")
    for op, sel in sorted(dispatch.last_selections().items()):
        print(f"  {op:10s} {sel.implementation} ({sel.source}, {sel.platform})")
    return 0


_DTYPES = ("float32", "bfloat16", "float16")


class GenerateError(Exception):
    """A problem with the user's input to ``generate``: reported as one line, exit code 2."""


class _ProgressLine:
    """A one-line progress bar on a stream: ``generating [#####.....] 12/32 tokens``.

    Called as ``progress(done, total)`` by ``generate_with_stats``; draws nothing unless
    ``enabled``.
    """

    def __init__(self, stream, *, enabled: bool, width: int = 30):
        self.stream, self.enabled, self.width, self.drawn = stream, enabled, width, False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(total, 1)
        self.stream.write(f"\rgenerating [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{done}/{total} tokens")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _tiny_dir():
    import pathlib

    import forge_jax.models

    return pathlib.Path(forge_jax.models.__file__).parent / "tiny"


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise GenerateError(
            f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise GenerateError(f"--prompt-ids is empty: {text!r}")
    return ids


def _load(args: argparse.Namespace):
    """(model, raw config dict, tokenizer or None, checkpoint path) for ``args``."""
    import json
    import pathlib

    import jax.numpy as jnp

    from forge_jax.models import llama

    path = pathlib.Path(args.checkpoint) if args.checkpoint else _tiny_dir()
    model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype))  # errors name the problem
    raw = json.loads((path / "config.json").read_text())
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise GenerateError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
    return model, raw, tokenizer, path


def _describe(model, path, args) -> str:
    import math

    import jax
    from flax import nnx

    c = model.config
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return (f"{path}: Llama, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, vocab "
            f"{c.vocab_size}, {params / 1e6:.2f} M parameters, {args.dtype}, {args.cache} cache")


def _print_stats(stats) -> None:
    print(f"prefill: {stats.prompt_tokens} prompt tokens in {stats.prefill_seconds * 1e3:.1f} ms"
          f" = {stats.prefill_tokens_per_s:,.0f} tokens/s (batch {stats.batch})")
    if stats.decode_steps:
        print(f"decode:  {stats.decode_tokens} tokens in {stats.decode_steps} steps, "
              f"{stats.decode_ms_per_step:.2f} ms/step = {stats.decode_tokens_per_s:,.0f} tokens/s")
    else:
        print("decode:  no decode steps (every sequence ended at its first token)")
    print(f"compile: {stats.compile_seconds:.1f} s (prefill and decode steps; not in the rates)")


def _print_selections() -> None:
    from forge_jax import dispatch

    print("implementations used:")
    for op, sel in sorted(dispatch.last_selections().items()):
        print(f"  {op:16s} {sel.implementation} ({sel.source}, {sel.platform})")


def _run_task(model, task, args, progress) -> None:
    import numpy as np

    from forge_jax.models import tasks

    n = args.num_problems
    if n <= 0:
        raise GenerateError(f"--num-problems must be positive, got {n}")
    problems = task.sample(np.random.default_rng(args.seed), n, split="test")
    kw = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    generated, stats = tasks.solve(
        model, problems, cache=args.cache, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, progress=progress, **kw)
    progress.close()
    print(f"task: {task.max_digits}-digit addition; the model writes the sum's digits "
          f"least significant first, then <eos>")
    for p, ids in list(zip(problems, generated, strict=True))[:args.show]:
        text, finished = tasks.decode(ids)
        value = tasks.read_answer(text)
        reads = f"reads {value}" if value is not None else "not a number"
        end = "" if finished else " (no <eos>)"
        verdict = "ok" if tasks.is_correct(p, ids) else f"WRONG: {p.a}+{p.b} = {p.a + p.b}"
        print(f"  {p.prompt:>9s} {text:<5s} {reads:<11s}{end} {verdict}")
    correct = sum(tasks.is_correct(p, g) for p, g in zip(problems, generated, strict=True))
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(f"accuracy: {correct}/{n} = {100 * correct / n:.1f}% exact match on fresh held-out "
          f"problems ({mode}, one batch, stop at <eos>)")
    _print_stats(stats)


def _run_prompts(model, tokenizer, path, args, progress) -> None:
    from forge_jax.models import llama

    if args.prompt_ids is not None:
        prompts = [_parse_ids(args.prompt_ids)]
        vocab = model.config.vocab_size
        bad = [i for i in prompts[0] if not 0 <= i < vocab]
        if bad:
            raise GenerateError(f"--prompt-ids {bad} outside the vocabulary [0, {vocab})")
    else:
        if tokenizer is None:
            raise GenerateError(f"{path} has no tokenizer.json: give token ids with --prompt-ids")
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
        empty = [t for t, ids in zip(args.prompt, prompts, strict=True) if not ids]
        if empty:
            raise GenerateError(f"--prompt {empty[0]!r} encodes to no tokens")
    eos = model.config.eos_token_ids or None
    max_new = 32 if args.max_new_tokens is None else args.max_new_tokens
    generated, stats = llama.generate_with_stats(
        model, prompts, max_new, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, cache=args.cache, eos_token_id=eos, progress=progress)
    progress.close()
    for prompt, ids in zip(prompts, generated, strict=True):
        print(f"prompt ids:    {prompt}")
        print(f"generated ids: {ids}")
        if tokenizer is not None:
            print(f"prompt:     {tokenizer.decode(prompt, skip_special_tokens=True)!r}")
            print(f"completion: {tokenizer.decode(ids, skip_special_tokens=True)!r}")
    _print_stats(stats)


def _generate(args: argparse.Namespace) -> int:
    import contextlib

    import forge_jax as fj
    from forge_jax import dispatch
    from forge_jax.memory import InsufficientMemoryError
    from forge_jax.models import llama, tasks

    prog = "forge-jax generate"
    try:
        if args.prompt and args.prompt_ids is not None:
            raise GenerateError("give --prompt or --prompt-ids, not both")
        for name in ("max_new_tokens", "top_k"):
            value = getattr(args, name)
            if value is not None and value < (0 if name == "max_new_tokens" else 1):
                raise GenerateError(f"--{name.replace('_', '-')} must be "
                                    f"{'>= 0' if name == 'max_new_tokens' else '>= 1'}, "
                                    f"got {value}")
        if args.temperature < 0:
            raise GenerateError(f"--temperature must be >= 0, got {args.temperature}")
        if args.top_p is not None and not 0 < args.top_p <= 1:
            raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")
        if args.implementation is not None:
            known = dispatch.names()
            if args.implementation not in known:
                raise GenerateError(f"unknown --implementation {args.implementation!r}; "
                                    f"registered: {', '.join(known)}")
        model, raw, tokenizer, path = _load(args)
        task = tasks.task_from_config(raw)
        if task is None and not args.prompt and args.prompt_ids is None:
            raise GenerateError(f"{path} is not a forge_jax task model: give --prompt TEXT or "
                                f"--prompt-ids 1,2,3")
        print(_describe(model, path, args))
        show = args.progress if args.progress is not None else sys.stderr.isatty()
        progress = _ProgressLine(sys.stderr, enabled=show)
        context = contextlib.nullcontext()
        if args.implementation:
            # generate() keys its compiled steps on the preference, so no cache to clear.
            context = fj.use_implementation(args.implementation)
        fj.dispatch.clear_selections()  # Report the ops of this run only.
        with context:
            if task is not None and not args.prompt and args.prompt_ids is None:
                _run_task(model, task, args, progress)
            else:
                _run_prompts(model, tokenizer, path, args, progress)
    except (GenerateError, llama.CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except InsufficientMemoryError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    _print_selections()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forge-jax", description="forge_jax: functional JAX kernels for LLM inference")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="versions, devices, toolchains and implementations").set_defaults(
        fn=_info)
    demo = sub.add_parser("demo", help="run each op once and check it against NumPy")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(fn=_demo)
    gen = sub.add_parser(
        "generate", help="generate with a Llama checkpoint (default: the embedded tiny model)",
        description="Without arguments: the embedded tiny model answers fresh addition problems; "
                    "prints examples, the accuracy, prefill and decode tokens/s, and the "
                    "implementation each op used.")
    gen.add_argument("--checkpoint", metavar="DIR",
                     help="a Hugging Face Llama-family directory (config.json, model.safetensors)")
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text, encoded with DIR/tokenizer.json (repeat for a batch)")
    gen.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="tokens to generate (default: 32; for a task model, the longest answer)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    gen.add_argument("--implementation", default=None,
                     help="preferred op implementation (forge_jax.use_implementation), e.g. xla")
    gen.add_argument("--dtype", choices=_DTYPES, default="float32")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed and problem draw")
    gen.add_argument("--num-problems", type=int, default=256,
                     help="problems in the accuracy batch of a task model (default 256)")
    gen.add_argument("--show", type=int, default=5, help="problems to print (default 5)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr (default: when stderr is a terminal)")
    gen.set_defaults(fn=_generate)
    args = parser.parse_args(argv)
    if not hasattr(args, "fn"):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except BrokenPipeError:  # e.g. `forge-jax generate | head`: stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
