"""The Pallas TPU (Mosaic) kernels rms_norm, silu_mul and rope (pallas_kernels/tpu/).

For each op, ``Test<Op>PallasTpu`` runs the compiled kernel (``"pallas"``) and is skipped off
TPU; ``Test<Op>PallasTpuInterpret`` runs the same tests on the same kernel code in the TPU
interpreter (``"pallas_tpu_interpret"``: race detection, uninitialised memory read as NaN, so
an element a kernel fails to write fails the finiteness check). The behaviours come from
:mod:`cases.elementwise_base` (every case through the public op, against the float64
reference and the XLA implementation), with the cases Mosaic's layouts serve; the kernel
knobs (block sizes) are tested in each class. The lowering tests run the real Mosaic
lowering for TPU on this machine (``_compat.export_for_tpu``) for every accepted case, and
force the cases it refuses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasTpu, assert_registered_unverified
from cases.calls import by_id, case_id
from cases.checks import assert_close, assert_rms_norm_close, assert_rope_close
from cases.elementwise_base import RmsNormCases, RopeCases, SiluMulCases, unwritten_output
from cases.inputs import normal, rms_norm_inputs, rng, rope_inputs
from cases.references import f64, rope_ref, silu_mul_ref
from cases.shapes import (
    LINEAR_SCALING,
    LLAMA31_SCALING,
    LLAMA31_THETA,
    LLAMA32_1B_HIDDEN,
    SMOLLM_HIDDEN,
    SMOLLM_THETA,
)

import forge_jax as fj
from forge_jax import _compat, dispatch
from forge_jax.pallas_kernels.tpu import _common as tpu_common
from forge_jax.pallas_kernels.tpu import rms_norm as rms_norm_kernel
from forge_jax.pallas_kernels.tpu import rope as rope_kernel
from forge_jax.pallas_kernels.tpu import silu_mul as silu_mul_kernel

pl = _compat.pallas()
S = jax.ShapeDtypeStruct
LLAMA3 = LLAMA31_SCALING

# (x shape, x dtype, weight dtype, residual): SmolLM's 576 (not a multiple of 128 lanes) and
# Llama 3.2 1B's 2048; row counts below one sublane tile and between tiles.
NORM_CASES = [
    ((2, 3, SMOLLM_HIDDEN), jnp.bfloat16, jnp.float32, True),
    ((5, LLAMA32_1B_HIDDEN), jnp.float32, jnp.bfloat16, False),
]
# (shape, dtype): a lane-dense [rows, 1024] view, and a size no multiple of 128 divides.
SILU_CASES = [((3, 5, 1024), jnp.bfloat16), ((7, 11), jnp.float32)]
# (batch, seq, heads, head_dim), dtype, theta, scaling, interleaved, first position:
# head dims 64 and 128, both conventions, Llama 3.1's theta and scaling past 65536.
ROPE_CASES = [
    ((2, 5, 4, 64), jnp.bfloat16, SMOLLM_THETA, None, False, 3),
    ((1, 6, 2, 64), jnp.float32, 1e4, LINEAR_SCALING, True, 17),
    ((2, 3, 4, 128), jnp.float32, LLAMA31_THETA, LLAMA3, False, 70000),
    ((1, 4, 3, 128), jnp.bfloat16, LLAMA31_THETA, LLAMA3, True, 70000),
]


def _id(value):
    if isinstance(value, bool):
        return "interleaved" if value else "rotate_half"
    return case_id(value)


class TestRmsNormPallasTpu(PallasTpu, RmsNormCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(NORM_CASES)

    def test_partial_last_block(self):
        """37 rows in blocks of 16: three grid steps, the last one clipped."""
        x, w, r = rms_norm_inputs((37, 256), jnp.bfloat16, jnp.bfloat16, True)
        out = jax.jit(lambda x, w, r: rms_norm_kernel.rms_norm(
            x, w, eps=1e-6, residual=r, block_rows=16, interpret=self.INTERPRET))(x, w, r)
        xla = fj.rms_norm(x, w, eps=1e-6, residual=r, implementation="xla")
        assert_rms_norm_close(out, xla, x, w, r, eps=1e-6, implementation=self.IMPLEMENTATION)


class TestRmsNormPallasTpuInterpret(TestRmsNormPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


class TestSiluMulPallasTpu(PallasTpu, SiluMulCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(SILU_CASES)

    def test_partial_last_block(self):
        gen = rng(3)
        gate, up = normal(gen, (37, 128), scale=4.0), normal(gen, (37, 128))
        out = jax.jit(lambda g, u: silu_mul_kernel.silu_mul(
            g, u, block_rows=16, interpret=self.INTERPRET))(gate, up)
        assert_close(out, silu_mul_ref(gate, up), implementation=self.IMPLEMENTATION)


class TestSiluMulPallasTpuInterpret(TestSiluMulPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


class TestRopePallasTpu(PallasTpu, RopeCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(ROPE_CASES, _id)

    def test_partial_last_block_and_grad(self):
        """20 tokens in blocks of 8 (the last clipped); the gradient is the XLA VJP's, i.e.
        RoPE of the cotangent at ``-positions`` (see test_pallas_gpu_rope.py)."""
        x, pos = rope_inputs((2, 10, 2, 64), jnp.float32, 70000)
        ct = normal(rng(4), x.shape)
        kw = dict(theta=5e5, scaling=LLAMA3, interleaved=False)

        def loss(x):
            return jnp.sum(rope_kernel.rope(x, pos, block_tokens=8, interpret=self.INTERPRET,
                                            **kw) * ct)

        out, grad = jax.jit(jax.value_and_grad(loss))(x)
        assert_close(out, np.sum(rope_ref(x, pos, **kw) * f64(ct)), factor=10,
                     implementation=self.IMPLEMENTATION)
        assert_rope_close(grad, ct, -pos, implementation=self.IMPLEMENTATION, **kw)
        out = jax.jit(lambda x: rope_kernel.rope(x, pos, block_tokens=8,
                                                 interpret=self.INTERPRET, **kw))(x)
        assert_rope_close(out, x, pos, implementation=self.IMPLEMENTATION, **kw)


class TestRopePallasTpuInterpret(TestRopePallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def test_interpreter_poisons_outputs():
    """The premise of the finiteness checks: what a kernel leaves unwritten reads NaN."""
    assert np.isnan(unwritten_output((8, 128), _compat.tpu_interpret_params())).all()


def test_registered_for_tpu_by_name_until_verified():
    for op in ("rms_norm", "silu_mul", "rope"):
        assert_registered_unverified(op, "tpu")


# --- the contract with the Mosaic lowering -----------------------------------------------


def _lower_norm(x, w, r, **knobs):
    return _compat.export_for_tpu(
        lambda x, w, r: rms_norm_kernel.rms_norm(x, w, eps=1e-6, residual=r, **knobs), x, w, r)


def _lower_rope(x, pos, interleaved=False, **knobs):
    return _compat.export_for_tpu(
        lambda x, pos: rope_kernel.rope(x, pos, theta=5e5, scaling=LLAMA3,
                                        interleaved=interleaved, **knobs), x, pos)


@pytest.mark.parametrize("shape,dtype,w_dtype,with_residual", NORM_CASES + [
    ((300, 576), jnp.bfloat16, jnp.bfloat16, True),     # 2 blocks of 224 rows, last partial
    ((9, rms_norm_kernel.MAX_HIDDEN), jnp.float32, jnp.float32, True),
], ids=case_id)
def test_rms_norm_lowers_for_tpu(shape, dtype, w_dtype, with_residual):
    x, w = S(shape, dtype), S(shape[-1:], w_dtype)
    r = x if with_residual else None
    assert rms_norm_kernel.supports(dict(x=x, weight=w, eps=1e-6, residual=r)) is None
    assert "forge_jax_tpu_rms_norm" in _lower_norm(x, w, r).mlir_module()


def test_rms_norm_vmap_lowers_for_tpu():
    fn = jax.vmap(lambda x, r, w: rms_norm_kernel.rms_norm(x, w, eps=1e-6, residual=r),
                  in_axes=(0, 0, None))
    x = S((3, 2, 576), jnp.bfloat16)
    assert "forge_jax_tpu_rms_norm" in _compat.export_for_tpu(
        fn, x, x, S((576,), jnp.float32)).mlir_module()


@pytest.mark.parametrize("shape,dtype", SILU_CASES + [((2, 7, 8192), jnp.bfloat16),
                                                      ((3, 1000), jnp.float32), ((), jnp.float32)],
                         ids=case_id)
def test_silu_mul_lowers_for_tpu(shape, dtype):
    g = S(shape, dtype)
    assert silu_mul_kernel.supports(dict(gate=g, up=g)) is None
    text = _compat.export_for_tpu(silu_mul_kernel.silu_mul, g, g).mlir_module()
    assert "forge_jax_tpu_silu_mul" in text


@pytest.mark.parametrize("shape,dtype,interleaved", [
    *[(c[0], c[1], c[4]) for c in ROPE_CASES],
    ((2, 100, 32, 128), jnp.bfloat16, False),   # several 512-lane chunks and token blocks
    ((1, 3, 8, 80), jnp.bfloat16, True),       # Phi-2's head dim: 640-lane chunks
], ids=_id)
def test_rope_lowers_for_tpu(shape, dtype, interleaved):
    x, pos = S(shape, dtype), S(shape[:2], jnp.int32)
    args = dict(x=x, positions=pos, theta=5e5, scaling=LLAMA3, interleaved=interleaved)
    assert rope_kernel.supports(args) is None
    assert "forge_jax_tpu_rope" in _lower_rope(x, pos, interleaved).mlir_module()


def test_blocks_off_the_sublane_tile_fail_lowering():
    """Why every table entry is a multiple of the sublane tile (or the whole array): Mosaic
    refuses a block of 4 rows out of more."""
    match = "divisible by 8 and 128"
    with pytest.raises(ValueError, match=match):
        _lower_norm(S((20, 576), jnp.float32), S((576,), jnp.float32), None, block_rows=4)
    g = S((20, 128), jnp.float32)
    with pytest.raises(ValueError, match=match):
        _compat.export_for_tpu(functools.partial(silu_mul_kernel.silu_mul, block_rows=4), g, g)
    with pytest.raises(ValueError, match=match):
        _lower_rope(S((1, 20, 2, 64), jnp.float32), S((1, 20), jnp.int32), block_tokens=4)


def test_table_blocks_are_tile_aligned():
    for kind in (*tpu_common.GENERATIONS, "interpret", "default"):
        for dim, dtype in ((576, jnp.bfloat16), (2048, jnp.float32), (32768, jnp.bfloat16)):
            rows = rms_norm_kernel.block_rows_for(10**6, dim, dtype, kind)
            assert rows % tpu_common.sublane_tile(dtype) == 0, (kind, dim, dtype)
        assert silu_mul_kernel.block_rows_for(10**6, 1024, jnp.bfloat16, kind) % 16 == 0
        assert rope_kernel.block_tokens_for(5, 4096, jnp.bfloat16, kind) == 16
        assert rope_kernel.block_tokens_for(10**6, 4096, jnp.float32, kind) % 8 == 0


def test_rope_lane_table():
    """Each lane's frequency and rotation sign, for both conventions (head_dim 8)."""
    inv = np.array([1.0, 0.5, 0.25, 0.125], np.float32)
    half = rope_kernel.lane_table(inv, 16, interleaved=False)
    np.testing.assert_array_equal(half[0, :8], np.tile(inv, 2))
    np.testing.assert_array_equal(half[1, :8], [-1] * 4 + [1] * 4)
    np.testing.assert_array_equal(half[:, 8:], half[:, :8])
    pairs = rope_kernel.lane_table(inv, 8, interleaved=True)
    np.testing.assert_array_equal(pairs[0], np.repeat(inv, 2))
    np.testing.assert_array_equal(pairs[1], [-1, 1] * 4)
    assert rope_kernel.chunk_width(32, 128) == 512 and rope_kernel.chunk_width(8, 80) == 640
    assert rope_kernel.chunk_width(2, 64) == 128


@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 80), (1, 96)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_rows_off_the_lanes_are_written_to_the_end(heads, head_dim, interleaved):
    """Rows of heads * head_dim that are not a multiple of the kernel's chunk (9 heads of 64,
    SmolLM's 576 lanes) end in a narrower chunk. Once rejected, they hid a bug: lanes
    512-575 of a 9 x 64 row were never written (NaN in the interpreter). libtpu compiles
    them (tests/test_aot.py); here the interpreter's output, every lane, against float64."""
    x, pos = rope_inputs((2, 16, heads, head_dim), jnp.float32, 300)
    args = dict(x=x, positions=pos, theta=1e4, scaling=None, interleaved=interleaved)
    assert rope_kernel.supports(args) is None
    out = fj.rope(x, pos, theta=1e4, interleaved=interleaved,
                  implementation="pallas_tpu_interpret")
    assert np.isfinite(np.asarray(out)).all()
    assert_rope_close(out, x, pos, theta=1e4, interleaved=interleaved)


def test_policy_rejections():
    """float16 (lowers, but is not a TPU inference dtype and is not tested), float64, and
    rows too wide for a VMEM block: policies, checked by name."""
    x16 = jnp.ones((2, 128), jnp.float16)
    assert "float16" in rms_norm_kernel.supports(dict(x=x16, weight=jnp.ones(128),
                                                      eps=1e-6, residual=None))
    assert "float16" in silu_mul_kernel.supports(dict(gate=x16, up=x16))
    with pytest.raises(dispatch.ImplementationError, match="float16"):
        fj.silu_mul(x16, x16, implementation="pallas_tpu_interpret")
    with jax.enable_x64(True):
        x64 = jnp.ones((1, 2, 1, 128), jnp.float64)
        assert "float64" in rope_kernel.supports(dict(x=x64, positions=None))
    wide = S((2, rms_norm_kernel.MAX_HIDDEN + 128), jnp.bfloat16)
    assert "hidden size" in rms_norm_kernel.supports(
        dict(x=wide, weight=S(wide.shape[-1:], jnp.bfloat16), eps=1e-6, residual=None))
    odd = S((3, silu_mul_kernel.MAX_UNALIGNED_LANES + 1), jnp.float32)
    assert "no factor of 128" in silu_mul_kernel.supports(dict(gate=odd, up=odd))
