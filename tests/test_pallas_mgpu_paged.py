"""The Mosaic GPU paged-attention kernel (pallas_kernels/gpu/mosaic_paged_attention.py).

:class:`TestPagedAttentionMosaicGpu` runs the kernel compiled on a Hopper-or-newer GPU
(``"mosaic_gpu"``, skipped without one); :class:`TestPagedAttentionMosaicGpuInterpret` runs
the same cases in the Mosaic GPU interpreter on any machine, with race detection (each test
asserts none was found) and NaN-poisoned uninitialised memory (kernel outputs included: an
output the kernel never writes fails the finiteness checks). The behaviours (float64
reference and XLA, NaN / +-inf in every cache slot no query may see, huge integers in unused
block-table entries, per-query NaN/inf) come from :class:`cases.paged_base.PagedAttentionCases`.

Sizes for the interpreter on two cores (each program of the launch is interpreted in turn):
one to three sequences per case, lengths ending inside pages, one long enough for two splits
of three key blocks each (the interpreter's ring is two blocks deep, so the copies wrap
around it). The H100 lowering runs here too (JAX's Mosaic
GPU lowering, with its shared-memory and TMA checks; the PTX compile and ``ptxas`` run only
when a GPU loads the kernel, so registers and spills need a GPU).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import MosaicGpu
from cases.calls import case_id
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import paged_attention_args, paged_attention_specs
from cases.paged_base import PagedAttentionCases, PagedCase, nan_pools_under
from cases.ptxas import NEEDS_H100, compile_h100
from cases.references import f64
from cases.shapes import LLAMA3_8B_HEADS, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct


class TestPagedAttentionMosaicGpu(MosaicGpu, PagedAttentionCases):
    """The kernel compiled for a Hopper+ GPU (skipped without one)."""

    IMPLEMENTATION = "mosaic_gpu"
    INTERPRET = False
    CASES = {
        # Llama-3-8B heads, bfloat16 decode, 22 pages: two splits of three 64-key blocks
        # (the interpreter's ring is two blocks deep: the copies wrap around it).
        "llama3_8b-bf16-decode": PagedCase(*LLAMA3_8B_HEADS, 16, None, BF16, (330,)),
        # SmolLM2 9/3 heads, float16 chunked prefill: window (leading blocks skipped), cap,
        # explicit positions earlier than the end with a padded query (position -1), an
        # empty sequence.
        "smollm2-f16-prefill-window-cap-positions": PagedCase(
            *SMOLLM2_135M_HEADS, 8, 4, F16, (13, 0, 150), window=6, cap=20.0,
            explicit_positions=True),
        # Attention sinks (gpt-oss's 64 / 8 heads of 64, its window), joined in the merge.
        "gptoss-bf16-decode-sinks-window": PagedCase(64, 8, 64, 16, None, BF16, (150, 0, 40),
                                                     window=24, sinks=True),
        "smollm2-f16-prefill-sinks-positions": PagedCase(
            *SMOLLM2_135M_HEADS, 8, 4, F16, (13, 0, 150), window=6, sinks=True,
            explicit_positions=True),
        # Llama 4's chunks (40 / 8 heads of 128; 8192 scaled down): a decode query's chunk
        # starts its key range, a prefill chunk's rows in two chunks are masked per row.
        "llama4-bf16-decode-chunk": PagedCase(40, 8, 128, 16, None, BF16, (150, 0, 40),
                                              chunk=64),
        "llama4-f16-prefill-chunk-positions": PagedCase(40, 8, 128, 8, 4, F16, (13, 0, 150),
                                                        chunk=16, explicit_positions=True),
    }
    NONFINITE_CASES = {
        "causal-bf16": PagedCase(4, 2, 64, 16, 3, BF16, (70, 21)),
        "sinks-bf16": PagedCase(4, 2, 64, 16, 3, BF16, (70, 21), sinks=True),
        "chunk-sinks-bf16": PagedCase(4, 2, 64, 16, 3, BF16, (70, 21), chunk=8, sinks=True),
    }


class TestPagedAttentionMosaicGpuInterpret(TestPagedAttentionMosaicGpu):
    """The same kernel in the Mosaic GPU interpreter, on any machine."""

    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


# --- supports() and the H100 lowering -------------------------------------------------------

# (q_heads, kv_heads, head_dim, page_size, q_len, dtype); Llama-3's decode is compiled whole
# below.
ACCEPTED = [(*SMOLLM2_135M_HEADS, 8, 4, F16), (32, 8, 256, 16, None, BF16)]


def _lower(case, **knobs):
    shapes = paged_attention_specs(*case)
    return _compat.export_for_cuda(lambda *a: kernel.paged_attention(*a, **knobs), *shapes)


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda c: "-".join(map(case_id, c)))
def test_accepted_cases_lower_for_h100_within_shared_memory(case):
    shapes = paged_attention_specs(*case)
    assert kernel.supports(paged_attention_args(shapes)) is None
    text = _lower(case, sliding_window=7, logits_soft_cap=30.0).mlir_module()
    assert "mosaic_gpu" in text
    smem = _mosaic.shared_memory_bytes(kernel.paged_attention, *shapes)
    config = kernel.default_config({"q": shapes[0]}, "NVIDIA H100 80GB HBM3")
    block_kv = kernel.block_keys(config.block_kv, case[3])
    stages = kernel.fitting_stages(config.stages, head_dim=case[2], block_kv=block_kv)
    estimate = kernel.smem_bytes(head_dim=case[2], block_kv=block_kv, stages=stages)
    assert smem is None or estimate <= smem <= min(estimate + 4096, 227 * 1024), smem


@NEEDS_H100
def test_llama_decode_compiles_for_h100_with_its_cost():
    """A Llama-3-8B decode shape (batch 32, context 4096, 32/8 heads, head_dim 128, page 16)
    through fj.aot: the kernel's row carries its cost estimate (the K/V bytes it reads)."""
    pool = S((8, 32 * 256, 16, 128), BF16)
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fj.paged_attention, S((32, 32, 128), BF16), pool, pool,
                                S((32, 256), jnp.int32), S((32,), jnp.int32), target="h100",
                                implementation="mosaic_gpu")
    assert report.compiled, report.error
    # ptxas ran on the kernel: its registers, and no spill (255 registers and 48 bytes of
    # spills before a decode launch compiled out the several-positions bookkeeping).
    spills = [int(n) for ln in lines for n in re.findall(r"(\d+) bytes spill stores", ln)]
    registers = [int(n) for ln in lines for n in re.findall(r"Used (\d+) registers", ln)]
    assert len(spills) == len(registers) == 1 and spills == [0] and registers[0] < 255, lines
    (row,) = [k for k in report.kernels if k.name == "forge_jax_mosaic_paged_attention"]
    kv_bytes = 2 * 32 * 4096 * 8 * 128 * 2
    assert row.costed and kv_bytes <= row.bytes_accessed < 1.05 * kv_bytes, row
    assert row.roofline_seconds == pytest.approx(
        row.bytes_accessed / fj.targets.get("h100").memory_bandwidth)


@NEEDS_H100
def test_gptoss_decode_with_sinks_compiles_for_h100():
    """gpt-oss's decode (64 / 8 heads of 64, window 128) with sinks: they join in the XLA
    merge of the splits; the kernel is the one without them."""
    pool = S((8, 512, 16, 64), BF16)
    report = fj.aot.compile(fj.paged_attention, S((8, 64, 64), BF16), pool, pool,
                            S((8, 64), jnp.int32), S((8,), jnp.int32), target="h100",
                            implementation="mosaic_gpu", sliding_window=128,
                            sinks=S((64,), jnp.float32))
    assert report.compiled, report.error
    assert [k.name for k in report.kernels] == ["forge_jax_mosaic_paged_attention"]
    assert report.kernels[0].costed, report.kernels


# Several query positions (a chunk of q_len tokens): the path that keeps a non-finite value
# out of the rows that do not see it, which once spilled 48 bytes at head_dim 128.
SEVERAL_POSITIONS = [(*heads, 16, q_len, dtype) for heads, q_len in (
    (SMOLLM2_135M_HEADS, 7), (LLAMA3_8B_HEADS, 16)) for dtype in (BF16, F16)]


@NEEDS_H100
@pytest.mark.parametrize("case", SEVERAL_POSITIONS, ids=lambda c: "-".join(map(case_id, c)))
def test_several_positions_compile_for_h100_without_spills(case):
    shapes = paged_attention_specs(*case)
    assert kernel.supports(paged_attention_args(shapes)) is None
    report, spills, registers = compile_h100(
        fj.paged_attention, *shapes, implementation="mosaic_gpu", sliding_window=9,
        logits_soft_cap=30.0)
    assert report.compiled, report.error
    assert spills == [0] and len(registers) == 1, (spills, registers)


@NEEDS_H100
def test_wide_head_dims_with_several_positions_are_refused_and_spill():
    """Past head_dim 128 the several-positions path holds two ``[64, head_dim]`` float32
    accumulators: supports() refuses it (XLA or Triton serve it), and forced, ptxas spills
    (56 bytes at head_dim 192, JAX 0.10.2). A decode launch of the same head_dim is
    accepted."""
    shapes = paged_attention_specs(32, 8, 192, 16, 8, BF16)
    assert "head_dim=192 with several query positions" in kernel.supports(
        paged_attention_args(shapes))
    assert kernel.supports(paged_attention_args(
        paged_attention_specs(32, 8, 192, 16, None, BF16))) is None
    report, spills, _ = compile_h100(kernel.paged_attention, *shapes)
    assert report.compiled, report.error
    assert len(spills) == 1 and spills[0] > 0, spills


# Rejections that are compile limits, and how the lowering refuses each when forced.
LIMITS = {
    "page_size_12": ((8, 2, 64, 12, None, BF16), "page_size=12", {},
                     (ValueError, "divisible by the tile size")),
    # The lowering asserts (no message) on rows of 192 bytes under the 128-byte swizzle.
    "head_dim_96": ((8, 2, 96, 16, None, BF16), "head_dim=96", {}, (AssertionError, None)),
    "page_size_512": ((8, 2, 64, 512, None, BF16), "page_size=512", {},
                      (ValueError, "exceeds available shared memory")),
    "shared_memory": ((8, 2, 256, 128, None, BF16), "exceed the 223 KiB", dict(stages=2),
                      (ValueError, "exceeds available shared memory")),
    # Gemma 4's head_dim 512 (8 / 4 heads): past one TMA copy, and one stage of its blocks
    # alone overflows shared memory (281624 bytes in the lowering).
    "head_dim_512": ((8, 4, 512, 16, None, BF16), "more than 228352 (the H100 lowering",
                     dict(stages=1), (ValueError, "exceeds available shared memory")),
}


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_compile_limits_are_rejected_and_fail_the_lowering(name):
    case, reason, knobs, (error, failure) = LIMITS[name]
    assert reason in (kernel.supports(paged_attention_args(paged_attention_specs(*case))) or "")
    with pytest.raises(error, match=failure):
        _lower(case, **knobs)


@pytest.mark.parametrize("shapes,match", [
    (paged_attention_specs(8, 2, 64, 16, None, F32), "q.dtype=float32: the Mosaic"),
    (paged_attention_specs(8, 2, 64, 16, None, BF16, F16), "q.dtype=float16 differs"),
    (paged_attention_specs(8, 2, 64, 16, 17, BF16), "q_len=17 * group=4 = 68 query rows > 64"),
], ids=["float32", "mixed_dtypes", "rows"])
def test_other_rejections_name_the_reason(shapes, match):
    """float32 (WGMMA's TF32 misses the float32 tolerance), mixed dtypes (one WGMMA operand
    dtype), more query rows than one tile: refused by supports(), and by dispatch."""
    assert match in (kernel.supports(paged_attention_args(shapes)) or "")
    args = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    with pytest.raises(fj.ImplementationError, match=match.split(" ")[0]):
        fj.paged_attention(*args, implementation="mosaic_gpu_interpret")


def test_rows_past_one_tile_are_refused_by_the_wrapper():
    with pytest.raises(ValueError, match="68 query rows > 64"):
        _lower((8, 2, 64, 16, 17, BF16))


def test_registered_needs_hopper_and_is_not_auto_selected_until_verified():
    assert kernel.VERIFIED == {}
    assert "mosaic_gpu" in fj.dispatch.implementations("paged_attention", "gpu")
    assert "mosaic_gpu_interpret" in fj.dispatch.implementations("paged_attention")
    specs = paged_attention_specs(32, 8, 128, 16, None, BF16)
    args = fj.dispatch.bind("paged_attention", *specs)
    record = fj.dispatch.implementations("paged_attention", "gpu")["mosaic_gpu"]
    with fj.targets.use("a100"):
        assert "compute capability >= 9.0" in record.supports(args, "gpu")
    with fj.targets.use("h100"):
        assert record.supports(args, "gpu") is None
        assert fj.explain("paged_attention", *paged_attention_specs(
            32, 8, 128, 16, None, BF16)).implementation != "mosaic_gpu"


def test_traced_out_of_range_entries_read_nothing_and_lengths_clamp():
    """The index contract under jit: a used entry outside the pool (negative, num_pages,
    2**30) reads nothing and a length past the table is clamped. The pool is NaN wherever no
    valid entry points, so a read of any other page shows; against XLA's implementation of
    the contract on the same arguments (its float64 truth is the same attention over the
    named slots)."""
    gen = rng(22)
    num_pages, page, max_pages = 10, 16, 4
    tables = np.array([[1, 99, 4, -7], [-1, 2, 2**30, -1], [5, num_pages, 3, 0],
                       [0, 6, 7, 8]], np.int32)
    lengths = np.array([40, 20, 48, 1000], np.int32)
    k, v = nan_pools_under(tables, lengths, num_pages=num_pages, page=page,
                           max_pages=max_pages, gen=gen)
    q = jnp.asarray(gen.standard_normal((4, 8, 64)), BF16)
    run = jax.jit(fj.paged_attention, static_argnames="implementation")
    out = run(q, k, v, tables, lengths, implementation="mosaic_gpu_interpret")
    xla = run(q, k, v, tables, lengths, implementation="xla")
    assert_close(out, f64(xla), dtype=BF16, implementation="mosaic_gpu_interpret")


# Llama 4's chunks (40 / 8 heads of 128, chunks of 8192): decode (the chunk starts the key
# range; the single-position kernel unchanged) and a prefill chunk of 12 tokens (the chunk
# masked per row), with gpt-oss's sinks beside them.
CHUNK_COMPILES = {"llama4-decode-chunk": (None, {}),
                  "llama4-prefill-chunk-sinks": (12, dict(sinks=S((40,), jnp.float32)))}


@NEEDS_H100
@pytest.mark.parametrize("name", CHUNK_COMPILES)
def test_chunks_compile_for_h100_without_spills(name):
    q_len, extra = CHUNK_COMPILES[name]
    pool = S((8, 512, 16, 128), BF16)
    q = S((8, 40, 128) if q_len is None else (8, q_len, 40, 128), BF16)
    args = (q, pool, pool, S((8, 64), jnp.int32), S((8,), jnp.int32))
    assert kernel.supports(dict(q=q, k_pages=pool, v_pages=pool, attention_chunk_size=8192,
                                **extra)) is None
    report, spills, registers = compile_h100(fj.paged_attention, *args,
                                             implementation="mosaic_gpu",
                                             attention_chunk_size=8192, **extra)
    assert report.compiled, report.error
    assert [k.name for k in report.kernels] == ["forge_jax_mosaic_paged_attention"]
    # No spills; the registers may reach the cap (255: JAX 0.12's Mosaic GPU compiler gives the
    # prefill case with sinks 255 where 0.10's gives 220, still without a spill).
    assert spills == [0] and len(registers) == 1 and registers[0] <= 255, (spills, registers)
