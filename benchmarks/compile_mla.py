"""Deviceless compile reports (compiled, not run) of the multi-head latent attention kernels:
a DeepSeek-V3 decode step on one tensor-parallel shard (128 heads over 8 devices: 16 heads;
latent 512 + RoPE 64, pages of 64 tokens, bfloat16) for an H100 (Triton lowering) and a TPU
v5e/v6e (Mosaic, the latent cache's 640-lane pool), with XLA's implementation beside each.

    python benchmarks/compile_mla.py [--batch 64] [--context 4096]

TPU compiles load libtpu, which one process at a time may hold: on a shared machine wrap
the command in ``flock`` on the lock the other libtpu users take.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import forge_jax as fj
from forge_jax.kv_cache.latent import pool_width

S = jax.ShapeDtypeStruct
HEADS, RANK, ROPE, NOPE, V, PAGE = 16, 512, 64, 128, 128, 64


def decode_step(batch: int, context: int, width: int):
    per_seq = context // PAGE
    bf16 = jnp.bfloat16
    return (S((batch, HEADS, NOPE), bf16), S((batch, HEADS, ROPE), bf16),
            S((batch * per_seq, PAGE, width), bf16), S((RANK, HEADS, NOPE), bf16),
            S((RANK, HEADS, V), bf16), S((batch, per_seq), jnp.int32), S((batch,), jnp.int32),
            S((batch + 1,), jnp.int32), S((), jnp.int32))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--targets", default="h100,tpu-v5e,tpu-v6e")
    args = parser.parse_args(argv)
    print(f"JAX {jax.__version__}; decode, {args.batch} sequences of {args.context} tokens, "
          f"{HEADS} heads, latent {RANK} + RoPE {ROPE}, pages of {PAGE}, bfloat16")
    for target in args.targets.split(","):
        platform = fj.targets.get(target).platform
        step = decode_step(args.batch, args.context, pool_width(RANK, ROPE, platform=platform))
        for implementation in ("pallas", "xla"):
            # A function of its own per implementation: one jitted function's trace would be
            # reused for the second.
            report = fj.aot.compile(lambda *a: fj.mla_paged_attention(*a), *step,
                                    target=target, implementation=implementation)
            print(f"\n[{target}, implementation={implementation!r}]")
            print(report if report.compiled else f"not compiled: {report.error}")


if __name__ == "__main__":
    main()
