"""Compile report of the Mosaic GPU paged and ragged paged attention kernels for an H100,
without a device: for each case (bfloat16 pages, and int8/fp8 pages with their
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
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
from _mosaic_compile import BF16, S, paged_args, pool, report  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax.pallas_kernels.gpu import _mosaic  # noqa: E402
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as paged  # noqa: E402
from forge_jax.pallas_kernels.gpu import mosaic_ragged_paged_attention as ragged  # noqa: E402


def ragged_args(tokens, seqs, context, q_heads, kv_heads, head_dim, page, kv_format=None):
    per_seq = context // page
    pages = pool((kv_heads, seqs * per_seq, page, head_dim), kv_format)
    return (S((tokens, q_heads, head_dim), BF16), pages, pages, S((seqs, per_seq), jnp.int32),
            S((seqs,), jnp.int32), S((seqs + 1,), jnp.int32), S((), jnp.int32))


CASES = [
    ("paged decode, b32 ctx4096 32/8 d128 page16 (Llama-3-8B decode)", "paged_attention",
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


def _smem(kernel, args):
    """The shared memory of ``kernel``'s Mosaic GPU kernel over ``args``."""
    def read():
        fn, call_args = _kernel_call(kernel, args)
        return _mosaic.shared_memory_bytes(fn, *call_args)

    return read


def main() -> int:
    return report("h100", [(title, getattr(fj, op), args, _smem(kernel, args))
                           for title, op, args, kernel in CASES])


if __name__ == "__main__":
    sys.exit(main())
