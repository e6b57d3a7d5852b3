"""The Pallas GPU silu_mul kernel (pallas_kernels/gpu/silu_mul.py).

:class:`TestSiluMulPallasGpu` runs the compiled kernel (``"pallas"``, skipped without a GPU of
compute capability >= 8.0); :class:`TestSiluMulPallasGpuInterpret` runs the same kernel code
in Pallas' interpreter everywhere. Each case of :class:`cases.elementwise_base.SiluMulCases`
is checked against the float64 reference and the XLA implementation; the interpreter starts
outputs as NaN (see test_pallas_gpu_norm.py), so an unwritten element fails the finiteness
check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from cases.base import PallasGpu
from cases.calls import by_id, case_id, jcall
from cases.checks import assert_close
from cases.elementwise_base import SiluMulCases
from cases.inputs import normal, rng, silu_mul_inputs
from cases.references import f64, sigmoid_ref, silu_mul_ref
from cases.shapes import LLAMA3_8B_MLP, LLAMA32_1B_MLP, SMOLLM_MLP

import forge_jax as fj
from forge_jax import _compat, backends, dispatch
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import silu_mul as kernel

# (shape, dtype): the MLP widths of SmolLM 135M and Llama 3.2 1B at (batch, seq); sizes that
# end inside a block; a scalar.
CASES = [
    ((2, 3, SMOLLM_MLP), jnp.bfloat16),   # 9216 elements: 3 blocks, the last partly filled
    ((2, 5, LLAMA32_1B_MLP), jnp.float16),
    ((7, 999), jnp.float32),
    ((), jnp.float32),
]


class TestSiluMulPallasGpu(PallasGpu, SiluMulCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(CASES)

    def test_saturated_gates(self):
        """exp(-g) overflows for g << 0: the product must go to -0, not NaN."""
        gate = jnp.asarray([-1e4, -100.0, -30.0, 30.0, 100.0, 1e4, 0.5, -0.5], jnp.float32)
        up = normal(rng(3), gate.shape)
        out = jcall(fj.silu_mul, gate, up, implementation=self.IMPLEMENTATION)
        assert_close(out, silu_mul_ref(gate, up), implementation=self.IMPLEMENTATION)

    def test_vmap(self):
        gate, up = silu_mul_inputs((3, 2, 1536), jnp.bfloat16)
        fn = functools.partial(fj.silu_mul, implementation=self.IMPLEMENTATION)
        out = jax.jit(jax.vmap(fn))(gate, up)
        assert_close(out, silu_mul_ref(gate, up), implementation=self.IMPLEMENTATION)

    def test_grad_matches_xla_vjp_and_float64(self):
        """The VJP is the XLA implementation's (custom_vjp); also checked analytically."""
        gate, up = silu_mul_inputs((3, 1536), jnp.float32)
        ct = normal(rng(1), gate.shape)

        def loss(implementation, gate, up):
            return jnp.sum(fj.silu_mul(gate, up, implementation=implementation) * ct)

        grads = jax.jit(jax.grad(functools.partial(loss, self.IMPLEMENTATION),
                                 argnums=(0, 1)))(gate, up)
        want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1)))(gate, up)
        g, u, c, s = f64(gate), f64(up), f64(ct), sigmoid_ref(gate)
        ref = (c * u * s * (1.0 + g * (1.0 - s)), c * g * s)
        for name, grad, g_xla, g_ref in zip(("gate", "up"), grads, want, ref, strict=True):
            assert_close(grad, f64(g_xla), implementation=self.IMPLEMENTATION, err_msg=name)
            assert_close(grad, g_ref, implementation=self.IMPLEMENTATION, factor=4, err_msg=name)

    def test_empty(self):
        gate, up = silu_mul_inputs((2, 0, 8), jnp.bfloat16)
        out = jcall(fj.silu_mul, gate, up, implementation=self.IMPLEMENTATION)
        assert out.shape == (2, 0, 8) and out.dtype == jnp.bfloat16


class TestSiluMulPallasGpuInterpret(TestSiluMulPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


# --- the contract with the CUDA lowering -------------------------------------------------


def _lower(gate, up, **knobs):
    return _compat.export_for_cuda(lambda g, u: kernel.silu_mul(g, u, **knobs), gate, up)


@pytest.mark.parametrize("shape,dtype", CASES + [((4, LLAMA3_8B_MLP), jnp.bfloat16)], ids=case_id)
def test_accepted_cases_lower_for_cuda(shape, dtype):
    gate = jax.ShapeDtypeStruct(shape, dtype)
    assert kernel.supports(dict(gate=gate, up=gate)) is None
    text = _lower(gate, gate).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "forge_jax_silu_mul" in text


def test_non_power_of_two_block_fails_lowering():
    """Why the launch table holds powers of two: Triton refuses any other block."""
    for kind in (None, "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"):
        block = kernel.default_config({}, kind).block_size
        assert _common.next_pow2(block) == block, kind
    gate = jax.ShapeDtypeStruct((7, 999), jnp.float32)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(gate, gate, block_size=1000)


def test_rejects_huge_arrays():
    """Block offsets are int32 (a correctness limit; the lowering would not catch it)."""
    gate = jax.ShapeDtypeStruct((2**15, 2**15 + 1), jnp.bfloat16)
    assert "int32" in kernel.supports(dict(gate=gate, up=gate))


def test_rejects_float64_by_name():
    """float64 is not an inference dtype; the kernel serves f32/bf16/f16 (a policy)."""
    with jax.enable_x64(True):
        gate = jnp.asarray(rng(0).standard_normal((2, 64)))
        assert "float64" in kernel.supports(dict(gate=gate, up=gate))
        with pytest.raises(dispatch.ImplementationError, match="float64"):
            fj.silu_mul(gate, gate, implementation="pallas_gpu_interpret")


def test_pallas_rejects_compute_capability_below_8(monkeypatch):
    gate, up = silu_mul_inputs((2, 64), jnp.bfloat16)
    pallas = dispatch.implementations("silu_mul", "gpu")["pallas"]
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "7.5")
    assert "compute capability >= 8.0; this GPU has 7.5" in pallas.supports(
        dict(gate=gate, up=up), "gpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "8.6")
    assert pallas.supports(dict(gate=gate, up=up), "gpu") is None


def test_vmap_lowers_for_cuda():
    gate = jax.ShapeDtypeStruct((3, 2, 1536), jnp.bfloat16)
    text = _compat.export_for_cuda(jax.vmap(kernel.silu_mul), gate, gate).mlir_module()
    assert "__gpu$xla.gpu.triton" in text
