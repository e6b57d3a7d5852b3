"""Compile report of the Mosaic GPU paged and ragged paged attention kernels for an H100,
without a device (issue 26): for each case (bfloat16 pages, and int8/fp8 pages with their
scales), ``fj.aot.compile`` with ``implementation="mosaic_gpu"`` (Mosaic GPU's lowering, its
PTX and ``ptxas`` for sm_90a, XLA's GPU pipeline), ptxas' registers and spills
(``_mosaic.ptxas_report``), the shared memory Mosaic's lowering allocates
(``_mosaic.shared_memory_bytes``) and the roofline predicted from the kernel's cost estimate.
Compiled, not run: the figures BENCHMARKS.md records. (Blackwell's tcgen05 decode kernel:
``benchmarks/compile_mosaic_blackwell.py``, in a process of its own: the first Mosaic GPU
compile of a process fixes the architecture ptxas runs for.)

Usage::

    python benchmarks/compile_mosaic_paged.py   # needs the ``aot`` extra; a few minutes
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import forge_jax as fj  # noqa: E402
from forge_jax.ops import kv_quant  # noqa: E402
from forge_jax.pallas_kernels.gpu import _mosaic  # noqa: E402
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as paged  # noqa: E402
from forge_jax.pallas_kernels.gpu import mosaic_ragged_paged_attention as ragged  # noqa: E402

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _pool(shape, kv_format):
    if kv_format is None:
        return S(shape, BF16)
    return jax.eval_shape(lambda: kv_quant.empty_pool(shape, kv_format, BF16))


def paged_args(batch, context, q_heads, kv_heads, head_dim, page, q_len=None, kv_format=None):
    per_seq = context // page
    pool = _pool((kv_heads, batch * per_seq, page, head_dim), kv_format)
    q = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    return (S(q, BF16), pool, pool, S((batch, per_seq), jnp.int32), S((batch,), jnp.int32))


def ragged_args(tokens, seqs, context, q_heads, kv_heads, head_dim, page, kv_format=None):
    per_seq = context // page
    pool = _pool((kv_heads, seqs * per_seq, page, head_dim), kv_format)
    return (S((tokens, q_heads, head_dim), BF16), pool, pool, S((seqs, per_seq), jnp.int32),
            S((seqs,), jnp.int32), S((seqs + 1,), jnp.int32), S((), jnp.int32))


CASES = [
    ("paged decode, b32 ctx4096 32/8 d128 page16 (the issue's shape)", "paged_attention",
     paged_args(32, 4096, 32, 8, 128, 16), paged.paged_attention),
    ("paged decode, b32 ctx4096 9/3 d64 page16 (SmolLM2)", "paged_attention",
     paged_args(32, 4096, 9, 3, 64, 16), paged.paged_attention),
    ("paged decode, b4 ctx32768 32/8 d128 page16", "paged_attention",
     paged_args(4, 32768, 32, 8, 128, 16), paged.paged_attention),
    ("paged chunk, b8 q_len16 ctx4096 32/8 d128 page16", "paged_attention",
     paged_args(8, 4096, 32, 8, 128, 16, q_len=16), paged.paged_attention),
    ("ragged, 512 rows over 32 seqs ctx4096 32/8 d128 page16", "ragged_paged_attention",
     ragged_args(512, 32, 4096, 32, 8, 128, 16), ragged.ragged_paged_attention),
    ("int8 paged decode, b32 ctx4096 32/8 d128 page16 (gathered scales)", "paged_attention",
     paged_args(32, 4096, 32, 8, 128, 16, kv_format="int8"), paged.paged_attention),
    ("fp8 paged decode, b32 ctx4096 32/8 d128 page16 (gathered scales)", "paged_attention",
     paged_args(32, 4096, 32, 8, 128, 16, kv_format="fp8"), paged.paged_attention),
    ("int8 paged decode, b32 ctx4096 32/8 d128 page32 (per-page scale copies)",
     "paged_attention", paged_args(32, 4096, 32, 8, 128, 32, kv_format="int8"),
     paged.paged_attention),
    ("int8 paged decode, b32 ctx4096 9/3 d64 page16 (SmolLM2)", "paged_attention",
     paged_args(32, 4096, 9, 3, 64, 16, kv_format="int8"), paged.paged_attention),
    ("int8 paged chunk, b8 q_len16 ctx4096 32/8 d128 page16", "paged_attention",
     paged_args(8, 4096, 32, 8, 128, 16, q_len=16, kv_format="int8"), paged.paged_attention),
    ("fp8 ragged, 512 rows over 32 seqs ctx4096 32/8 d128 page16", "ragged_paged_attention",
     ragged_args(512, 32, 4096, 32, 8, 128, 16, kv_format="fp8"),
     ragged.ragged_paged_attention),
    ("paged chunk, b8 q_len7 ctx4096 9/3 d64 page16 (SmolLM2)", "paged_attention",
     paged_args(8, 4096, 9, 3, 64, 16, q_len=7), paged.paged_attention),
    ("ragged, 512 rows over 32 seqs ctx4096 9/3 d64 page16 (SmolLM2)", "ragged_paged_attention",
     ragged_args(512, 32, 4096, 9, 3, 64, 16), ragged.ragged_paged_attention),
]


def _kernel_call(kernel, args):
    """``kernel`` over ``args`` (quantized pools as values and scales) and its arguments."""
    pools = [i for i, a in enumerate(args) if isinstance(a, fj.QuantizedArray)]
    if not pools:
        return kernel, args
    k, v = (args[i] for i in pools)
    flat = [a.values if isinstance(a, fj.QuantizedArray) else a for a in args]

    def fn(*a):
        return kernel(*a[:-2], k_scales=a[-2], v_scales=a[-1])

    return fn, (*flat, k.scales, v.scales)


def main() -> int:
    missing = fj.targets.missing("h100")
    if missing:
        print(f"cannot compile for h100 here: {missing}", file=sys.stderr)
        return 2
    print(f"# jax {jax.__version__}; compiled for h100 without a device, not run")
    failed = False
    for title, op, args, kernel in CASES:
        with _mosaic.ptxas_report() as lines:
            report = fj.aot.compile(getattr(fj, op), *args, target="h100",
                                    implementation="mosaic_gpu")
        failed |= not report.compiled
        fn, call_args = _kernel_call(kernel, args)
        smem = _mosaic.shared_memory_bytes(fn, *call_args)
        print(f"### {title}\n{report}")
        print("  ptxas: " + " | ".join(ln for ln in lines if "spill stores" in ln
                                         or "registers" in ln))
        if smem is not None:
            print(f"  Mosaic GPU shared memory (lowering): {smem} B = {smem / 1024:.1f} KiB")
        print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
