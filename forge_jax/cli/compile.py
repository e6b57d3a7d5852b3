"""``forge-jax compile``: a checkpoint's prefill and decode steps compiled for a named target
(``forge_jax.targets``) without the device, each step's compile report printed
(:func:`forge_jax.aot.compile`): memory, per-kernel registers, spills, shared memory and
roofline time, copies outside the kernels. Exit 1 when a step does not compile."""

from __future__ import annotations

import argparse

from forge_jax.cli import _checkpoint, _flags
from forge_jax.cli._checkpoint import read_checkpoint
from forge_jax.cli._run import UsageError


def add_parser(subparsers) -> None:
    from forge_jax import targets

    cmd = subparsers.add_parser(
        "compile", help="compile a checkpoint's steps for a target device, without the device",
        description="Compiles the model's prefill and decode steps (abstract weights, paged "
                    "KV cache) with the target's real compiler on this machine, the kernels "
                    "chosen as auto selection would there (or --implementation), and prints "
                    "each step's compile report. Needs the aot extra "
                    "(pip install 'forge-jax[aot]').")
    cmd.add_argument("--target", required=True, choices=sorted(targets.TARGETS),
                     help="the device to compile for")
    _checkpoint.add_flags(cmd, help="a Hugging Face Llama-family directory (default: the "
                                    "tiny model); only config.json is read")
    cmd.add_argument("--batch", type=int, default=1, help="sequences per step (default 1; "
                     "padded to a power of two, as generate pads it)")
    cmd.add_argument("--context", type=int, default=128, help="prompt tokens of the prefill "
                     "(bucketed as generate buckets them) and cache positions for decode "
                     "(default 128)")
    cmd.add_argument("--page-size", type=int, default=16, help="KV cache page size (default 16)")
    _flags.add_dtype_flag(cmd)
    cmd.add_argument("--implementation", default=None,
                     help="preferred op implementation (forge_jax.use_implementation), e.g. "
                          "pallas (default: auto selection as on the target)")
    cmd.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    """Compiles the prefill and decode steps for ``args.target``; 1 if one fails."""
    import jax

    # The target's devices are abstract; JAX's own backends stay on the CPU (a CUDA or TPU
    # plugin must not try to start on a machine without the device). No effect once a
    # backend has started.
    jax.config.update("jax_platforms", "cpu")

    import forge_jax as fj
    from forge_jax.generation import abstract_steps as aot_steps

    for flag in ("batch", "context", "page_size"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, flag)}")
    _flags.check_implementation_env()
    if args.implementation is not None:
        try:
            fj.dispatch.check_name(args.implementation, "--implementation")
        except ValueError as e:
            raise UsageError(str(e)) from None
    target = fj.targets.get(args.target)
    reason = fj.targets.missing(target)
    if reason is not None:
        raise UsageError(f"cannot compile for {target.name}: {reason}")
    config, _, _, path = read_checkpoint(args)
    _checkpoint.require_llama(config, path, "compile")
    with fj.targets.use(target):
        _flags.resolve_dtype(args)
        with fj.use_implementation(args.implementation):
            steps = aot_steps.abstract_steps(config, batch=args.batch, context=args.context,
                                             dtype=args.dtype, page_size=args.page_size)
    print(f"{path}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads}/{config.num_key_value_heads} heads, head_dim "
          f"{config.head_dim}; batch {args.batch}, context {args.context}, {args.dtype}, "
          f"paged cache ({aot_steps.pool_bytes(steps[0]) / 2**20:.1f} MiB pool); "
          f"implementation {args.implementation or 'auto'}")
    print(f"target {target}")
    failed = False
    for step in steps:
        fj.dispatch.clear_selections()
        report = fj.aot.compile(step.fn, *step.args, target=target,
                                implementation=args.implementation, **step.statics)
        print(f"\n{step.name} step: {report}")
        chosen = fj.dispatch.last_selections()
        if chosen:
            print("  ops: " + ", ".join(f"{op} {s.implementation}"
                                        for op, s in sorted(chosen.items())))
        failed |= not report.compiled
    return 1 if failed else 0
