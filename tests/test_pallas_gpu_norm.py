"""The Pallas GPU rms_norm kernel (pallas_kernels/gpu/rms_norm.py).

``TestRmsNormPallas`` runs the compiled kernel (``"pallas"``) and is skipped without a GPU
of compute capability >= 8.0; ``TestRmsNormInterpret`` runs the same tests on the same
kernel code in Pallas' interpreter (``"pallas_gpu_interpret"``), everywhere. Every case is
checked against the float64 reference and against the XLA implementation; Pallas'
interpreter starts outputs as NaN (``test_interpreter_poisons_outputs``), so an element the
kernel fails to write fails the finiteness check. The lowering tests lower every accepted
case exactly as for a CUDA GPU (``_compat.export_for_cuda``) on this machine.
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
from cases.references import f64, rms_norm_ref, round_to

import forge_jax as fj
from forge_jax import _compat, backends, dispatch
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import rms_norm as kernel

pl = _compat.pallas()

# (x shape, x dtype, weight dtype, residual): hidden sizes of SmolLM (576), Llama 3.2 1B
# (2048), gpt-oss (2880) and Llama 2 13B (5120); row counts that end inside a block.
CASES = [
    ((2, 3, 576), jnp.bfloat16, jnp.float32, True),   # 6 rows, 8 per program
    ((5, 2048), jnp.float16, jnp.float16, True),      # 5 rows, 4 per program
    ((3, 2880), jnp.float32, jnp.float32, False),
    ((1, 3, 5120), jnp.bfloat16, jnp.bfloat16, False),
]


def inputs(shape, dtype, w_dtype, residual, seed=0):
    gen = rng(seed, shape[-1])
    x = normal(gen, shape, dtype, scale=3.0)
    w = jnp.asarray((1.0 + 0.2 * gen.standard_normal(shape[-1])).astype(np.dtype(w_dtype)))
    r = normal(gen, shape, dtype) if residual else None
    return x, w, r


class TestRmsNormPallas:
    IMPLEMENTATION = "pallas"

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if self.IMPLEMENTATION == "pallas" and (reason := _common.gpu_reason("gpu")):
            pytest.skip(f"compiled Triton kernel: {reason} (the interpret subclass runs here)")

    def rms_norm(self, x, w, **kw):
        return jcall(fj.rms_norm, x, w, implementation=self.IMPLEMENTATION, **kw)

    @pytest.mark.parametrize("shape,dtype,w_dtype,with_residual", CASES, ids=case_id)
    def test_matches_reference_and_xla(self, shape, dtype, w_dtype, with_residual):
        x, w, r = inputs(shape, dtype, w_dtype, with_residual)
        out = self.rms_norm(x, w, eps=1e-5, residual=r)
        want = fj.rms_norm(x, w, eps=1e-5, residual=r, implementation="xla")
        ref = rms_norm_ref(x, w, eps=1e-5, residual=r, h_dtype=dtype)
        if with_residual:
            (y, h), (want_y, want_h), (ref_y, ref_h) = out, want, ref
            assert h.dtype == dtype
            # h is one float32 add rounded to x.dtype in both: bitwise equal.
            np.testing.assert_array_equal(f64(h), f64(want_h))
            np.testing.assert_array_equal(f64(h), round_to(ref_h, dtype))
        else:
            y, want_y, ref_y = out, want, ref
        assert y.dtype == dtype and y.shape == shape
        assert_close(y, ref_y, implementation=self.IMPLEMENTATION)
        assert_close(y, f64(want_y), implementation=self.IMPLEMENTATION)

    def test_largest_hidden(self):
        x, w, r = inputs((3, kernel.MAX_HIDDEN), jnp.float32, jnp.float32, True)
        y, h = self.rms_norm(x, w, residual=r)
        ref_y, _ = rms_norm_ref(x, w, residual=r, h_dtype=jnp.float32)
        assert_close(y, ref_y, implementation=self.IMPLEMENTATION)

    def test_vmap(self):
        x, w, r = inputs((3, 2, 576), jnp.bfloat16, jnp.bfloat16, True)
        fn = functools.partial(fj.rms_norm, implementation=self.IMPLEMENTATION)
        y, h = jax.jit(jax.vmap(lambda x, r: fn(x, w, residual=r)))(x, r)
        ref_y, ref_h = rms_norm_ref(x, w, residual=r, h_dtype=jnp.bfloat16)
        assert_close(y, ref_y, implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(h), round_to(ref_h, jnp.bfloat16))

    def test_grad_matches_xla_vjp_and_float64(self):
        """The VJP is the XLA implementation's (custom_vjp); also checked analytically."""
        x, w, r = inputs((2, 3, 576), jnp.float32, jnp.float32, True)
        gen = rng(1)
        gy, gh = normal(gen, x.shape), normal(gen, x.shape)

        def loss(implementation, x, w, r):
            y, h = fj.rms_norm(x, w, residual=r, implementation=implementation)
            return jnp.sum(y * gy) + jnp.sum(h * gh)

        grads = jax.jit(jax.grad(functools.partial(loss, self.IMPLEMENTATION),
                                 argnums=(0, 1, 2)))(x, w, r)
        want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(x, w, r)
        # float64: y = w h s, s = (mean(h^2) + eps)^-1/2, h = x + r.
        h, w64, gy64 = f64(x) + f64(r), f64(w), f64(gy)
        s = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        dh = w64 * gy64 * s - h * s**3 * np.mean(w64 * gy64 * h, axis=-1, keepdims=True)
        dh = dh + f64(gh)
        ref = (dh, np.sum(gy64 * h * s, axis=(0, 1)), dh)
        for name, g, g_xla, g_ref in zip("xwr", grads, want, ref, strict=True):
            assert_close(g, f64(g_xla), implementation=self.IMPLEMENTATION, err_msg=name)
            # Sums over 576 terms (dh) and 6 rows (dw): a wider float32 budget.
            assert_close(g, g_ref, implementation=self.IMPLEMENTATION, factor=20, err_msg=name)

    def test_no_rows(self):
        x, w, r = inputs((2, 3, 64), jnp.float32, jnp.float32, True)
        y, h = self.rms_norm(x[:0], w, residual=r[:0])
        assert y.shape == h.shape == (0, 3, 64) and y.dtype == h.dtype == jnp.float32


class TestRmsNormInterpret(TestRmsNormPallas):
    IMPLEMENTATION = "pallas_gpu_interpret"


def test_interpreter_poisons_outputs():
    """The premise of the finiteness checks: what a kernel leaves unwritten reads NaN."""

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                         interpret=True)(jnp.ones(8))
    assert np.isnan(np.asarray(out)).all()


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
    for kind in _common.TUNING:
        for bucket, knobs in _common.TUNING[kind].get("rms_norm", {}).items():
            launch = kernel.Launch(**knobs)
            assert _common.next_pow2(launch.block_rows) == launch.block_rows, (bucket, launch)
            assert launch.block_rows * bucket <= 2**20, (bucket, launch)
    assert kernel.launch_params(576).block_rows * 1024 <= 8192
    assert kernel.launch_params(kernel.MAX_HIDDEN).block_rows == 1


def test_pallas_rejects_compute_capability_below_8(monkeypatch):
    x, w, r = inputs((2, 64), jnp.bfloat16, jnp.bfloat16, True)
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
