"""The ``forge-jax`` command line: ``info``, ``demo``, ``generate``, ``chat`` and ``tune``."""

from __future__ import annotations

import argparse
import sys


def _info(args: argparse.Namespace) -> int:
    from forge_jax import backends

    print(backends.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Every op once on fresh random data, a PASS/FAIL verdict per op against its tolerance."""
    _check_seed(args.seed)
    from forge_jax import demo

    return 0 if demo.run(args.seed) else 1


_DTYPES = ("float32", "bfloat16", "float16")


class GenerateError(Exception):
    """A problem with the user's input to a command: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, ``--top-k x``) are one line on stderr, exit
    code 2, like every other bad input: no usage block, no SystemExit out of ``main``."""

    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")


class _UsageError(Exception):
    """An argparse error, already prefixed with the (sub)command's name."""


_SEED_LIMIT = 2**63  # jax.random.key takes a C long; numpy's generator a non-negative int


def _check_seed(seed: int) -> None:
    if not 0 <= seed < _SEED_LIMIT:
        raise GenerateError(f"--seed must be in [0, 2**63), got {seed}")


def _check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag of ``generate``, before anything is read or loaded."""


    if args.prompt and args.prompt_ids is not None:
        raise GenerateError("give --prompt or --prompt-ids, not both")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise GenerateError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    _check_sampling_flags(args)
    if args.num_problems < 1:
        raise GenerateError(f"--num-problems must be >= 1, got {args.num_problems}")
    if args.show < 0:
        raise GenerateError(f"--show must be >= 0, got {args.show}")
    _check_seed(args.seed)
    if args.mesh is not None:
        from forge_jax import sharding

        try:
            sharding.parse_mesh(args.mesh)
        except ValueError as e:
            raise GenerateError(f"--mesh: {e}") from None
    if args.implementation is not None:
        from forge_jax import dispatch

        known = dispatch.names()
        if args.implementation not in known:
            raise GenerateError(f"unknown --implementation {args.implementation!r}; "
                                f"registered: {', '.join(known)}")


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags of ``generate`` and ``chat`` (None: the checkpoint's
    generation_config.json, else greedy and no filter)."""
    import math

    import numpy as np

    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"--top-k must be >= 1, got {args.top_k}")
    largest = float(np.finfo(np.float32).max)
    if args.temperature is not None and not (
            math.isfinite(args.temperature) and 0 <= args.temperature <= largest):
        raise GenerateError(f"--temperature must be a finite number >= 0 (at most float32's "
                            f"{largest:.4g}), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise GenerateError(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.repetition_penalty is not None and not (
            math.isfinite(args.repetition_penalty) and 0 < args.repetition_penalty <= largest):
        raise GenerateError(f"--repetition-penalty must be a finite number > 0, got "
                            f"{args.repetition_penalty}")


def _sampling(args: argparse.Namespace, generation_config):
    """The flags over the checkpoint's generation_config.json: a ``SamplingParams``."""
    from forge_jax.models import text

    try:
        return (generation_config or text.GenerationConfig()).sampling_params(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise GenerateError(str(e)) from None


_CACHE_ENV = "FORGE_JAX_COMPILATION_CACHE"
_CACHE_OFF = ("", "0", "off", "no", "none", "false")


def _compilation_cache_dir(args: argparse.Namespace):
    """Where the persistent compilation cache lives for this run, or None for none:
    ``--no-compilation-cache``, else ``--compilation-cache DIR``, else
    ``$FORGE_JAX_COMPILATION_CACHE`` (a directory, or ``off``), else
    ``$XDG_CACHE_HOME/forge_jax/jax`` (``~/.cache/forge_jax/jax``)."""
    import os
    import pathlib

    if args.no_compilation_cache:
        return None
    if args.compilation_cache:
        return pathlib.Path(args.compilation_cache).expanduser()
    env = os.environ.get(_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _CACHE_OFF else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "forge_jax" / "jax"


class _CompilationCache:
    """JAX's persistent compilation cache in ``directory`` for the duration of a command
    (every step cached, however fast it compiled), so that the next run of the same model
    loads its compiled steps instead of compiling them. JAX's settings are restored on
    exit (``main`` may run inside a longer process); a cache the user configured for JAX
    itself (``JAX_COMPILATION_CACHE_DIR``) is left alone."""

    _SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")

    def __init__(self, directory):
        self.directory, self.saved, self.active = directory, None, None

    def __enter__(self):
        import jax

        if self.directory is None or jax.config.jax_compilation_cache_dir:
            self.active = jax.config.jax_compilation_cache_dir
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GenerateError(f"cannot create the compilation cache {self.directory}: {e}; "
                                f"pass --compilation-cache DIR or --no-compilation-cache"
                                ) from None
        from jax.experimental.compilation_cache import compilation_cache

        self.saved = {name: getattr(jax.config, name) for name in self._SETTINGS}
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", str(self.directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        self.active = str(self.directory)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import jax
            from jax.experimental.compilation_cache import compilation_cache

            for name, value in self.saved.items():
                jax.config.update(name, value)
            compilation_cache.reset_cache()
        return False


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


def _read_checkpoint(args: argparse.Namespace):
    """(config, raw config dict, tokenizer or None, checkpoint path) for ``args``: everything
    but the weights, so that inputs are checked before the model is loaded."""
    import json
    import pathlib

    from forge_jax.models import llama

    path = pathlib.Path(args.checkpoint) if args.checkpoint else _tiny_dir()
    config = llama.load_config(path)  # errors name the problem
    raw = json.loads((path / "config.json").read_text())
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise GenerateError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
    return config, raw, tokenizer, path


def _prompts(args, config, tokenizer, path) -> list[list[int]]:
    """The token ids of ``--prompt`` / ``--prompt-ids``, checked against the model's vocabulary."""
    vocab = config.vocab_size
    if args.prompt_ids is not None:
        ids = _parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise GenerateError(f"--prompt-ids {bad} outside the vocabulary [0, {vocab})")
        return [ids]
    if tokenizer is None:
        raise GenerateError(f"{path} has no tokenizer.json: give token ids with --prompt-ids")
    prompts = []
    for text in args.prompt:
        try:
            ids = tokenizer.encode(text).ids
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise GenerateError(f"--prompt {text!r} cannot be encoded with "
                                f"{path / 'tokenizer.json'}: {e}") from None
        if not ids:
            raise GenerateError(f"--prompt {text!r} encodes to no tokens")
        bad = sorted({i for i in ids if not 0 <= i < vocab})
        if bad:
            raise GenerateError(f"--prompt {text!r} encodes to token ids {bad} outside the "
                                f"model's vocabulary [0, {vocab}): {path / 'tokenizer.json'} "
                                f"does not match the checkpoint")
        prompts.append(ids)
    return prompts


def _check_length(args, config, path, prompt_tokens: int, max_new: int, what: str) -> None:
    limit = config.max_position_embeddings
    if prompt_tokens + max_new > limit and not args.allow_long_context:
        raise GenerateError(
            f"{what} has {prompt_tokens} tokens; with --max-new-tokens {max_new} that is "
            f"{prompt_tokens + max_new} positions, beyond max_position_embeddings={limit} of "
            f"{path}; pass --allow-long-context if the model's RoPE scaling extends its range")


def _mesh(args, config):
    """The MeshConfig ``--mesh`` asks for (None without it), checked against the devices
    and the model's head counts before the weights are loaded."""
    if args.mesh is None:
        return None
    import jax

    from forge_jax import sharding
    from forge_jax.models import llama_sharding

    try:
        mesh = sharding.MeshConfig(sharding.make_mesh(args.mesh))
        llama_sharding.layout_for(config, mesh.tp)
    except ValueError as e:
        hint = ""
        if "available" in str(e) and jax.default_backend() == "cpu":
            hint = ("; on CPU, give JAX several devices with "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N")
        raise GenerateError(f"--mesh {args.mesh}: {e}{hint}") from None
    return mesh


def _describe(model, path, args) -> str:
    import math

    import jax
    from flax import nnx

    c = model.config
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return (f"{path}: Llama, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, vocab "
            f"{c.vocab_size}, {params / 1e6:.2f} M parameters, {args.dtype}, "
            f"{getattr(args, 'cache', 'paged')} cache"
            + ("" if model.mesh is None else
               f", sharded over {model.mesh.describe()} ({len(model.mesh.mesh.devices.flat)} "
               f"{model.mesh.mesh.devices.flat[0].platform.upper()} devices)"))


def _print_stats(stats) -> None:
    if stats.max_new_tokens == 0:
        print("prefill: not run (--max-new-tokens 0: no token to generate)")
        print("decode:  not run")
        return
    print(f"prefill: {stats.prompt_tokens} prompt tokens in {stats.prefill_seconds * 1e3:.1f} ms"
          f" = {stats.prefill_tokens_per_s:,.0f} tokens/s (batch {stats.batch})")
    print(f"time to first token: {stats.prefill_seconds * 1e3:.1f} ms (the prefill; compiled "
          f"and warmed up before it in {stats.compile_seconds:.2f} s)")
    if stats.decode_steps:
        print(f"decode:  {stats.decode_tokens} tokens in {stats.decode_steps} steps, "
              f"{stats.decode_ms_per_step:.2f} ms/step = {stats.decode_tokens_per_s:,.0f} tokens/s")
    elif stats.max_new_tokens == 1:
        print("decode:  no decode steps (--max-new-tokens 1: the prefill gives the only token)")
    else:
        print("decode:  no decode steps (every sequence stopped at an end-of-sequence token "
              "from the prefill)")
    steps = "the prefill step" if stats.max_new_tokens == 1 else "prefill and decode steps"
    print(f"compile: {stats.compile_seconds:.1f} s ({steps}; not in the rates)")


def _print_selections() -> None:
    from forge_jax import dispatch

    selections = dispatch.last_selections()
    if not selections:
        print("implementations used: none (no op ran)")
        return
    print("implementations used:")
    for op, sel in sorted(selections.items()):
        print(f"  {op:16s} {sel.implementation} ({sel.source}, {sel.platform})")


def _task_new_tokens(task, args) -> int:
    """``--max-new-tokens``, or the longest possible answer and its eos (``tasks.solve``
    uses at most this)."""
    return task.max_answer_chars + 1 if args.max_new_tokens is None else args.max_new_tokens


def _check_task(task, config, args, path, mesh=None) -> None:
    """A task run's length and memory, checked before any problem is drawn: a huge
    ``--num-problems`` is refused here, not after a long loop building its prompts."""
    import jax.numpy as jnp

    from forge_jax.memory import InsufficientMemoryError
    from forge_jax.models import llama

    prompt_tokens = 1 + task.max_prompt_chars  # <bos> and the longest prompt
    max_new = _task_new_tokens(task, args)
    _check_length(args, config, path, prompt_tokens, max_new, "the longest problem")
    dtype = jnp.dtype(args.dtype)
    try:
        llama.check_generation_fits(config, batch=args.num_problems, longest_prompt=prompt_tokens,
                                    max_new_tokens=max_new, cache=args.cache, param_dtype=dtype,
                                    dtype=dtype, mesh=mesh)
    except InsufficientMemoryError as e:
        raise GenerateError(f"--num-problems {args.num_problems} is too many: {e}") from None


def _run_task(model, task, args, progress) -> None:
    import numpy as np

    from forge_jax.models import tasks

    n = args.num_problems
    problems = task.sample(np.random.default_rng(args.seed), n, split="test")
    # Without --max-new-tokens, tasks.solve sizes the answers to these problems.
    kw = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    sampling = _sampling(args, None)
    generated, stats = tasks.solve(
        model, problems, cache=args.cache, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty, seed=args.seed, progress=progress,
        allow_beyond_max_positions=args.allow_long_context, **kw)
    progress.close()
    print(f"task: {task.max_digits}-digit addition; the model writes the sum's digits "
          f"least significant first, then <eos>")
    if stats.max_new_tokens == 0:
        print(f"accuracy: not measured (--max-new-tokens 0: no answers generated for the "
              f"{n} problems)")
        _print_stats(stats)
        return
    for p, ids in list(zip(problems, generated, strict=True))[:args.show]:
        text, finished = tasks.decode(ids)
        value = tasks.read_answer(text)
        reads = f"reads {value}" if value is not None else "not a number"
        end = "" if finished else " (no <eos>)"
        verdict = "ok" if tasks.is_correct(p, ids) else f"WRONG: {p.a}+{p.b} = {p.a + p.b}"
        print(f"  {p.prompt:>9s} {text:<5s} {reads:<11s}{end} {verdict}")
    correct = sum(tasks.is_correct(p, g) for p, g in zip(problems, generated, strict=True))
    mode = "greedy" if sampling.greedy else f"temperature {sampling.temperature}"
    print(f"accuracy: {correct}/{n} = {100 * correct / n:.1f}% exact match on fresh held-out "
          f"problems ({mode}, one batch, stop at <eos>)")
    _print_stats(stats)


def _prompt_new_tokens(args, generation_config=None) -> int:
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    if generation_config is not None and generation_config.max_new_tokens:
        return generation_config.max_new_tokens
    return 32


def _run_prompts(model, tokenizer, prompts, args, progress, path) -> None:
    from forge_jax.models import llama, text

    generation_config = text.load_generation_config(path)
    sampling = _sampling(args, generation_config)
    if generation_config is not None and generation_config.eos_token_id:
        eos = generation_config.eos_token_id
    else:
        eos = model.config.eos_token_ids or None
    max_new = _prompt_new_tokens(args, generation_config)
    streamer = None
    if args.stream and tokenizer is not None and len(prompts) == 1 and max_new > 0:
        # Text as it is decoded: the prompt, then the completion piece by piece.
        streamer = text.TextStreamer(text.Tokenizer(tokenizer), 1, eos or (),
                                     lambda b, piece: (sys.stdout.write(piece),
                                                       sys.stdout.flush()))
        sys.stdout.write(tokenizer.decode(prompts[0], skip_special_tokens=True))
        sys.stdout.flush()
    generated, stats = llama.generate_with_stats(
        model, prompts, max_new, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty, seed=args.seed, cache=args.cache,
        eos_token_id=eos, progress=progress, on_tokens=streamer, warm_up=True,
        allow_beyond_max_positions=args.allow_long_context)
    if streamer is not None:
        streamer.close()
        print()
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

    import jax.numpy as jnp

    import forge_jax as fj
    from forge_jax.memory import InsufficientMemoryError
    from forge_jax.models import llama, tasks, text

    prog = "forge-jax generate"
    try:
        # Every input is checked before the weights are loaded: the flags, then what needs
        # only config.json and tokenizer.json (prompt ids, lengths, the task's memory).
        _check_flags(args)
        config, raw, tokenizer, path = _read_checkpoint(args)
        task = tasks.task_from_config(raw)
        mesh = _mesh(args, config)
        prompts = None
        if args.prompt or args.prompt_ids is not None:
            prompts = _prompts(args, config, tokenizer, path)
            longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
            what = ("--prompt-ids" if args.prompt_ids is not None
                    else f"--prompt {args.prompt[longest]!r}")
            _check_length(args, config, path, len(prompts[longest]),
                          _prompt_new_tokens(args, text.load_generation_config(path)), what)
        elif task is None:
            raise GenerateError(f"{path} is not a forge_jax task model: give --prompt TEXT or "
                                f"--prompt-ids 1,2,3")
        else:
            _check_task(task, config, args, path, mesh)
        model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype), mesh=mesh)
        print(_describe(model, path, args))
        show = args.progress if args.progress is not None else sys.stderr.isatty()
        progress = _ProgressLine(sys.stderr, enabled=show)
        context = contextlib.nullcontext()
        if args.implementation:
            # generate() keys its compiled steps on the preference, so no cache to clear.
            context = fj.use_implementation(args.implementation)
        fj.dispatch.clear_selections()  # Report the ops of this run only.
        with _CompilationCache(_compilation_cache_dir(args)), context:
            if prompts is None:
                _run_task(model, task, args, progress)
            else:
                _run_prompts(model, tokenizer, prompts, args, progress, path)
    except (GenerateError, llama.CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except InsufficientMemoryError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    _print_selections()
    return 0


def _tune(args: argparse.Namespace) -> int:
    """Autotunes every op of a Llama checkpoint at the shapes of its prefill and decode steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import forge_jax as fj
    from forge_jax import autotuning
    from forge_jax.models import llama, llama_ops

    prog = "forge-jax tune"
    try:
        for flag in ("batch", "seq_len", "iters"):
            if getattr(args, flag) < 1:
                raise GenerateError(f"--{flag.replace('_', '-')} must be >= 1, "
                                    f"got {getattr(args, flag)}")
        names = None
        if args.implementations:
            names = [n.strip() for n in args.implementations.split(",") if n.strip()]
            for name in names:
                fj.dispatch.check_name(name, "--implementations:")
        config, _, _, path = _read_checkpoint(args)
    except (GenerateError, ValueError, llama.CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    calls = llama_ops.op_calls(config, batch=args.batch, seq_len=args.seq_len,
                               dtype=jnp.dtype(args.dtype), rng=np.random.default_rng(0))
    b = args.batch
    print(f"{path}: tuning {len(calls)} op calls (batch {b}, prefill {args.seq_len} tokens and "
          f"decode, {args.dtype}) on {jax.devices()[0].device_kind}")
    platform = jax.default_backend()
    for op, op_args, kwargs in calls:
        # --implementations may name implementations some ops lack (cudnn: attention only).
        here = None if names is None else [
            n for n in names if n in fj.dispatch.implementations(op, platform)]
        if here == []:
            print(f"  {op}: not tuned: none of --implementations serves it on {platform}")
            continue
        try:
            result = fj.autotune(op, *op_args, implementations=here, iters=args.iters,
                                 force=args.force, **kwargs)
        except (ValueError, fj.ImplementationError) as e:
            print(f"  {op}: not tuned: {e}")
            continue
        print(f"  {result}")
    where = autotuning.cache_path()
    print(f"cache: {where}" if where else f"cache: off (${autotuning.CACHE_ENV}=off)")
    return 0


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=None,
                        help="0: greedy (default, unless generation_config.json samples)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="transformers' repetition penalty (1: off)")


def _add_compilation_cache_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache", metavar="DIR", default=None,
                        help=f"JAX's persistent compilation cache (default: ${_CACHE_ENV}, else "
                             f"~/.cache/forge_jax/jax): a second run skips compilation")
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help=f"compile afresh, cache nothing (or {_CACHE_ENV}=off)")


def _chat_line(stats) -> str:
    return (f"[first token {stats.first_token_seconds * 1e3:.0f} ms; prefilled "
            f"{stats.prefilled_tokens} of {stats.prompt_tokens} tokens ({stats.reused_tokens} "
            f"kept in the cache); {stats.new_tokens} new tokens, "
            f"{stats.decode_ms_per_step:.1f} ms/token]")


def _chat(args: argparse.Namespace) -> int:
    """``forge-jax chat``: one user message per stdin line, each reply streamed to stdout."""
    import jax.numpy as jnp

    from forge_jax.memory import InsufficientMemoryError
    from forge_jax.models import llama, text
    from forge_jax.models.chat_session import ChatSession, ContextFullError

    prog = "forge-jax chat"
    try:
        _check_sampling_flags(args)
        _check_seed(args.seed)
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        if args.max_context is not None and args.max_context < 2:
            raise GenerateError(f"--max-context must be >= 2, got {args.max_context}")
        import pathlib

        path = pathlib.Path(args.checkpoint)
        config = llama.load_config(path)
        tokenizer = text.load_tokenizer(path)
        if not tokenizer.chat_template:
            raise GenerateError(f"{path} has no chat template (no 'chat_template' in "
                                f"tokenizer_config.json, no chat_template.jinja): use "
                                f"forge-jax generate --prompt TEXT")
        sampling = _sampling(args, tokenizer.generation_config)
        if args.max_context is not None and args.max_context > config.max_position_embeddings:
            raise GenerateError(f"--max-context {args.max_context} is beyond "
                                f"max_position_embeddings={config.max_position_embeddings} "
                                f"of {path}")
        interactive = sys.stdin.isatty()
        with _CompilationCache(_compilation_cache_dir(args)):
            model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype))
            session = ChatSession(
                model, tokenizer, max_context=args.max_context, system=args.system,
                max_new_tokens=args.max_new_tokens, temperature=sampling.temperature,
                top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=sampling.min_p,
                repetition_penalty=sampling.repetition_penalty, seed=args.seed)
            print(f"{_describe(model, path, args)}; context {session.max_context} tokens. "
                  f"One message per line; /reset starts over; end of input (Ctrl-D) quits.",
                  file=sys.stderr)
            while True:
                if interactive:
                    print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line:  # end of input
                    break
                message = line.rstrip("\n")
                if not message.strip():
                    continue
                if message.strip() == "/reset":
                    session.reset()
                    print("[conversation reset]", file=sys.stderr)
                    continue
                try:
                    session.send(message, on_text=lambda piece: (sys.stdout.write(piece),
                                                                 sys.stdout.flush()))
                except ContextFullError as e:
                    print(f"[context full: {e}]", file=sys.stderr)
                    continue
                print(flush=True)
                if session.last_turn.context_full:
                    print(f"[context full: the reply stopped at {session.max_context} tokens; "
                          f"/reset to start over]", file=sys.stderr)
                if args.stats:
                    print(_chat_line(session.last_turn), file=sys.stderr)
    except (GenerateError, llama.CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except InsufficientMemoryError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
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
    _add_sampling_flags(gen)
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print a single --prompt's completion as it is decoded (default: on)")
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
    gen.add_argument("--mesh", metavar="tp=4", default=None,
                     help="shard the model over a device mesh: tensor-parallel axis tp, "
                          "data-parallel axis dp, e.g. tp=4 or dp=2,tp=4")
    gen.add_argument("--allow-long-context", action="store_true",
                     help="run prompt + new tokens beyond the model's max_position_embeddings "
                          "(for a RoPE scaling that extends its range)")
    _add_compilation_cache_flags(gen)
    gen.set_defaults(fn=_generate)
    tune = sub.add_parser(
        "tune", help="autotune every op at a checkpoint's shapes (default: the tiny model)",
        description="Times the implementations (and launch configurations) of each op at the "
                    "model's prefill and decode shapes on this device and stores the fastest "
                    "in the autotune cache, which auto selection then follows.")
    tune.add_argument("--checkpoint", metavar="DIR", help="a Hugging Face Llama-family directory")
    tune.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    tune.add_argument("--seq-len", type=int, default=128, help="prefill tokens (default 128)")
    tune.add_argument("--dtype", choices=_DTYPES, default="bfloat16")
    tune.add_argument("--iters", type=int, default=10, help="timed calls per candidate")
    tune.add_argument("--implementations", metavar="A,B",
                      help="the implementations to time, each for the ops that have it (default: "
                           "those auto selection could choose here; name unverified kernels, "
                           "e.g. xla,pallas,triton,cudnn, to let the measurement decide)")
    tune.add_argument("--force", action="store_true", help="time again what the cache holds")
    tune.set_defaults(fn=_tune)
    chat = sub.add_parser(
        "chat", help="a multi-turn chat with an instruct checkpoint, one message per stdin line",
        description="Reads one user message per line from stdin and streams each reply to "
                    "stdout; the conversation's KV cache is kept between turns, so a turn "
                    "prefills only its own tokens. /reset starts over; end of input ends.")
    chat.add_argument("--checkpoint", metavar="DIR", required=True,
                      help="a Hugging Face Llama-family directory with a chat template")
    chat.add_argument("--system", metavar="TEXT", help="a system message to start with")
    chat.add_argument("--max-new-tokens", type=int, default=None,
                      help="per reply (default: generation_config.json's, else 256)")
    chat.add_argument("--max-context", type=int, default=None,
                      help="tokens the conversation may hold (default: the model's "
                           "max_position_embeddings, at most 4096)")
    _add_sampling_flags(chat)
    chat.add_argument("--dtype", choices=_DTYPES, default="float32")
    chat.add_argument("--seed", type=int, default=0, help="sampling seed")
    chat.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                      help="after each reply, its time to first token and speed on stderr")
    _add_compilation_cache_flags(chat)
    chat.set_defaults(fn=_chat)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand they were given to
            command = getattr(args, "command", None)
            prog = f"forge-jax {command}" if command else "forge-jax"
            raise _UsageError(f"{prog}: error: unrecognized arguments: {' '.join(extra)}")
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    if not hasattr(args, "fn"):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except GenerateError as e:  # info and demo; generate reports its own
        print(f"forge-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `forge-jax generate | head`: stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
