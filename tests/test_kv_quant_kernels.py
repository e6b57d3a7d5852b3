"""The Pallas kernels on quantized (int8, fp8) KV pools: the cases of
:mod:`cases.kv_quant_base` in the interpreters (and compiled where the hardware is), the
Triton lowering for CUDA of quantized pages, and the rejections of kernels that read only
float pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from cases.base import PallasGpu, PallasTpu
from cases.calls import case_id
from cases.kv_quant_base import QuantizedPagedCases, QuantizedRaggedCases
from cases.paged import paged_attention_args, paged_attention_specs
from cases.paged_base import PagedCase

from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import paged_attention as gpu_kernel
from forge_jax.pallas_kernels.tpu import paged_attention as tpu_kernel

F32, BF16 = jnp.float32, jnp.bfloat16
I8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
S = jax.ShapeDtypeStruct


class TestQuantizedPagedPallasGpu(PallasGpu, QuantizedPagedCases):
    """The GPU kernel compiled (skipped without a GPU)."""

    IMPLEMENTATION = "pallas"
    QUANT_CASES = {
        # Decode over several splits, GQA, bfloat16 queries; an empty sequence.
        "decode-gqa-fp8-bf16_q": (PagedCase(8, 2, 32, 8, None, BF16, (20, 0, 64)), "fp8"),
        # Chunked prefill: slots hidden from some rows only; a window and a cap.
        "prefill-window-cap-int8": (PagedCase(4, 2, 32, 8, 3, F32, (30, 9), window=5,
                                              cap=20.0), "int8"),
    }


class TestQuantizedPagedPallasGpuInterpret(TestQuantizedPagedPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


class TestQuantizedPagedPallasTpu(PallasTpu, QuantizedPagedCases):
    """The TPU kernel compiled (skipped without a TPU). Pages of 32 tokens: the sublane
    tile of int8 and fp8, since a block's pages merge into one operand in VMEM."""

    IMPLEMENTATION = "pallas"
    QUANT_CASES = {
        # Decode over three blocks of one page, GQA; a window and bfloat16 queries over fp8.
        "decode-gqa-int8": (PagedCase(8, 2, 32, 32, None, F32, (0, 70)), "int8"),
        "prefill-window-fp8-bf16_q": (PagedCase(4, 2, 32, 32, 3, BF16, (40,), window=5),
                                      "fp8"),
    }


class TestQuantizedPagedPallasTpuInterpret(TestQuantizedPagedPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


class TestQuantizedRaggedPallasTpu(PallasTpu, QuantizedRaggedCases):
    """The TPU ragged kernel compiled (skipped without a TPU); pages of 32 tokens."""

    IMPLEMENTATION = "pallas"
    HEAD_DIM = 32
    QUANT_RAGGED_CASES = {
        "mixed-gqa-int8": ("mixed", "gqa", F32, 32, "int8"),
        "decode-mqa-fp8-bf16_q": ("decode", "mqa", BF16, 32, "fp8"),
    }


class TestQuantizedRaggedPallasTpuInterpret(TestQuantizedRaggedPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def _quantized_args(q_heads, kv_heads, head_dim, page_size, q_len, values, q_dtype):
    q, k, v, t, n = paged_attention_specs(q_heads, kv_heads, head_dim, page_size, q_len,
                                          values, q_dtype)
    scales = S(k.shape[:3] + (1,), F32)
    return (q, k, v, t, n), scales


@pytest.mark.parametrize("case", [(32, 8, 128, 16, None, I8, BF16), (9, 3, 80, 8, 4, FP8, F32),
                                  (8, 1, 64, 32, 16, I8, F32)],
                         ids=lambda c: "-".join(map(case_id, c)))
def test_gpu_kernel_quantized_pages_lower_for_cuda(case):
    shapes, scales = _quantized_args(*case)
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert gpu_kernel.supports(args) is None
    exported = _compat.export_for_cuda(
        lambda q, k, v, t, n, ks, vs: gpu_kernel.paged_attention(q, k, v, t, n, k_scales=ks,
                                                                 v_scales=vs),
        *shapes, scales, scales)
    text = exported.mlir_module()
    assert "forge_jax_paged_attention" in text and "__gpu$xla.gpu.triton" in text


def test_gpu_kernel_rejects_integer_pages_without_scales():
    shapes, _ = _quantized_args(8, 2, 64, 16, None, I8, F32)
    assert "k_pages.dtype=int8" in gpu_kernel.supports(paged_attention_args(shapes))


def test_tpu_kernel_takes_quantized_pages_in_whole_sublane_tiles():
    shapes, scales = _quantized_args(8, 2, 128, 32, None, I8, F32)
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert tpu_kernel.supports(args) is None
    shapes, scales = _quantized_args(8, 2, 128, 16, None, FP8, F32)
    args = paged_attention_args(shapes) | dict(k_scales=scales, v_scales=scales)
    assert "page_size=16 is not a multiple of 32" in tpu_kernel.supports(args)
    assert "k_pages.dtype=int8" in tpu_kernel.supports(paged_attention_args(
        _quantized_args(8, 2, 128, 32, None, I8, F32)[0]))
