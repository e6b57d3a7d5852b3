"""``forge-jax generate``: a Llama checkpoint completes prompts, or the embedded tiny model
answers fresh addition problems; prints the speed of prefill and decode and the
implementation each op used."""

from __future__ import annotations

import argparse
import sys

from forge_jax.cli import _checkpoint, _compilation_cache, _flags
from forge_jax.cli._checkpoint import describe, quantize_kwargs, read_checkpoint
from forge_jax.cli._run import UsageError

NUM_PROBLEMS, SHOW = 256, 5  # a task run's defaults
# The API's default (forge_jax.generation.settings.DEFAULT_MAX_NEW_TOKENS, which a test
# holds this to), without importing JAX before --help.
DEFAULT_MAX_NEW_TOKENS = 256


def add_parser(subparsers) -> None:
    gen = subparsers.add_parser(
        "generate", help="generate with a Llama checkpoint (default: the embedded tiny model)",
        description="Without arguments: the embedded tiny model answers fresh addition problems; "
                    "prints examples, the accuracy, prefill and decode tokens/s, and the "
                    "implementation each op used.")
    _checkpoint.add_flags(gen, help="a Hugging Face Llama-family directory (config.json, "
                                     "model.safetensors)")
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text, encoded with DIR/tokenizer.json (repeat for a batch)")
    gen.add_argument("--prompt-ids", metavar="1,2,3", help="prompt as comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help=f"tokens to generate (default, as in the API: generation_config.json's, "
                          f"else {DEFAULT_MAX_NEW_TOKENS}, capped at the "
                          f"positions the model has left; for a task model, the longest "
                          f"answer)")
    _flags.add_sampling_flags(gen)
    _flags.add_speculative_flags(gen)
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print a single --prompt's completion as it is decoded (default: on)")
    gen.add_argument("--cache", choices=("paged", "contiguous"), default="paged",
                     help="the KV cache's layout: pages of --page-size tokens or one "
                          "contiguous block per sequence")
    _flags.add_kv_cache_flag(gen)
    gen.add_argument("--implementation", default=None,
                     help="preferred op implementation (forge_jax.use_implementation), e.g. xla")
    _flags.add_dtype_flag(gen)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed and problem draw")
    gen.add_argument("--num-problems", type=int, default=None,
                     help=f"problems in the accuracy batch of a task model (default "
                          f"{NUM_PROBLEMS}; not with --prompt)")
    gen.add_argument("--show", type=int, default=None,
                     help=f"problems to print (default {SHOW}; not with --prompt)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar on stderr (default: when stderr is a terminal; never "
                          "on the terminal a completion streams to)")
    _flags.add_mesh_flag(gen)
    gen.add_argument("--allow-long-context", action="store_true",
                     help="run prompt + new tokens beyond the model's max_position_embeddings "
                          "(for a RoPE scaling that extends its range)")
    _compilation_cache.add_flags(gen)
    gen.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    """Checks every input, loads the model, then answers the prompts or the task's problems."""
    import contextlib

    import jax.numpy as jnp

    import forge_jax as fj
    from forge_jax.models import llama
    from forge_jax.models.tiny import task as tasks
    from forge_jax.text import api as text

    # Every input is checked before the weights are loaded: the flags, then what needs
    # only config.json and tokenizer.json (prompt ids, lengths, the task's memory).
    _check_flags(args)
    _flags.resolve_dtype(args)
    with _compilation_cache.gguf_cache(args):  # a GGUF file's config and tokenizer, kept
        config, raw, tokenizer, path = read_checkpoint(args)
    task = tasks.task_from_config(raw)
    mesh = _flags.mesh_from_flag(args, config)
    prompts = None
    if args.prompt or args.prompt_ids is not None:
        prompts = _prompts(args, config, tokenizer, path)
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        what = ("--prompt-ids" if args.prompt_ids is not None
                else _prompt_name(args.prompt, longest))
        max_new = _prompt_new_tokens(args, config, prompts, text.load_generation_config(path))
        _check_length(args, config, path, len(prompts[longest]), max_new, what)
    elif task is None:
        raise UsageError(f"{path} is not a forge_jax task model: give --prompt TEXT or "
                         f"--prompt-ids 1,2,3")
    else:
        args.num_problems = NUM_PROBLEMS if args.num_problems is None else args.num_problems
        args.show = SHOW if args.show is None else args.show
        _check_task(task, config, args, path, mesh)
    quantize = quantize_kwargs(args, config)
    _flags.check_draft_checkpoint(args, config, tokenizer)
    model = llama.from_pretrained(path, dtype=jnp.dtype(args.dtype), mesh=mesh, **quantize)
    print(describe(model, path, args))
    _flags.load_draft(args, model)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = _ProgressLine(sys.stderr, enabled=show)
    context = contextlib.nullcontext()
    if args.implementation:
        # generate() keys its compiled steps on the preference, so no cache to clear.
        context = fj.use_implementation(args.implementation)
    fj.dispatch.clear_selections()  # Report the ops of this run only.
    with _compilation_cache.compilation_cache(args), context:
        if prompts is None:
            _run_task(model, task, args, progress)
        else:
            _run_prompts(model, tokenizer, prompts, args, progress, path)
    _print_selections()
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag of ``generate``, before anything is read or loaded."""
    if args.prompt and args.prompt_ids is not None:
        raise UsageError("give --prompt or --prompt-ids, not both")
    prompt = "--prompt" if args.prompt else "--prompt-ids" if args.prompt_ids is not None else None
    for flag, value in (("--num-problems", args.num_problems), ("--show", args.show)):
        if prompt and value is not None:
            raise UsageError(f"{flag} {value} is for a task model's accuracy batch (the "
                             f"embedded tiny model); with {prompt} it would be ignored")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    _flags.check_sampling_flags(args)
    _flags.speculative_config(args)  # its flags checked before the model loads
    if args.num_problems is not None and args.num_problems < 1:
        raise UsageError(f"--num-problems must be >= 1, got {args.num_problems}")
    if args.show is not None and args.show < 0:
        raise UsageError(f"--show must be >= 0, got {args.show}")
    _flags.check_seed(args.seed)
    _flags.check_implementation_env()
    if args.mesh is not None and args.kv_cache_dtype is not None:
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} runs on one device; it does "
                         f"not combine with --mesh yet")
    _flags.check_mesh_flag(args)
    if args.implementation is not None:
        from forge_jax import dispatch

        known = dispatch.names()
        if args.implementation not in known:
            raise UsageError(f"unknown --implementation {args.implementation!r}; "
                             f"registered: {', '.join(known)}")
    _compilation_cache.check(args)


def _parse_ids(text: str) -> list[int]:
    items = text.replace(" ", "").split(",")
    if not any(items):
        raise UsageError(f"--prompt-ids is empty: {text!r}")
    empty = [i + 1 for i, x in enumerate(items) if not x]
    if empty:
        raise UsageError(f"--prompt-ids {text!r} has an empty item (between two commas, or "
                         f"at an end) at position {empty[0]} of {len(items)}")
    try:
        return [int(x) for x in items]
    except ValueError:
        raise UsageError(
            f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _prompts(args, config, tokenizer, path) -> list[list[int]]:
    """The token ids of ``--prompt`` / ``--prompt-ids``, checked against the model's vocabulary."""
    from forge_jax.generation.prompts import encode_prompt

    vocab = config.vocab_size
    if args.prompt_ids is not None:
        ids = _parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UsageError(f"--prompt-ids {_some(bad)} outside the vocabulary [0, {vocab})")
        return [ids]
    if tokenizer is None:
        raise UsageError(f"{path} has no tokenizer.json: give token ids with --prompt-ids")
    prompts = []
    for i, text in enumerate(args.prompt):
        name = _prompt_name(args.prompt, i)
        try:
            ids = encode_prompt(tokenizer, text)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise UsageError(f"{name} cannot be encoded with {path / 'tokenizer.json'}: "
                             f"{_clip(str(e))}") from None
        if not ids:
            raise UsageError(f"{name} encodes to no tokens")
        bad = sorted({i for i in ids if not 0 <= i < vocab})
        if bad:
            raise UsageError(f"{name} encodes to token ids {_some(bad)} outside the "
                             f"model's vocabulary [0, {vocab}): {path / 'tokenizer.json'} "
                             f"does not match the checkpoint")
        prompts.append(ids)
    return prompts


_ECHO = 60  # characters of a prompt an error quotes in full


def _prompt_name(prompts: list[str], i: int) -> str:
    """How an error names ``--prompt`` number ``i``: quoted when short; when long, by its
    number, length and first words (a 45 KB prompt is not echoed back)."""
    text = prompts[i]
    if len(text) <= _ECHO:
        return f"--prompt {text!r}"
    which = f" #{i + 1} of {len(prompts)}" if len(prompts) > 1 else ""
    return f"--prompt{which} ({len(text):,} characters, {text[:30]!r}...)"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."


def _some(values: list[int], shown: int = 10) -> str:
    """``[1, 2, 3]``, or the first ``shown`` and how many more."""
    if len(values) <= shown:
        return str(values)
    return f"{str(values[:shown])[:-1]}, ... ({len(values) - shown} more)]"


def _check_length(args, config, path, prompt_tokens: int, max_new: int, what: str) -> None:
    limit = config.max_position_embeddings
    if prompt_tokens + max_new > limit and not args.allow_long_context:
        raise UsageError(
            f"{what} has {prompt_tokens} tokens; with --max-new-tokens {max_new} that is "
            f"{prompt_tokens + max_new} positions, beyond max_position_embeddings={limit} of "
            f"{path}; pass --allow-long-context if the model's RoPE scaling extends its range")


def _same_terminal(a, b) -> bool:
    """Whether streams ``a`` and ``b`` write to the same terminal."""
    import os

    try:
        return a.isatty() and b.isatty() and os.path.samestat(os.fstat(a.fileno()),
                                                              os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
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


def print_stats(stats, generated) -> None:
    """The prefill, decode and compile lines; ``generated``: the new ids of each sequence
    (eos included), to count the decode steps that ran past the last eos."""
    if stats.max_new_tokens == 0:
        print("prefill: not run (--max-new-tokens 0: no token to generate)")
        print("decode:  not run")
        return
    print(f"prefill: {stats.prompt_tokens} prompt tokens in {stats.prefill_seconds * 1e3:.1f} ms"
          f" = {stats.prefill_tokens_per_s:,.0f} tokens/s (batch {stats.batch})")
    print(f"time to first token: {stats.prefill_seconds * 1e3:.1f} ms (the prefill; compiled "
          f"and warmed up before it in {stats.compile_seconds:.2f} s)")
    if stats.decode_steps:
        # The prefill gives each sequence its first token; a decode step, one more each.
        past = stats.decode_steps - (max(len(ids) for ids in generated) - 1)
        note = "" if past <= 0 else (
            f" ({past} past the end-of-sequence token: it is read one step behind, so the "
            f"device never waits for the host)")
        print(f"decode:  {stats.decode_tokens} tokens in {stats.decode_steps} steps{note}, "
              f"{stats.decode_ms_per_step:.2f} ms/step = {stats.decode_tokens_per_s:,.0f} tokens/s")
    elif stats.max_new_tokens == 1:
        print("decode:  no decode steps (--max-new-tokens 1: the prefill gives the only token)")
    else:
        print("decode:  no decode steps (every sequence stopped at an end-of-sequence token "
              "from the prefill)")
    if stats.draft_tokens:
        print(f"speculative: {stats.accepted_tokens} of {stats.draft_tokens} drafted tokens "
              f"kept ({stats.acceptance_rate:.0%}), {stats.tokens_per_step:.2f} tokens per "
              f"sequence per step")
    steps = "the prefill step" if stats.max_new_tokens == 1 else "prefill and decode steps"
    print(f"compile: {stats.compile_seconds:.1f} s ({steps}; not in the rates)")
    kv = f"{stats.kv_cache_dtype}, scales included" if stats.kv_cache_dtype else "float"
    print(f"memory:  weights {stats.weight_bytes / 1e6:.2f} MB, KV cache "
          f"{stats.cache_bytes / 1e6:.2f} MB ({stats.cache}, {kv}; measured from the arrays)")


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

    from forge_jax import generation
    from forge_jax.memory import InsufficientMemoryError

    prompt_tokens = 1 + task.max_prompt_chars  # <bos> and the longest prompt
    max_new = _task_new_tokens(task, args)
    _check_length(args, config, path, prompt_tokens, max_new, "the longest problem")
    dtype = jnp.dtype(args.dtype)
    try:
        generation.check_generation_fits(
            config, batch=args.num_problems, longest_prompt=prompt_tokens,
            max_new_tokens=max_new, cache=_cache_spec(args), param_dtype=dtype, dtype=dtype,
            mesh=mesh)
    except InsufficientMemoryError as e:
        raise UsageError(f"--num-problems {args.num_problems} is too many: {e}") from None


def _run_task(model, task, args, progress) -> None:
    import numpy as np

    from forge_jax.generation import Callbacks
    from forge_jax.models.tiny import task as tasks

    n = args.num_problems
    problems = task.sample(np.random.default_rng(args.seed), n, split="test")
    # Without --max-new-tokens, tasks.solve sizes the answers to these problems.
    kw = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    sampling = _flags.sampling_params(args, None)
    speculative = _flags.speculative_config(args)
    if speculative is not None:
        kw["speculative"] = speculative
    generated, stats = tasks.solve(
        model, problems, sampling=sampling, cache=_cache_spec(args),
        callbacks=Callbacks(progress=progress),
        allow_beyond_max_positions=args.allow_long_context, **kw)
    progress.close()
    print(f"task: {task.max_digits}-digit addition; the model writes the sum's digits "
          f"least significant first, then <eos>")
    if stats.max_new_tokens == 0:
        print(f"accuracy: not measured (--max-new-tokens 0: no answers generated for the "
              f"{n} problems)")
        print_stats(stats, generated)
        return
    for p, ids in list(zip(problems, generated, strict=True))[:args.show]:
        text, finished = tasks.decode(ids)
        value = tasks.read_answer(text)
        reads = f"reads {value}" if value is not None else "not a number"
        end = "" if finished else " (no <eos>)"
        verdict = "ok" if tasks.is_correct(p, ids) else f"WRONG: {p.a}+{p.b} = {p.a + p.b}"
        print(f"  {p.prompt:>9s} {text:<5s} {reads:<11s}{end} {verdict}")
    correct = sum(tasks.is_correct(p, g) for p, g in zip(problems, generated, strict=True))
    print(f"accuracy: {correct}/{n} = {100 * correct / n:.1f}% exact match on fresh held-out "
          f"problems ({_flags.describe_sampling(args, sampling)}; one batch, stop at <eos>)")
    print_stats(stats, generated)


def _prompt_new_tokens(args, config, prompts, generation_config=None) -> int:
    """``--max-new-tokens``, else the API's default (``text.default_max_new_tokens``)."""
    from forge_jax.text import api as text

    if args.max_new_tokens is not None:
        return args.max_new_tokens
    return text.default_max_new_tokens(config, max(len(p) for p in prompts), generation_config)


def _cache_spec(args):
    """``--cache`` and ``--kv-cache-dtype`` as a ``forge_jax.kv_cache.CacheSpec``."""
    from forge_jax.kv_cache import CacheSpec

    return CacheSpec(kind=args.cache, kv_dtype=args.kv_cache_dtype)


def _run_prompts(model, tokenizer, prompts, args, progress, path) -> None:
    from forge_jax.generation import Callbacks
    from forge_jax.text import api as text

    generation_config = text.load_generation_config(path)
    sampling = _flags.sampling_params(args, generation_config)
    max_new = _prompt_new_tokens(args, model.config, prompts, generation_config)
    # The text API over the prompts' ids; without tokenizer.json (--prompt-ids), no text.
    wrapped = None if tokenizer is None else text.Tokenizer(
        tokenizer, generation_config=generation_config, name=str(path))
    stream = None
    speculative = _flags.speculative_config(args)
    extra = {} if speculative is None else {"speculative": speculative}
    if args.stream and tokenizer is not None and len(prompts) == 1 and max_new > 0 \
            and speculative is None:  # (speculative steps give several tokens at once)
        # Text as it is decoded: the prompt, then the completion piece by piece.
        def stream(index, piece):
            sys.stdout.write(piece)
            sys.stdout.flush()

        if progress.enabled and _same_terminal(sys.stdout, progress.stream):
            # The text streaming in is the progress; a bar on the same terminal would write
            # over it (its carriage returns land in the middle of the completion).
            progress.enabled = False
            if args.progress:
                print("forge-jax generate: no progress bar while the completion streams to "
                      "this terminal (--no-stream for the bar)", file=sys.stderr)
        sys.stdout.write(tokenizer.decode(prompts[0], skip_special_tokens=True))
        sys.stdout.flush()
    _, generated, stats = text.generate_ids(
        model, wrapped, prompts, max_new_tokens=max_new, sampling=sampling,
        generation_config=generation_config, stream=stream, cache=_cache_spec(args),
        callbacks=Callbacks(progress=progress), warm_up=True,
        allow_beyond_max_positions=args.allow_long_context, **extra)
    if stream is not None:
        print()
    progress.close()
    for prompt, ids in zip(prompts, generated, strict=True):
        print(f"prompt ids:    {prompt}")
        print(f"generated ids: {ids}")
        if tokenizer is not None:
            print(f"prompt:     {tokenizer.decode(prompt, skip_special_tokens=True)!r}")
            print(f"completion: {tokenizer.decode(ids, skip_special_tokens=True)!r}")
    print(f"decoding: {_flags.describe_sampling(args, sampling, generation_config)}")
    print_stats(stats, generated)
