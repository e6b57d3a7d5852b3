"""The behaviours of every implementation of the elementwise ops ``fj.rms_norm``
(:class:`RmsNormCases`), ``fj.silu_mul`` (:class:`SiluMulCases`) and ``fj.rope``
(:class:`RopeCases`): each output against the float64 reference and the XLA
implementation, through the public op with ``implementation=IMPLEMENTATION``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from cases.base import ImplementationCases, parametrize_from
from cases.calls import jcall
from cases.checks import assert_close, assert_rms_norm_close, assert_rope_close
from cases.inputs import normal, rms_norm_inputs, rng, rope_inputs, silu_mul_inputs
from cases.references import f64, silu_mul_ref
from forge_jax import _compat


def unwritten_output(shape, interpret):
    """The output of a Pallas kernel that writes nothing of it, ``shape`` float32, run in
    the interpreter ``interpret`` (``True``, or its parameters): the premise of the
    finiteness checks is that it reads NaN."""
    pl = _compat.pallas()

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    return np.asarray(pl.pallas_call(writes_nothing,
                                     out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
                                     interpret=interpret)(jnp.ones(shape)))


class RmsNormCases(ImplementationCases):
    """Case table ``CASES``: ``{id: (x shape, x dtype, weight dtype, with residual)}``."""

    CASES: dict[str, tuple]

    @parametrize_from("CASES", "shape,dtype,w_dtype,with_residual")
    def test_matches_reference_and_xla(self, shape, dtype, w_dtype, with_residual):
        x, w, r = rms_norm_inputs(shape, dtype, w_dtype, with_residual)
        out = jcall(fj.rms_norm, x, w, eps=1e-5, residual=r, implementation=self.IMPLEMENTATION)
        xla = fj.rms_norm(x, w, eps=1e-5, residual=r, implementation="xla")
        assert_rms_norm_close(out, xla, x, w, r, eps=1e-5, implementation=self.IMPLEMENTATION)

    def test_grad_matches_xla_vjp_and_float64(self):
        """The VJP is the XLA implementation's (custom_vjp); also checked analytically."""
        x, w, r = rms_norm_inputs((2, 3, 576), jnp.float32, jnp.float32, True)
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


class SiluMulCases(ImplementationCases):
    """Case table ``CASES``: ``{id: (shape, dtype)}``."""

    CASES: dict[str, tuple]

    @parametrize_from("CASES", "shape,dtype")
    def test_matches_reference_and_xla(self, shape, dtype):
        gate, up = silu_mul_inputs(shape, dtype)
        out = jcall(fj.silu_mul, gate, up, implementation=self.IMPLEMENTATION)
        assert out.dtype == dtype and out.shape == shape
        assert_close(out, silu_mul_ref(gate, up), implementation=self.IMPLEMENTATION)
        want = fj.silu_mul(gate, up, implementation="xla")
        assert_close(out, f64(want), implementation=self.IMPLEMENTATION)


class RopeCases(ImplementationCases):
    """Case table ``CASES``: ``{id: ((batch, seq, heads, head_dim), dtype, theta, scaling,
    interleaved, first position)}``; positions increase from the first, with a different
    offset per sequence (:func:`cases.inputs.rope_inputs`)."""

    CASES: dict[str, tuple]

    @parametrize_from("CASES", "shape,dtype,theta,scaling,interleaved,start")
    def test_matches_reference_and_xla(self, shape, dtype, theta, scaling, interleaved, start):
        x, pos = rope_inputs(shape, dtype, start)
        kw = dict(theta=theta, scaling=scaling, interleaved=interleaved)
        out = jcall(fj.rope, x, pos, implementation=self.IMPLEMENTATION, **kw)
        assert out.dtype == dtype and out.shape == shape
        assert_rope_close(out, x, pos, implementation=self.IMPLEMENTATION, **kw)
        want = jcall(fj.rope, x, pos, implementation="xla", **kw)
        assert_close(out, f64(want), implementation=self.IMPLEMENTATION)
