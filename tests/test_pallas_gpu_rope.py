"""The Pallas GPU rope kernel (pallas_kernels/gpu/rope.py).

``TestRopePallas`` runs the compiled kernel (``"pallas"``, skipped without a GPU of compute
capability >= 8.0); ``TestRopeInterpret`` runs the same kernel code in Pallas' interpreter
everywhere. Each case is checked against the float64 reference (Hugging Face's definitions)
and the XLA implementation; the interpreter starts outputs as NaN (see
test_pallas_gpu_norm.py), so an unwritten element fails the finiteness check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import case_id, jcall
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import f64, rope_angles_ref, rope_ref

import forge_jax as fj
from forge_jax import _compat, backends, dispatch, tolerances
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import rope as kernel

LLAMA3 = fj.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
LINEAR = fj.RopeScaling("linear", 4.0)

# (batch, seq, heads, head_dim), dtype, theta, scaling, interleaved, first position:
# SmolLM 135M (9 query heads of 64, theta 1e5), Phi-2's head dim 80, Llama 3.1 8B
# (128, theta 5e5, llama3 scaling) at positions past 65536; both conventions.
CASES = [
    ((2, 5, 9, 64), jnp.bfloat16, 1e5, None, False, 3),
    ((1, 6, 9, 80), jnp.float16, 1e4, LINEAR, True, 17),
    ((3, 2, 9, 80), jnp.bfloat16, 1e4, None, False, 0),
    ((2, 3, 4, 128), jnp.float32, 5e5, LLAMA3, False, 70000),
    ((1, 4, 2, 128), jnp.bfloat16, 5e5, LLAMA3, True, 70000),
]


def inputs(shape, dtype, start, seed=0):
    gen = rng(seed, shape[-1])
    x = normal(gen, shape, dtype)
    # Increasing positions from `start`, a different offset per sequence (left padding).
    positions = start + np.arange(shape[1])[None, :] + 11 * np.arange(shape[0])[:, None]
    return x, jnp.asarray(positions, jnp.int32)


def assert_rope_close(out, x, positions, implementation, **kw):
    """``out`` agrees with the float64 RoPE of ``x``, allowing, on top of the dtype
    tolerance, the angle error of the float32 frequency table (as tests/test_ops.py does):
    Hugging Face's float32 ``pow`` leaves it a few ulp from the correctly rounded table,
    and at position p an angle carries ~4 ulp of the frequency times p. The kernel and the
    XLA implementation share the table, so they are also compared at the plain tolerance."""
    ref = rope_ref(x, positions, **kw)
    slack = 4 * 2.0**-24 * np.abs(rope_angles_ref(positions, x.shape[-1], theta=kw["theta"],
                                                  scaling=kw["scaling"]))
    x = f64(x)
    if kw["interleaved"]:
        mag = np.repeat(np.abs(x[..., 0::2]) + np.abs(x[..., 1::2]), 2, axis=-1)
        slack = np.repeat(slack, 2, axis=-1)
    else:
        half = x.shape[-1] // 2
        mag = np.tile(np.abs(x[..., :half]) + np.abs(x[..., half:]), 2)
        slack = np.concatenate([slack, slack], axis=-1)
    out64 = f64(out)
    assert np.isfinite(out64).all()
    tol = tolerances.tolerance(out.dtype, implementation)
    bound = tol.atol + tol.rtol * np.abs(ref) + mag * slack[:, :, None, :]
    excess = np.abs(out64 - ref) - bound
    assert (excess <= 0).all(), f"{np.sum(excess > 0)} elements off by up to {excess.max()}"


def _id(value):
    return case_id(value) if not isinstance(value, bool) else ("interleaved" if value else
                                                               "rotate_half")


class TestRopePallas:
    IMPLEMENTATION = "pallas"

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if self.IMPLEMENTATION == "pallas" and (reason := _common.gpu_reason("gpu")):
            pytest.skip(f"compiled Triton kernel: {reason} (the interpret subclass runs here)")

    @pytest.mark.parametrize("shape,dtype,theta,scaling,interleaved,start", CASES, ids=_id)
    def test_matches_reference_and_xla(self, shape, dtype, theta, scaling, interleaved, start):
        x, pos = inputs(shape, dtype, start)
        kw = dict(theta=theta, scaling=scaling, interleaved=interleaved)
        out = jcall(fj.rope, x, pos, implementation=self.IMPLEMENTATION, **kw)
        assert out.dtype == dtype and out.shape == shape
        assert_rope_close(out, x, pos, self.IMPLEMENTATION, **kw)
        want = jcall(fj.rope, x, pos, implementation="xla", **kw)
        assert_close(out, f64(want), implementation=self.IMPLEMENTATION)

    def test_vmap(self):
        x, pos = inputs((2, 3, 9, 64), jnp.bfloat16, 5)
        fn = functools.partial(fj.rope, implementation=self.IMPLEMENTATION)
        xs = jnp.stack([x, -x])  # [2, batch, seq, heads, head_dim]
        out = jax.jit(jax.vmap(fn, in_axes=(0, None)))(xs, pos)
        for i in range(2):
            assert_rope_close(out[i], xs[i], pos, self.IMPLEMENTATION, theta=1e4,
                              scaling=None, interleaved=False)

    @pytest.mark.parametrize("interleaved", [False, True], ids=_id)
    def test_grad_matches_xla_vjp_and_float64(self, interleaved):
        """The VJP is the XLA implementation's (custom_vjp: this checks its wiring, not the
        forward kernel, which the tests above check). A rotation's transpose is the
        rotation by the opposite angle, and float32(-p * f) = -float32(p * f) exactly, so
        the float64 reference of the gradient is RoPE of the cotangent at ``-positions``."""
        x, pos = inputs((1, 4, 3, 80), jnp.float32, 70000)
        ct = normal(rng(1), x.shape)
        kw = dict(theta=5e5, scaling=LLAMA3, interleaved=interleaved)

        def loss(implementation, x):
            return jnp.sum(fj.rope(x, pos, implementation=implementation, **kw) * ct)

        grad = jax.jit(jax.grad(functools.partial(loss, self.IMPLEMENTATION)))(x)
        want = jax.jit(jax.grad(functools.partial(loss, "xla")))(x)
        assert_close(grad, f64(want), implementation=self.IMPLEMENTATION)
        assert_rope_close(grad, ct, -pos, self.IMPLEMENTATION, **kw)


class TestRopeInterpret(TestRopePallas):
    IMPLEMENTATION = "pallas_gpu_interpret"


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
    for kind in _common.TUNING:
        for knobs in _common.TUNING[kind].get("rope", {}).values():
            launch = kernel.Launch(**knobs)
            assert _common.next_pow2(launch.block_tokens) == launch.block_tokens
            assert _common.next_pow2(launch.block_heads) == launch.block_heads
    x = jax.ShapeDtypeStruct((1, 6, 9, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(x, jax.ShapeDtypeStruct((1, 6), jnp.int32), block_heads=9)


def test_launch_fills_small_head_counts_with_tokens():
    full = kernel.launch_params(128, 32)
    one = kernel.launch_params(128, 1)
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
    x, pos = inputs((1, 2, 9, 64), jnp.bfloat16, 0)
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
