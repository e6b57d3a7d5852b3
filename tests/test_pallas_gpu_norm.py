"""The Pallas GPU rms_norm kernel (pallas_kernels/gpu/rms_norm.py).

:class:`TestRmsNormPallasGpu` runs the compiled kernel (``"pallas"``) and is skipped without
a GPU of compute capability >= 8.0; :class:`TestRmsNormPallasGpuInterpret` runs the same
tests on the same kernel code in Pallas' interpreter (``"pallas_gpu_interpret"``),
everywhere. The behaviours every rms_norm implementation shows (float64 reference and XLA,
the VJP) come from :class:`cases.elementwise_base.RmsNormCases`; Pallas' interpreter starts
outputs as NaN (``test_interpreter_poisons_outputs``), so an element the kernel fails to
write fails the finiteness check. The lowering tests lower every accepted case exactly as
for a CUDA GPU (``_compat.export_for_cuda``) on this machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasGpu
from cases.calls import by_id, case_id, jcall
from cases.checks import assert_close
from cases.elementwise_base import RmsNormCases, unwritten_output
from cases.inputs import rms_norm_inputs, rng
from cases.references import f64, rms_norm_ref, round_to
from cases.shapes import GPT_OSS_HIDDEN, LLAMA2_13B_HIDDEN, LLAMA32_1B_HIDDEN, SMOLLM_HIDDEN

import forge_jax as fj
from forge_jax import _compat, backends, dispatch
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import rms_norm as kernel

pl = _compat.pallas()

# (x shape, x dtype, weight dtype, residual): hidden sizes of released models; row counts
# that end inside a block.
CASES = [
    ((2, 3, SMOLLM_HIDDEN), jnp.bfloat16, jnp.float32, True),   # 6 rows, 8 per program
    ((5, LLAMA32_1B_HIDDEN), jnp.float16, jnp.float16, True),   # 5 rows, 4 per program
    ((3, GPT_OSS_HIDDEN), jnp.float32, jnp.float32, False),
    ((1, 3, LLAMA2_13B_HIDDEN), jnp.bfloat16, jnp.bfloat16, False),
]


class TestRmsNormPallasGpu(PallasGpu, RmsNormCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = by_id(CASES)

    def rms_norm(self, x, w, **kw):
        return jcall(fj.rms_norm, x, w, implementation=self.IMPLEMENTATION, **kw)

    def test_largest_hidden(self):
        x, w, r = rms_norm_inputs((3, kernel.MAX_HIDDEN), jnp.float32, jnp.float32, True)
        y, h = self.rms_norm(x, w, residual=r)
        ref_y, _ = rms_norm_ref(x, w, residual=r, h_dtype=jnp.float32)
        assert_close(y, ref_y, implementation=self.IMPLEMENTATION)

    def test_vmap(self):
        x, w, r = rms_norm_inputs((3, 2, 576), jnp.bfloat16, jnp.bfloat16, True)
        fn = functools.partial(fj.rms_norm, implementation=self.IMPLEMENTATION)
        y, h = jax.jit(jax.vmap(lambda x, r: fn(x, w, residual=r)))(x, r)
        ref_y, ref_h = rms_norm_ref(x, w, residual=r, h_dtype=jnp.bfloat16)
        assert_close(y, ref_y, implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(h), round_to(ref_h, jnp.bfloat16))

    def test_no_rows(self):
        x, w, r = rms_norm_inputs((2, 3, 64), jnp.float32, jnp.float32, True)
        y, h = self.rms_norm(x[:0], w, residual=r[:0])
        assert y.shape == h.shape == (0, 3, 64) and y.dtype == h.dtype == jnp.float32


class TestRmsNormPallasGpuInterpret(TestRmsNormPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


def test_interpreter_poisons_outputs():
    """The premise of the finiteness checks: what a kernel leaves unwritten reads NaN."""
    assert np.isnan(unwritten_output((8,), True)).all()


# --- the contract with the CUDA lowering -------------------------------------------------


def _args(x, w, r, eps=1e-6):
    return dict(x=x, weight=w, eps=eps, residual=r)


def _lower(x, w, r, **knobs):
    return _compat.export_for_cuda(
        lambda x, w, r: kernel.rms_norm(x, w, eps=1e-6, residual=r, **knobs), x, w, r)


@pytest.mark.parametrize("shape,dtype,w_dtype,with_residual",
                         CASES + [((7, kernel.MAX_HIDDEN), jnp.bfloat16, jnp.float32, True),
                                  ((4, 16384), jnp.float32, jnp.float32, False),
                                  ((2, 9), jnp.float16, jnp.float32, True)], ids=case_id)
def test_accepted_cases_lower_for_cuda(shape, dtype, w_dtype, with_residual):
    x = jax.ShapeDtypeStruct(shape, dtype)
    w = jax.ShapeDtypeStruct(shape[-1:], w_dtype)
    r = x if with_residual else None
    assert kernel.supports(_args(x, w, r)) is None
    text = _lower(x, w, r).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "forge_jax_rms_norm" in text


def test_rejects_hidden_beyond_one_block():
    """Above MAX_HIDDEN a row would no longer fit one program's registers (a choice: it
    still lowers up to Triton's 2**20-element tensor limit, which fails the lowering)."""
    wide = jax.ShapeDtypeStruct((2, kernel.MAX_HIDDEN + 1), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((kernel.MAX_HIDDEN + 1,), jnp.bfloat16)
    assert "hidden size" in kernel.supports(_args(wide, w, None))
    too_wide = jax.ShapeDtypeStruct((1, 2**20 + 1), jnp.bfloat16)
    with pytest.raises(Exception, match="Maximum allowed number of elements is 1048576"):
        _lower(too_wide, jax.ShapeDtypeStruct((2**20 + 1,), jnp.bfloat16), None, block_rows=1)


def test_rejects_float64_by_name():
    """float64 is not an inference dtype: the kernel is built and tested for f32/bf16/f16
    (a policy, not a lowering limit), and asking for it by name says so."""
    with jax.enable_x64(True):
        x = jnp.asarray(rng(0).standard_normal((2, 64)))
        w = jnp.ones(64, jnp.float32)
        assert "float64" in kernel.supports(_args(x, w, None))
        assert "float64" in kernel.supports(_args(x.astype(jnp.float32), w.astype(x.dtype), None))
        with pytest.raises(dispatch.ImplementationError, match="float64"):
            fj.rms_norm(x, w, implementation="pallas_gpu_interpret")


def test_non_power_of_two_block_rows_fail_lowering():
    """Why the launch table holds powers of two: Triton refuses any other block."""
    x = jax.ShapeDtypeStruct((6, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match="power of 2"):
        _lower(x, jax.ShapeDtypeStruct((576,), jnp.bfloat16), None, block_rows=3)


def test_launch_table_blocks_are_powers_of_two():
    for kind in kernel.TUNED:
        for bucket, knobs in kernel.TUNED[kind].items():
            launch = kernel.Config(**knobs)
            assert _common.next_pow2(launch.block_rows) == launch.block_rows, (bucket, launch)
            assert launch.block_rows * bucket <= 2**20, (bucket, launch)
    assert kernel.default_config({"x": np.empty((1, 576))}).block_rows * 1024 <= 8192
    assert kernel.default_config({"x": np.empty((1, kernel.MAX_HIDDEN))}).block_rows == 1


def test_pallas_rejects_compute_capability_below_8(monkeypatch):
    x, w, r = rms_norm_inputs((2, 64), jnp.bfloat16, jnp.bfloat16, True)
    pallas = dispatch.implementations("rms_norm", "gpu")["pallas"]
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "7.5")
    assert "compute capability >= 8.0; this GPU has 7.5" in pallas.supports(_args(x, w, r), "gpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "8.0")
    assert pallas.supports(_args(x, w, r), "gpu") is None


def test_vmap_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((3, 2, 576), jnp.bfloat16)
    fn = jax.vmap(lambda x, r, w: kernel.rms_norm(x, w, eps=1e-6, residual=r),
                  in_axes=(0, 0, None))
    text = _compat.export_for_cuda(fn, x, x, jax.ShapeDtypeStruct((576,), jnp.float32))
    assert "__gpu$xla.gpu.triton" in text.mlir_module()
