"""The Pallas GPU rope kernel (pallas_kernels/gpu/rope.py).

:class:`TestRopePallasGpu` runs the compiled kernel (``"pallas"``, skipped without a GPU of
compute capability >= 8.0); :class:`TestRopePallasGpuInterpret` runs the same kernel code in
Pallas' interpreter everywhere. Each case of :class:`cases.elementwise_base.RopeCases` is
checked against the float64 reference (Hugging Face's definitions) and the XLA
implementation; the interpreter starts outputs as NaN (see test_pallas_gpu_norm.py), so an
unwritten element fails the finiteness check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasGpu
from cases.calls import by_id, case_id
from cases.checks import assert_close, assert_rope_close
from cases.elementwise_base import RopeCases
from cases.inputs import normal, rng, rope_inputs
from cases.references import f64
from cases.shapes import (
    LINEAR_SCALING,
    LLAMA31_SCALING,
    LLAMA31_THETA,
    PHI2_HEAD_DIM,
    SMOLLM_THETA,
)

import forge_jax as fj
from forge_jax import _compat, backends, dispatch
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import rope as kernel

LLAMA3 = LLAMA31_SCALING

# (batch, seq, heads, head_dim), dtype, theta, scaling, interleaved, first position:
# SmolLM 135M (9 query heads of 64, theta 1e5), Phi-2's head dim 80, Llama 3.1 8B
# (128, theta 5e5, llama3 scaling) at positions past 65536; both conventions.
CASES = [
    ((2, 5, 9, 64), jnp.bfloat16, SMOLLM_THETA, None, False, 3),
    ((1, 6, 9, PHI2_HEAD_DIM), jnp.float16, 1e4, LINEAR_SCALING, True, 17),
    ((3, 2, 9, PHI2_HEAD_DIM), jnp.bfloat16, 1e4, None, False, 0),
    ((2, 3, 4, 128), jnp.float32, LLAMA31_THETA, LLAMA3, False, 70000),
    ((1, 4, 2, 128), jnp.bfloat16, LLAMA31_THETA, LLAMA3, True, 70000),
]


def _id(value):
    return case_id(value) if not isinstance(value, bool) else ("interleaved" if value else
                                                               "rotate_half")


class TestRopePallasGpu(PallasGpu, RopeCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(CASES, _id)

    def test_vmap(self):
        x, pos = rope_inputs((2, 3, 9, 64), jnp.bfloat16, 5)
        fn = functools.partial(fj.rope, implementation=self.IMPLEMENTATION)
        xs = jnp.stack([x, -x])  # [2, batch, seq, heads, head_dim]
        out = jax.jit(jax.vmap(fn, in_axes=(0, None)))(xs, pos)
        for i in range(2):
            assert_rope_close(out[i], xs[i], pos, implementation=self.IMPLEMENTATION)

    @pytest.mark.parametrize("interleaved", [False, True], ids=_id)
    def test_grad_matches_xla_vjp_and_float64(self, interleaved):
        """The VJP is the XLA implementation's (custom_vjp: this checks its wiring, not the
        forward kernel, which the tests above check). A rotation's transpose is the
        rotation by the opposite angle, and float32(-p * f) = -float32(p * f) exactly, so
        the float64 reference of the gradient is RoPE of the cotangent at ``-positions``."""
        x, pos = rope_inputs((1, 4, 3, 80), jnp.float32, 70000)
        ct = normal(rng(1), x.shape)
        kw = dict(theta=5e5, scaling=LLAMA3, interleaved=interleaved)

        def loss(implementation, x):
            return jnp.sum(fj.rope(x, pos, implementation=implementation, **kw) * ct)

        grad = jax.jit(jax.grad(functools.partial(loss, self.IMPLEMENTATION)))(x)
        want = jax.jit(jax.grad(functools.partial(loss, "xla")))(x)
        assert_close(grad, f64(want), implementation=self.IMPLEMENTATION)
        assert_rope_close(grad, ct, -pos, implementation=self.IMPLEMENTATION, **kw)


class TestRopePallasGpuInterpret(TestRopePallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


# --- the contract with the CUDA lowering -------------------------------------------------


def _lower(x, pos, *, interleaved=False, scaling=None, **knobs):
    return _compat.export_for_cuda(
        lambda x, pos: kernel.rope(x, pos, theta=1e4, scaling=scaling, interleaved=interleaved,
                                   **knobs), x, pos)


@pytest.mark.parametrize("shape,dtype,interleaved,pos_dtype", [
    *[(c[0], c[1], c[4], jnp.int32) for c in CASES],
    ((3, 7, 12, 96), jnp.bfloat16, True, jnp.int16),
    ((1, 5, 8, 256), jnp.float16, False, jnp.uint32),
    ((2, 3, 32, 128), jnp.bfloat16, False, jnp.int32),   # more heads than one block
    ((1, 2, 3, kernel.MAX_HEAD_DIM), jnp.float32, True, jnp.int8),
], ids=_id)
def test_accepted_cases_lower_for_cuda(shape, dtype, interleaved, pos_dtype):
    x = jax.ShapeDtypeStruct(shape, dtype)
    pos = jax.ShapeDtypeStruct(shape[:2], pos_dtype)
    args = dict(x=x, positions=pos, theta=1e4, scaling=LLAMA3, interleaved=interleaved)
    assert kernel.supports(args) is None
    text = _lower(x, pos, interleaved=interleaved, scaling=LLAMA3).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "forge_jax_rope" in text


def test_non_power_of_two_blocks_fail_lowering():
    """Why the launch table holds powers of two: Triton refuses any other block."""
    for kind in kernel.TUNED:
        for knobs in kernel.TUNED[kind].values():
            launch = kernel.Config(**knobs)
            assert _common.next_pow2(launch.block_tokens) == launch.block_tokens
            assert _common.next_pow2(launch.block_heads) == launch.block_heads
    x = jax.ShapeDtypeStruct((1, 6, 9, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(x, jax.ShapeDtypeStruct((1, 6), jnp.int32), block_heads=9)


def test_launch_fills_small_head_counts_with_tokens():
    full = kernel.default_config({"x": np.empty((1, 1, 32, 128))})
    one = kernel.default_config({"x": np.empty((1, 1, 1, 128))})
    assert one.block_heads == 1 and full.block_heads == 16
    assert one.block_tokens * one.block_heads == full.block_tokens * full.block_heads


def test_rejections():
    """Head dims past the launch table (no released model has them) and float64 (not an
    inference dtype): policies, not lowering limits, so they are checked by name."""
    wide = jax.ShapeDtypeStruct((1, 2, 1, 2 * kernel.MAX_HEAD_DIM), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    args = dict(x=wide, positions=pos, theta=1e4, scaling=None, interleaved=False)
    assert "head_dim" in kernel.supports(args)
    with jax.enable_x64(True):
        x = jnp.asarray(rng(0).standard_normal((1, 2, 1, 8)))
        assert "float64" in kernel.supports(dict(args, x=x))
        with pytest.raises(dispatch.ImplementationError, match="float64"):
            fj.rope(x, jnp.zeros((1, 2), jnp.int32), implementation="pallas_gpu_interpret")


def test_pallas_rejects_compute_capability_below_8(monkeypatch):
    x, pos = rope_inputs((1, 2, 9, 64), jnp.bfloat16, 0)
    args = dict(x=x, positions=pos, theta=1e4, scaling=None, interleaved=False)
    pallas = dispatch.implementations("rope", "gpu")["pallas"]
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "7.5")
    assert "compute capability >= 8.0; this GPU has 7.5" in pallas.supports(args, "gpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "9.0")
    assert pallas.supports(args, "gpu") is None


def test_vmap_lowers_for_cuda():
    fn = jax.vmap(lambda x, pos: kernel.rope(x, pos, theta=1e4, scaling=None, interleaved=False),
                  in_axes=(0, None))
    text = _compat.export_for_cuda(fn, jax.ShapeDtypeStruct((2, 2, 3, 9, 64), jnp.bfloat16),
                                   jax.ShapeDtypeStruct((2, 3), jnp.int32)).mlir_module()
    assert "__gpu$xla.gpu.triton" in text
