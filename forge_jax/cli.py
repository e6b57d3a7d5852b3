"""The ``forge-jax`` command line: ``info``, ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
import sys
import time


def _info(args: argparse.Namespace) -> int:
    from forge_jax import backends

    print(backends.summary())
    return 0


def _demo(args: argparse.Namespace) -> int:
    """A short tour: each op once, checked against NumPy, with the implementation used."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import forge_jax as fj
    from forge_jax import dispatch

    key = iter(jax.random.split(jax.random.key(args.seed), 8))
    b, t, n, kv, h = 2, 8, 8, 2, 64
    q = jax.random.normal(next(key), (b, t, n, h))
    k = jax.random.normal(next(key), (b, t, kv, h))
    v = jax.random.normal(next(key), (b, t, kv, h))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit
    def block(q, k, v, pos):
        q, k = fj.rope(q, pos), fj.rope(k, pos)
        return fj.attention(q, k, v)

    t0 = time.perf_counter()
    out = block(q, k, v, pos).block_until_ready()
    print(f"rope + causal GQA attention {tuple(out.shape)} under jit: "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms (incl. compile)")
    # A decode query (q_len 1) is bottom-right aligned: it sees every key.
    full, dec = fj.attention(q, k, v), fj.attention(q[:, -1:], k, v)
    err = float(jnp.abs(dec - full[:, -1:]).max())
    print(f"decode query (q_len 1) vs last row of the full causal pass: max |diff| {err:.1e}")
    x = jax.random.normal(next(key), (4, 256))
    w = jax.random.normal(next(key), (256,))
    y = fj.rms_norm(x, w, eps=1e-6)
    xn = np.asarray(x, np.float64)
    ref = np.asarray(w) * xn / np.sqrt((xn * xn).mean(-1, keepdims=True) + 1e-6)
    print(f"rms_norm max |err| vs NumPy float64: {np.abs(np.asarray(y) - ref).max():.2e}")
    print("\nimplementations used:")
    for op, sel in sorted(dispatch.last_selections().items()):
        print(f"  {op:10s} {sel.implementation} ({sel.source}, {sel.platform})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forge-jax", description="forge_jax: functional JAX kernels for LLM inference")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="versions, devices, toolchains and implementations").set_defaults(
        fn=_info)
    demo = sub.add_parser("demo", help="run each op once and check it against NumPy")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    if not hasattr(args, "fn"):
        parser.print_help()
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
