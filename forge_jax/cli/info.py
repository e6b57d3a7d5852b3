"""``forge-jax info``: versions, devices, toolchains and the implementations of each op."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    subparsers.add_parser(
        "info", help="versions, devices, toolchains and implementations").set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from forge_jax import backends

    print(backends.summary())
    return 0
