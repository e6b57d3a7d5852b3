"""``fj.grouped_matmul`` on CPU: its XLA implementation (a loop over row-tile/group visits)
against ``jax.lax.ragged_dot`` (``implementation="ragged_dot"``) and a loop over the groups
that multiplies every row by each group's matrix and keeps the group's rows (what a
grouped product costs without a schedule). Float32, group sizes traced, tokens routed to
experts uniformly at random; prints the best and median of ``--iters`` calls of each, and
the largest difference from the XLA implementation.

Usage::

    python benchmarks/grouped_matmul_cpu.py [--iters 7] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import forge_jax as fj  # noqa: E402

# (rows m, k, n, groups): decode (fewer rows than experts) and prefill, Mixtral-like 8
# experts and Qwen3-MoE-like 64, at sizes a CPU runs in milliseconds.
SHAPES = [(8, 512, 1024, 8), (256, 512, 1024, 8), (16, 512, 512, 64), (1024, 512, 512, 64)]
QUICK = [(8, 32, 16, 4)]


def per_group_loop(x, w, group_sizes):
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])

    def body(i, out):
        mine = (rows >= starts[i]) & (rows < ends[i])
        return out + jnp.where(mine[:, None], x @ w[i], 0.0)

    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    return jax.lax.fori_loop(0, w.shape[0], body, out).astype(x.dtype)


CONTENDERS = {
    "xla (visit loop)": lambda x, w, s: fj.grouped_matmul(x, w, s, implementation="xla"),
    "ragged_dot": lambda x, w, s: fj.grouped_matmul(x, w, s, implementation="ragged_dot"),
    "loop over groups": per_group_loop,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one tiny shape (a smoke test)")
    args = parser.parse_args(argv)
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"{'m':>5} {'k':>5} {'n':>5} {'groups':>6}  {'implementation':18s} "
          f"{'best ms':>9} {'median ms':>10}  max |diff|")
    for m, k, n, g in (QUICK if args.quick else SHAPES):
        gen = np.random.default_rng(0)
        x = jnp.asarray(gen.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(gen.standard_normal((g, k, n)), jnp.float32)
        sizes = jnp.asarray(np.bincount(gen.integers(0, g, m), minlength=g), jnp.int32)
        want = None
        for name, fn in CONTENDERS.items():
            call = jax.jit(fn)
            out = call(x, w, sizes).block_until_ready()
            want = out if want is None else want
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                call(x, w, sizes).block_until_ready()
                times.append(1e3 * (time.perf_counter() - start))
            diff = float(jnp.abs(out - want).max())
            print(f"{m:5d} {k:5d} {n:5d} {g:6d}  {name:18s} {min(times):9.2f} "
                  f"{statistics.median(times):10.2f}  {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
