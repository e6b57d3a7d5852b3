"""Compile report of the Blackwell (tcgen05, tensor memory) Mosaic GPU kernels for a B200,
without a device: the paged decode kernel
(``pallas_kernels/gpu/mosaic_paged_attention_sm100.py``), the int8/fp8 quantized matmul
(``mosaic_quantized_matmul_sm100.py``) and flash attention (``mosaic_attention_sm100.py``),
each through its op with ``implementation="mosaic_gpu"`` under ``fj.aot.compile(...,
target="b200")`` (Mosaic GPU's lowering, its PTX and ``ptxas`` for sm_100a, XLA's GPU
pipeline): ptxas' registers and spills (``_mosaic.ptxas_report``), the shared memory
Mosaic's lowering allocates (``_mosaic.shared_memory_bytes``, lowered as for the b200) and
the roofline predicted from the kernel's cost estimate at the B200's peaks (8 TB/s, 2250
TFLOP/s of dense bf16). Compiled, not
run: the figures BENCHMARKS.md records. Run it alone: the first Mosaic GPU compile of a
process fixes the architecture ptxas runs for.

Usage::

    python benchmarks/compile_mosaic_blackwell.py   # needs the ``aot`` extra; a minute
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _mosaic_compile import BF16, S, paged_args, report  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax.pallas_kernels.gpu import _mosaic  # noqa: E402


def matmul_args(rows, n, k, fmt):
    q = jax.eval_shape(lambda w: fj.quantize(w, fmt), S((n, k), jnp.float32))
    return S((rows, k), BF16), q


def attention_args(batch, seq, q_heads, kv_heads, head_dim):
    return (S((batch, seq, q_heads, head_dim), BF16), S((batch, seq, kv_heads, head_dim), BF16),
            S((batch, seq, kv_heads, head_dim), BF16))


def _matmul(a, q, **kw):
    return fj.matmul(a, q, trans_b=True, **kw)


CASES = [
    ("flash attention, causal prefill b1 seq4096 32/8 d128 (Llama-3-8B)", fj.attention,
     attention_args(1, 4096, 32, 8, 128)),
    ("flash attention, causal prefill b2 seq2048 9/3 d64 (SmolLM2)", fj.attention,
     attention_args(2, 2048, 9, 3, 64)),
    ("paged decode, b32 ctx4096 32/8 d128 page16 (Llama-3-8B decode)", fj.paged_attention,
     paged_args(32, 4096, 32, 8, 128, 16)),
    ("paged decode, b32 ctx4096 9/3 d64 page16 (SmolLM2)", fj.paged_attention,
     paged_args(32, 4096, 9, 3, 64, 16)),
    ("paged decode, b4 ctx32768 32/8 d128 page16", fj.paged_attention,
     paged_args(4, 32768, 32, 8, 128, 16)),
    ("paged decode, b8 ctx4096 32/8 d256 page64", fj.paged_attention,
     paged_args(8, 4096, 32, 8, 256, 64)),
    ("int8 matmul, decode 1 row, 4096 -> 14336 (Llama-3-8B up_proj)", _matmul,
     matmul_args(1, 14336, 4096, "int8")),
    ("fp8 matmul, decode 8 rows, 14336 -> 4096 (Llama-3-8B down_proj)", _matmul,
     matmul_args(8, 4096, 14336, "fp8")),
    ("int8 matmul, decode 1 row, 576 -> 1536 (SmolLM2 up_proj)", _matmul,
     matmul_args(1, 1536, 576, "int8")),
    ("int8 matmul, prefill 128 rows, 4096 -> 14336", _matmul,
     matmul_args(128, 14336, 4096, "int8")),
]


def _smem(fn, args):
    """The shared memory of ``fn``'s Mosaic GPU kernel, lowered as for the b200."""
    def read():
        with fj.targets.use("b200"):
            return _mosaic.shared_memory_bytes(
                lambda *a: fn(*a, implementation="mosaic_gpu"), *args)

    return read


def main() -> int:
    return report("b200", [(title, fn, args, _smem(fn, args)) for title, fn, args in CASES])


if __name__ == "__main__":
    sys.exit(main())
