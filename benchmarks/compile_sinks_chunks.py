"""Compile report of the attention kernels with attention sinks (gpt-oss) and chunked
attention (Llama 4), without a device: for each case, ``fj.aot.compile`` with the kernel's
implementation for ``--target`` (``h100``: the Triton-lowered kernels and the Mosaic GPU
(Hopper) flash, paged and ragged kernels, ptxas for sm_90a; ``b200``: the Mosaic GPU
Blackwell (tcgen05) flash and paged decode kernels; ``tpu-v5e``: the Mosaic TPU kernels and
libtpu), then per kernel its registers and spills (GPU; ptxas' report for the Mosaic GPU
kernels), shared memory and the roofline predicted from its cost estimate. Compiled, not
run: the figures BENCHMARKS.md records. One target per process (the first Mosaic GPU
compile of a process fixes ptxas' architecture).

Shapes are the models': gpt-oss-20b's attention (64 query / 8 KV heads of 64, a window of
128 on alternate layers, a sink per head), Llama-4-Scout's (40 / 8 heads of 128, chunks of
8192 tokens on three layers in four).

Usage::

    python benchmarks/compile_sinks_chunks.py --target h100
    python benchmarks/compile_sinks_chunks.py --target b200
    flock /tmp/libtpu.lock python benchmarks/compile_sinks_chunks.py --target tpu-v5e
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import forge_jax as fj  # noqa: E402
from forge_jax.pallas_kernels.gpu import _mosaic  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
GPT_OSS = (64, 8, 64)
LLAMA4 = (40, 8, 128)
SINKS = dict(sinks=S((64,), F32))


def dense(q_len, kv_len, heads):
    q_heads, kv_heads, d = heads
    return (S((1, q_len, q_heads, d), BF16), S((1, kv_len, kv_heads, d), BF16),
            S((1, kv_len, kv_heads, d), BF16))


def paged(batch, context, heads, *, q_len=None, page=16):
    q_heads, kv_heads, d = heads
    per_seq = context // page
    pool = S((kv_heads, batch * per_seq, page, d), BF16)
    q = S((batch, q_heads, d) if q_len is None else (batch, q_len, q_heads, d), BF16)
    return q, pool, pool, S((batch, per_seq), I32), S((batch,), I32)


def ragged(tokens, seqs, context, heads, page=16):
    q_heads, kv_heads, d = heads
    per_seq = context // page
    pool = S((kv_heads, seqs * per_seq, page, d), BF16)
    return (S((tokens, q_heads, d), BF16), pool, pool, S((seqs, per_seq), I32), S((seqs,), I32),
            S((seqs + 1,), I32), S((), I32))


# (label, op, abstract arguments, keywords, {target: implementation or implementations})
MOSAIC = ("pallas", "mosaic_gpu")
CASES = [
    ("attention prefill 2048, gpt-oss 64/8 d64, window 128, sinks", "attention",
     dense(2048, 2048, GPT_OSS), dict(sliding_window=128, **SINKS),
     {"h100": MOSAIC, "b200": "mosaic_gpu", "tpu-v5e": "pallas"}),
    ("attention prefill 2048 at 14336-16383, Llama 4 40/8 d128, chunk 8192", "attention",
     dense(2048, 16384, LLAMA4), dict(attention_chunk_size=8192),
     {"h100": MOSAIC, "b200": "mosaic_gpu", "tpu-v5e": "pallas"}),
    ("paged decode b32 ctx4096, gpt-oss, window 128, sinks", "paged_attention",
     paged(32, 4096, GPT_OSS), dict(sliding_window=128, **SINKS),
     {"h100": "pallas", "tpu-v5e": "pallas"}),
    ("paged decode b32 ctx4096, gpt-oss, window 128, sinks (Mosaic GPU)", "paged_attention",
     paged(32, 4096, GPT_OSS), dict(sliding_window=128, **SINKS), {"h100": "mosaic_gpu"}),
    ("paged decode b8 ctx16384, Llama 4, chunk 8192", "paged_attention",
     paged(8, 16384, LLAMA4), dict(attention_chunk_size=8192),
     {"h100": MOSAIC, "b200": "mosaic_gpu", "tpu-v5e": "pallas"}),
    ("paged chunk b8 q_len12 ctx16384, Llama 4, chunk 8192", "paged_attention",
     paged(8, 16384, LLAMA4, q_len=12), dict(attention_chunk_size=8192),
     {"h100": "mosaic_gpu"}),
    ("paged chunk b8 q_len16 ctx16384, Llama 4, chunk 8192", "paged_attention",
     paged(8, 16384, LLAMA4, q_len=16), dict(attention_chunk_size=8192),
     {"h100": "pallas", "tpu-v5e": "pallas"}),
    ("ragged 512 rows / 32 seqs ctx4096, gpt-oss, window 128, sinks", "ragged_paged_attention",
     ragged(512, 32, 4096, GPT_OSS), dict(sliding_window=128, **SINKS),
     {"h100": "mosaic_gpu", "tpu-v5e": "pallas"}),
    ("ragged 512 rows / 8 seqs ctx16384, Llama 4, chunk 8192", "ragged_paged_attention",
     ragged(512, 8, 16384, LLAMA4), dict(attention_chunk_size=8192),
     {"h100": "mosaic_gpu", "tpu-v5e": "pallas"}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100", choices=["h100", "b200", "tpu-v5e"])
    args = parser.parse_args(argv)
    print(f"target {args.target}, JAX {jax.__version__}: compiled, not run")
    print("| case | implementation | kernel | registers | spilled bytes | shared memory "
          "| predicted roofline |")
    print("|---|---|---|---|---|---|---|")
    for label, op, operands, kwargs, impls in CASES:
        impls = impls.get(args.target, ())
        for impl in (impls,) if isinstance(impls, str) else impls:
            report_case(label, op, operands, kwargs, impl, args.target)


def report_case(label, op, operands, kwargs, impl, target):
    """Prints the case's rows: one per kernel of its compile for ``target``."""
    with _mosaic.ptxas_report() as lines:  # the Mosaic GPU kernels' ptxas figures
        report = fj.aot.compile(getattr(fj, op), *operands, target=target,
                                implementation=impl, **kwargs)
    if not report.compiled:
        print(f"| {label} | {impl} | not compiled: {report.error} | | | | |")
        return
    registers = [int(n) for ln in lines for n in re.findall(r"Used (\d+) registers", ln)]
    spills = [int(n) for ln in lines if "stack frame" in ln
              for n in re.findall(r"(\d+) bytes spill stores", ln)]
    for k in report.kernels:
        regs, spilled = k.registers, k.spilled_bytes
        if regs is None and impl == "mosaic_gpu" and len(registers) == len(spills) == 1:
            regs, spilled = registers[0], spills[0]
        smem = "-" if not k.shared_memory else f"{k.shared_memory / 1024:.1f} KiB"
        print(f"| {label} | {impl} | {k.name} | {regs or '-'} | "
              f"{'-' if spilled is None else spilled} | {smem} | "
              f"{k.roofline_seconds * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
