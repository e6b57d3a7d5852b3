"""``forge-jax demo``: every op once on fresh random data, a PASS/FAIL verdict per op against
its tolerance (the work is ``forge_jax.demo``'s)."""

from __future__ import annotations

import argparse

from forge_jax.cli import _flags


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo", help="run each op once and check it against NumPy",
        description="Runs every op once on fresh random inputs with the implementation auto "
                    "selection picks here and checks each result against a float64 NumPy "
                    "reference within the op's tolerance: one PASS/FAIL line per op; exit 1 "
                    "if any fails.")
    demo.add_argument("--seed", type=int, default=0, help="the random inputs' seed")
    demo.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    _flags.check_seed(args.seed)
    _flags.check_implementation_env()
    from forge_jax import demo

    return 0 if demo.run(args.seed) else 1
