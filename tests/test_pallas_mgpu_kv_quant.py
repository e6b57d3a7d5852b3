"""The Mosaic GPU paged and ragged paged attention kernels on quantized (int8, fp8) KV pools
(pallas_kernels/gpu/mosaic_paged_attention.py, mosaic_ragged_paged_attention.py).

The cases of :mod:`cases.kv_quant_base` (float64 references of what the stored values and
scales stand for; a NaN scale over random bytes in every slot no query may see) run compiled
on a Hopper GPU (skipped without one) and in the Mosaic GPU interpreter everywhere, with race
detection. Pages of 16 tokens take the scales gathered by XLA (one page's scales are 64
bytes, under a 128-byte TMA copy); pages of 32 copy each page's scales beside its values.
The accepted cases compile for H100 without a device (a Llama-3-8B decode shape with no
register spill in ptxas' report); a shared-memory limit is rejected by ``supports()`` and
fails the lowering.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import MosaicGpu
from cases.calls import case_id
from cases.kv_quant import quantized_pool
from cases.kv_quant_base import QuantizedPagedCases, QuantizedRaggedCases
from cases.paged import paged_attention_args, paged_attention_specs
from cases.paged_base import PagedCase

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as kernel
from forge_jax.pallas_kernels.gpu import mosaic_ragged_paged_attention as ragged

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
I8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
S = jax.ShapeDtypeStruct


class TestQuantizedPagedMosaicGpu(MosaicGpu, QuantizedPagedCases):
    """The kernel compiled for a Hopper GPU (skipped without one)."""

    IMPLEMENTATION = "mosaic_gpu"
    QUANT_CASES = {
        # Decode, GQA, pages of 16 (gathered scales): three 64-key blocks through the
        # interpreter's two-block ring; an empty sequence.
        "decode-gqa-int8-bf16_q-page16": (PagedCase(8, 2, 64, 16, None, BF16, (150, 0, 21)),
                                          "int8"),
        # Chunked prefill over pages of 32 (each page's scales copied): slots hidden from
        # some rows only, a window and a cap.
        "prefill-window-cap-fp8-f16_q-page32": (
            PagedCase(4, 2, 64, 32, 3, F16, (40, 9), window=5, cap=20.0), "fp8"),
    }


class TestQuantizedPagedMosaicGpuInterpret(TestQuantizedPagedMosaicGpu):
    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


class TestQuantizedRaggedMosaicGpu(MosaicGpu, QuantizedRaggedCases):
    """The ragged kernel compiled for a Hopper GPU (skipped without one)."""

    IMPLEMENTATION = "mosaic_gpu"
    HEAD_DIM = 64
    QUANT_RAGGED_CASES = {
        # Decode, chunked prefill and a sequence with no new token, SmolLM2's 9/3 heads.
        "mixed-smollm2-fp8-bf16_q": ("mixed", "smollm2", BF16, 16, "fp8"),
    }


class TestQuantizedRaggedMosaicGpuInterpret(TestQuantizedRaggedMosaicGpu):
    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


def _quantized(q_heads, kv_heads, head_dim, page_size, q_len, values, q_dtype=BF16):
    shapes = paged_attention_specs(q_heads, kv_heads, head_dim, page_size, q_len, values,
                                   q_dtype)
    scales = S(shapes[1].shape[:3] + (1,), F32)
    return shapes, scales


def _with_scales(**knobs):
    def run(q, k, v, tables, lengths, k_scales, v_scales):
        return kernel.paged_attention(q, k, v, tables, lengths, k_scales=k_scales,
                                      v_scales=v_scales, **knobs)
    return run


# (batch, pages a sequence, page_size, values, spill-free): Llama-3-8B's decode (32/8 heads,
# head_dim 128, context 4096) over pages of 16 (gathered scales) and of 32 (per-page scale
# copies). The kernel holds 255 registers; ptxas spills the page-32 case a few bytes under
# JAX 0.12 (none under 0.10), so only the page-16 decode shape is held to no spill.
COMPILED = [(32, 256, 16, jnp.int8, True), (8, 128, 32, jnp.float8_e4m3fn, False)]


@pytest.mark.target("h100")
@pytest.mark.parametrize("case", COMPILED, ids=lambda c: "-".join(map(case_id, c[:4])))
def test_accepted_cases_compile_for_h100(case):
    batch, per_seq, page_size, values, spill_free = case
    pool = S((8, batch * per_seq, page_size, 128), values)
    scales = S(pool.shape[:3] + (1,), F32)
    shapes = (S((batch, 32, 128), BF16), pool, pool, S((batch, per_seq), jnp.int32),
              S((batch,), jnp.int32))
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert kernel.supports(args) is None
    fn = _with_scales(sliding_window=9, logits_soft_cap=30.0)
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fn, *shapes, scales, scales, target="h100")
    assert report.compiled, report.error
    spills = [int(n) for ln in lines if "stack frame" in ln
              for n in re.findall(r"(\d+) bytes spill stores", ln)]
    assert len(spills) == 1 and (spills == [0] or not spill_free), lines
    (row,) = report.kernels
    kv_bytes = 2 * batch * per_seq * page_size * 8 * (128 + 4)
    assert row.costed and kv_bytes <= row.bytes_accessed < 1.1 * kv_bytes, row
    smem = _mosaic.shared_memory_bytes(fn, *shapes, scales, scales)
    config = kernel.default_config({"q": shapes[0]}, "NVIDIA H100 80GB HBM3")
    block_kv = kernel.block_keys(config.block_kv, page_size)
    stages = kernel.fitting_stages(2 * config.stages, head_dim=128, block_kv=block_kv,
                                   quantized=True)
    estimate = kernel.smem_bytes(head_dim=128, block_kv=block_kv, stages=stages,
                                 quantized=True)
    assert smem is None or estimate <= smem <= min(estimate + 4096, 227 * 1024), smem


def test_shared_memory_limit_is_rejected_and_fails_the_lowering():
    shapes, scales = _quantized(8, 2, 256, 128, None, I8)
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert "exceed the 223 KiB" in kernel.supports(args)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        _compat.export_for_cuda(_with_scales(stages=2), *shapes, scales, scales)


def test_one_byte_pages_past_head_dim_128_are_rejected():
    """Rows of 192 one-byte values do not tile the 128-byte swizzle (the lowering asserts,
    with no message); at 256 ptxas spills registers (48 bytes at Llama-3's decode, JAX
    0.10.2, BENCHMARKS.md)."""
    for head_dim in (192, 256):
        shapes, scales = _quantized(32, 8, head_dim, 16, None, I8)
        args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
        assert f"head_dim={head_dim} with int8/fp8 pages" in kernel.supports(args)
    shapes, scales = _quantized(32, 8, 192, 16, None, I8)
    with pytest.raises(AssertionError):
        _compat.export_for_cuda(_with_scales(), *shapes, scales, scales)


def test_ragged_quantized_step_lowers_for_h100():
    pages = S((8, 64, 16, 128), I8)
    scales = S((8, 64, 16, 1), F32)
    specs = dict(q=S((32, 32, 128), BF16), k_pages=pages, v_pages=pages,
                 block_tables=S((4, 16), jnp.int32), kv_lengths=S((4,), jnp.int32),
                 cu_q_lens=S((5,), jnp.int32), num_seqs=S((), jnp.int32))
    assert ragged.supports(specs | dict(k_scales=scales, v_scales=scales)) is None
    exported = _compat.export_for_cuda(
        lambda *a: ragged.ragged_paged_attention(*a[:7], k_scales=a[7], v_scales=a[8],
                                                 sliding_window=9),
        *specs.values(), scales, scales)
    assert "mosaic_gpu" in exported.mlir_module()


def test_rejections_name_the_reason_and_dispatch_refuses():
    """int8 pages with no scales, float32 queries over quantized pages (WGMMA's TF32 misses
    the float32 tolerance): refused by supports(), and by dispatch."""
    shapes, scales = _quantized(8, 2, 64, 16, None, I8)
    assert "k_pages.dtype=int8" in kernel.supports(paged_attention_args(shapes))
    shapes, scales = _quantized(8, 2, 64, 16, None, FP8, F32)
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert "q.dtype=float32: the Mosaic GPU paged kernel takes bfloat16/float16 queries" \
        in kernel.supports(args)
    gen = np.random.default_rng(0)
    pool = quantized_pool(gen, gen.standard_normal((2, 4, 16, 64)), "fp8")
    with pytest.raises(fj.ImplementationError, match="q.dtype=float32"):
        fj.paged_attention(jnp.zeros((1, 8, 64), F32), pool, pool, jnp.zeros((1, 4), jnp.int32),
                           jnp.ones((1,), jnp.int32), implementation="mosaic_gpu_interpret")
