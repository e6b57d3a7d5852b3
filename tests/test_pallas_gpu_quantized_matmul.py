"""The Pallas GPU (Triton lowering) quantized_matmul kernel
(pallas_kernels/gpu/quantized_matmul.py).

:class:`TestQuantizedMatmulPallasGpu` runs the compiled kernel (``"pallas"``, skipped without a
GPU of compute capability >= 8.0); :class:`TestQuantizedMatmulPallasGpuInterpret` the same
tests in Pallas' interpreter everywhere. Each case is one of SmolLM2-135M's projections (576
-> 1536 up, 1536 -> 576 down, 576 -> 960 fused q/k/v) at decode (1 to 16 rows) or prefill
rows, against a float64 product with the weight dequantized from its stored parts
(``cases.quant``; rounded to the activations' dtype where the kernel rounds it: group-wise
scales dequantize in registers before the dot). The real compile for a100 (ptxas, no spills)
is in tests/test_aot.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import ImplementationCases, PallasGpu
from cases.checks import assert_close
from cases.quant import dequantize, dequantize_rounded

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import quantized_matmul as kernel

# (format, group, symmetric, M, N, K, dtype)
CASES = {
    "int8-channel-decode-down-f32": ("int8", None, True, 1, 576, 1536, jnp.float32),
    "int8-channel-decode-up-bf16": ("int8", None, True, 16, 1536, 576, jnp.bfloat16),
    "int4-g32-decode-up-bf16": ("int4", 32, True, 1, 1536, 576, jnp.bfloat16),
    "int4-g64-qkv-f16": ("int4", 64, True, 7, 960, 576, jnp.float16),
    "int4-g128-asym-prefill-down-f32": ("int4", 128, False, 40, 576, 1536, jnp.float32),
    "int8-g32-prefill-f32": ("int8", 32, True, 33, 200, 576, jnp.float32),  # GGUF Q8_0
}


def _inputs(fmt, group, symmetric, m, n, k, dtype, seed=0):
    gen = np.random.default_rng(seed)
    q = fj.quantize(jnp.asarray(gen.normal(0, 0.05, (n, k)), jnp.float32), fmt,
                    group_size=group, symmetric=symmetric)
    return jnp.asarray(gen.normal(0, 1, (m, k)), dtype), q


def _reference(a, q):
    """float64 ``a @ W.T``: per-channel int8 multiplies exact values and scales the float32
    sum; group-wise scales dequantize in float32 and round to ``a.dtype`` first."""
    per_channel = q.format == "int8" and q.minimums is None and q.full_block()[1] == q.shape[1]
    w = dequantize(q) if per_channel else dequantize_rounded(q, a.dtype)
    return np.asarray(a, np.float64) @ w.T


class TestQuantizedMatmulPallasGpu(PallasGpu, ImplementationCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False

    @pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
    def test_matches_float64(self, case):
        a, q = _inputs(*case)
        assert kernel.supports(fj.dispatch.bind("quantized_matmul", a, q, trans_b=True)) is None
        out = jax.jit(lambda a, q: fj.matmul(a, q, trans_b=True,
                                             implementation=self.IMPLEMENTATION))(a, q)
        assert fj.dispatch.last_selection("quantized_matmul").implementation == \
            self.IMPLEMENTATION
        assert out.dtype == a.dtype
        assert_close(out, _reference(a, q), implementation=self.IMPLEMENTATION)

    def test_knobs_row_and_column_edges_alpha_beta_c(self):
        # 16-row blocks over 37 rows and 32-column blocks over 200: partial blocks both ways.
        a, q = _inputs("int4", 32, False, 37, 200, 256, jnp.float32, seed=1)
        c = jnp.asarray(np.random.default_rng(2).normal(size=(37, 200)), jnp.float32)
        out = kernel.quantized_matmul(a, q, trans_b=True, alpha=0.5, beta=2.0, c=c,
                                      out_dtype=jnp.float32, block_m=16, block_n=32,
                                      block_k=16, interpret=self.INTERPRET)
        ref = 0.5 * _reference(a, q) + 2.0 * np.asarray(c, np.float64)
        assert_close(out, ref, implementation=self.IMPLEMENTATION)


class TestQuantizedMatmulPallasGpuInterpret(TestQuantizedMatmulPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


def test_supports_names_what_it_refuses():
    a = jnp.ones((2, 256), jnp.float32)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(128, 256)), jnp.float32)
    refuse = lambda q, trans_b=True, a=a: kernel.supports(
        fj.dispatch.bind("quantized_matmul", a, q, trans_b=trans_b))
    assert refuse(fj.quantize(w, "int8")) is None
    assert "trans_b=False" in refuse(fj.quantize(w.T, "int8"), trans_b=False)
    assert "'fp8'" in refuse(fj.quantize(w, "fp8"))
    assert "(W8A8)" in refuse(fj.quantize(w, "int8", activations="int8"))
    assert "scales per group along K only" in refuse(fj.quantize(w, "int8", block=(2, 256)))
    assert "float64" in refuse(fj.quantize(w, "int8"), a=jax.ShapeDtypeStruct((2, 256),
                                                                              jnp.float64))


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_never_ranked_above_xla_before_a_gpu_ran_it(target):
    """Nothing was measured on a GPU: auto selection keeps XLA on every GPU (the kernel runs
    by name), as ``VERIFIED`` is empty."""
    assert kernel.VERIFIED == {}
    a, q = _inputs("int4", 32, True, 1, 256, 256, jnp.bfloat16)
    args = fj.dispatch.bind("quantized_matmul", a, q, trans_b=True)
    with fj.targets.use(target):
        assert fj.dispatch.select("quantized_matmul", args, "pallas").implementation == "pallas"
        assert fj.dispatch.select("quantized_matmul", args).implementation == "xla"


def test_tuning_tables():
    S = jax.ShapeDtypeStruct
    decode = kernel.default_config({"a": S((1, 576), jnp.bfloat16)}, "NVIDIA A100-SXM4-80GB")
    assert (decode.block_m, decode.block_n, decode.block_k) == (16, 32, 128)
    prefill = kernel.default_config({"a": S((4, 512, 576), jnp.bfloat16)}, None)
    assert (prefill.block_m, prefill.block_k) == (64, 32)
    f32 = kernel.default_config({"a": S((128, 576), jnp.float32)}, "NVIDIA A100-SXM4-80GB")
    assert (f32.block_m, f32.block_k) == (32, 16)
