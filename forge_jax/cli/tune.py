"""``forge-jax tune``: every op of a Llama checkpoint autotuned at the shapes and dtype
``generate`` and ``chat`` run its prefill and decode steps with (paged cache), the fastest
stored in the autotune cache that auto selection follows."""

from __future__ import annotations

import argparse

from forge_jax.cli import _checkpoint, _flags
from forge_jax.cli._checkpoint import read_checkpoint
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    tune = subparsers.add_parser(
        "tune", help="autotune every op at a checkpoint's shapes (default: the tiny model)",
        description="Times the implementations (and launch configurations) of each op at the "
                    "model's prefill and decode shapes on this device and stores the fastest "
                    "in the autotune cache, which auto selection then follows.")
    _checkpoint.add_flags(tune, help="a Hugging Face Llama-family directory")
    tune.add_argument("--batch", type=int, default=1, help="prompts per generate call "
                      "(default 1; padded to a power of two, as generate pads it)")
    tune.add_argument("--seq-len", type=int, default=128, help="prompt tokens (default 128; "
                      "padded to generate's bucket, a power of two, at least 8)")
    tune.add_argument("--max-new-tokens", type=int, default=256,
                      help="as given to generate (sizes the paged KV cache; default 256)")
    _flags.add_dtype_flag(tune)
    tune.add_argument("--iters", type=int, default=10, help="timed calls per candidate")
    tune.add_argument("--implementations", metavar="A,B",
                      help="the implementations to time, each for the ops that have it (default: "
                           "those auto selection could choose here; name unverified kernels, "
                           "e.g. xla,pallas,triton,cudnn, to let the measurement decide)")
    tune.add_argument("--force", action="store_true", help="time again what the cache holds")
    tune.set_defaults(fn=run)


def _implementation_names(text: str) -> list[str]:
    """``--implementations A,B``, each a registered name."""
    from forge_jax import dispatch

    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        try:
            dispatch.check_name(name, "--implementations:")
        except ValueError as e:
            raise UsageError(str(e)) from None
    return names


def run(args: argparse.Namespace) -> int:
    """Autotunes every op of a Llama checkpoint at the shapes of its prefill and decode steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import forge_jax as fj
    from forge_jax import autotuning
    from forge_jax.generation import op_shapes as llama_ops

    for flag in ("batch", "seq_len", "iters", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, flag)}")
    _flags.check_implementation_env()
    _flags.resolve_dtype(args)
    names = _implementation_names(args.implementations) if args.implementations else None
    config, _, _, path = read_checkpoint(args)
    calls = llama_ops.op_calls(config, batch=args.batch, seq_len=args.seq_len,
                               dtype=jnp.dtype(args.dtype), rng=np.random.default_rng(0),
                               max_new_tokens=args.max_new_tokens)
    print(f"{path}: tuning {len(calls)} op calls of generate (batch {args.batch}, prefill "
          f"{args.seq_len} tokens and decode, paged cache, {args.dtype}) on "
          f"{jax.devices()[0].device_kind}")
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
