"""``forge-jax export``: a checkpoint's prefill and decode steps written as ``jax.export``
artifacts (serialized StableHLO, a manifest, the weights as safetensors), which
``forge_jax.generation.exported.load`` runs without the model code."""

from __future__ import annotations

import argparse

from forge_jax.cli import _checkpoint, _flags
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="write a checkpoint's prefill and decode steps as jax.export programs",
        description="Exports the model's greedy prefill and decode steps (contiguous KV "
                    "cache) as jax.export artifacts beside a manifest and the weights "
                    "(safetensors); forge_jax.generation.exported.load(OUT) runs them without the "
                    "model code.")
    _checkpoint.add_flags(export, help="a Hugging Face Llama-family directory (default: the "
                                       "embedded tiny model)")
    export.add_argument("--out", required=True, metavar="DIR",
                        help="the directory to write: new, empty, or an earlier export "
                             "(replaced once the new one is complete)")
    export.add_argument("--platforms", default="cpu", metavar="A,B",
                        help="lowering platforms among cpu, cuda, rocm, tpu (default cpu); "
                             "for any but this machine's alone, every op uses XLA")
    export.add_argument("--batch", type=int, default=1, help="sequences per call (default 1)")
    export.add_argument("--context", type=int, default=None,
                        help="KV cache positions per sequence, prompt plus new tokens "
                             "(default: the model's max_position_embeddings)")
    export.add_argument("--prompt-length", type=int, default=None,
                        help="the prefill's padded prompt length (default: half the context)")
    export.add_argument("--executable", action="store_true",
                        help="also write the steps compiled for this machine's CPU "
                             "(serialize_executable; runs only with this JAX and jaxlib)")
    export.add_argument("--targets", default="", metavar="A,B",
                        help="also write the steps compiled for these named devices "
                             "(forge-jax compile's targets, e.g. h100,tpu-v5e) without the "
                             "device; each runs only on that device kind with this JAX and "
                             "jaxlib (needs the aot extra)")
    _flags.add_dtype_flag(export)
    export.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    """Loads the checkpoint and writes its exported steps to ``--out``."""
    from forge_jax.generation import export as export_lib
    from forge_jax.models import llama

    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    try:
        export_lib.check_platforms(platforms)
    except ValueError as e:
        raise UsageError(f"--{e}") from None
    if args.executable and "cpu" not in platforms:
        raise UsageError(f"--executable compiles for CPU; --platforms {args.platforms} has no cpu")
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if targets:
        # The targets' devices are abstract; JAX's own backends stay on the CPU (no effect
        # once a backend has started).
        import jax

        jax.config.update("jax_platforms", "cpu")
    try:
        export_lib.check_targets(targets)
    except ValueError as e:
        raise UsageError(f"--targets: {e}") from None
    try:
        export_lib.check_out(args.out)
    except ValueError as e:
        raise UsageError(f"--out: {e}") from None
    config, _, tokenizer, path = _checkpoint.read_checkpoint(args)
    _checkpoint.require_llama(config, path, "export")
    for flag in ("batch", "context", "prompt_length"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive int, got {value}")
    context = config.max_position_embeddings if args.context is None else args.context
    if context > config.max_position_embeddings:
        raise UsageError(f"--context {context} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    if args.prompt_length is not None and args.prompt_length >= context:
        raise UsageError(f"--prompt-length {args.prompt_length} must be below the context "
                         f"({context})")
    _flags.resolve_dtype(args)
    model = llama.from_pretrained(path, dtype=args.dtype)
    out = export_lib.export(
        model, args.out, batch=args.batch, context=context, prompt_length=args.prompt_length,
        platforms=platforms, executable=args.executable, targets=targets,
        # A directory's tokenizer.json as it is; a GGUF file's, built from its metadata.
        tokenizer=None if tokenizer is None else tokenizer if path.is_file()
        else path / "tokenizer.json")
    print(f"{_checkpoint.describe(model, path, args).replace('paged cache', 'contiguous cache')}"
          f"\nwrote {out}: prefill and decode for {', '.join(platforms)}, batch {args.batch}, "
          f"context {context}" + (", with CPU executables" if args.executable else "")
          + (f", with executables for {', '.join(targets)}" if targets else ""))
    return 0
