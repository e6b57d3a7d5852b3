"""``forge-jax info``: versions, devices, toolchains and the implementations of each op."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    subparsers.add_parser(
        "info", help="versions, devices, toolchains and implementations",
        description="Prints the versions of forge_jax, JAX and jaxlib, the devices JAX sees, "
                    "the compiler toolchains found (ptxas, libtpu), and each op's registered "
                    "implementations with the one auto selection picks here and why."
    ).set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    import jax

    from forge_jax import backends

    print(backends.summary())
    if jax.default_backend() == "cpu":
        print("\nquantized weights (--quantize): on CPU, int8 and int4 decode measured no faster "
              "than float32 and fp8 several times slower (BENCHMARKS.md); they save memory, "
              "and are never a default here")
    print("\nquantized KV cache (--kv-cache-dtype int8|fp8): a byte per key/value element and "
          "a float32 scale per token and KV head, (head_dim + 4) / (2 * head_dim) of a "
          "bfloat16 cache's bytes (0.53x at head_dim 64, 0.52x at 128); on CPU an int8 cache "
          "decoded no slower than float32 and an fp8 one about twice as slow (BENCHMARKS.md), "
          "so neither is a default")
    return 0
