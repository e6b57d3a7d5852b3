"""The chunked gated delta-rule kernels against the float64 recurrence, in the interpreters
on Qwen3-Next's head shapes (16 key and 32 value heads of 128, scaled down in tokens, not in
width), and their ``supports()`` rules; the deviceless compiles are the ``target`` tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import ImplementationCases, PallasGpu, PallasTpu, assert_registered_unverified
from cases.checks import assert_close
from cases.gated_delta_references import gated_delta_ref

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import gated_delta as gpu_kernel
from forge_jax.pallas_kernels.tpu import gated_delta as tpu_kernel

QWEN3_NEXT = dict(k_heads=16, v_heads=32, dk=128, dv=128)


def inputs(seed, *, batch=1, seq=80, k_heads=16, v_heads=32, dk=128, dv=128,
           dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((batch, seq, k_heads, dk)), dtype)
    k = jnp.asarray(r.standard_normal((batch, seq, k_heads, dk)), dtype)
    v = jnp.asarray(r.standard_normal((batch, seq, v_heads, dv)), dtype)
    a = jnp.asarray(r.standard_normal((batch, seq, v_heads)) - 2.0, jnp.float32)
    b = jnp.asarray(r.standard_normal((batch, seq, v_heads)), jnp.float32)
    g, beta = fj.gated_delta_gates(a, b, jnp.asarray(np.log(r.uniform(0.1, 1.0, v_heads)),
                                                     jnp.float32),
                                   jnp.zeros(v_heads, jnp.float32))
    s0 = jnp.asarray(r.standard_normal((batch, v_heads, dk, dv)) * 0.3, jnp.float32)
    return q, k, v, g, beta, s0


class GatedDeltaKernelCases(ImplementationCases):
    """What every chunked gated delta-rule kernel must show, through the public op."""

    CHUNK = 64

    def test_qwen3_next_heads_from_a_state(self):
        q, k, v, g, beta, s0 = inputs(0, seq=2 * self.CHUNK + 9)
        out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0, chunk_size=self.CHUNK,
                                     implementation=self.IMPLEMENTATION)
        ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0)
        assert_close(out, ref_out, implementation="kernel", factor=5)
        assert_close(s, ref_s, implementation="kernel", factor=5)

    def test_variable_lengths_and_nan_padding(self):
        q, k, v, g, beta, s0 = inputs(1, batch=2, seq=self.CHUNK + 5, k_heads=2, v_heads=4)
        lengths = np.array([self.CHUNK + 5, 7], np.int32)
        pad = np.arange(q.shape[1])[None, :] >= lengths[:, None]
        poisoned = [jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
                    for x in (q, k, v, g, beta)]
        out, s = fj.gated_delta_rule(*poisoned, state=s0, lengths=jnp.asarray(lengths),
                                     chunk_size=self.CHUNK, implementation=self.IMPLEMENTATION)
        ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0, lengths=lengths)
        assert_close(out, ref_out, implementation="kernel", factor=5)
        assert_close(s, ref_s, implementation="kernel", factor=5)

    def test_bfloat16_and_grad(self):
        q, k, v, g, beta, s0 = inputs(2, seq=self.CHUNK + 3, k_heads=1, v_heads=2,
                                      dtype=jnp.bfloat16)
        out, _ = fj.gated_delta_rule(q, k, v, g, beta, state=s0, chunk_size=self.CHUNK,
                                     implementation=self.IMPLEMENTATION)
        assert out.dtype == jnp.bfloat16
        assert_close(out, gated_delta_ref(q, k, v, g, beta, state=s0)[0],
                     implementation="kernel")
        grad = jax.grad(lambda v_: jnp.sum(fj.gated_delta_rule(
            q, k, v_, g, beta, state=s0, chunk_size=self.CHUNK,
            implementation=self.IMPLEMENTATION)[0].astype(jnp.float32)))(v)
        ref = jax.grad(lambda v_: jnp.sum(fj.gated_delta_rule(
            q, k, v_, g, beta, state=s0, implementation="xla_recurrent")[0].astype(
                jnp.float32)))(v)
        assert_close(grad, np.asarray(ref.astype(jnp.float32), np.float64), factor=2)


class TestGatedDeltaPallasTpuInterpret(PallasTpu, GatedDeltaKernelCases):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


class TestGatedDeltaPallasGpuInterpret(PallasGpu, GatedDeltaKernelCases):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True
    CHUNK = 32


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernels_registered_unverified(platform):
    assert_registered_unverified("gated_delta_rule", platform)


@pytest.mark.parametrize("change,reason", [
    (dict(chunk_size=64), "chunk_size=64; the kernel is built for (16, 32)"),
    (dict(dk=96), "dk=96: the kernel is built for power-of-two head dims"),
    (dict(seq=1), "one token is a decode step"),
])
def test_gpu_supports_rejections(change, reason):
    chunk = change.pop("chunk_size", 32)
    S = jax.ShapeDtypeStruct
    shape = dict(batch=1, seq=64, **QWEN3_NEXT)
    shape.update(change)
    args = dict(q=S((shape["batch"], shape["seq"], 16, shape["dk"]), jnp.bfloat16),
                v=S((shape["batch"], shape["seq"], 32, shape["dv"]), jnp.bfloat16),
                chunk_size=chunk)
    assert reason in gpu_kernel.supports(args)


@pytest.mark.target("h100")
def test_gpu_compile_on_qwen3_next_heads():
    """The H100 compile (deviceless) of every chunk size ``supports()`` accepts, Qwen3-Next's
    heads: no copies outside the kernel, the spills ptxas reports bounded."""
    S = jax.ShapeDtypeStruct
    for dtype, chunk in ((jnp.bfloat16, 16), (jnp.float32, 32)):
        b, t = 2, 1000
        qk = S((b, t, 16, 128), dtype)
        args = (qk, qk, S((b, t, 32, 128), dtype), S((b, t, 32), jnp.float32),
                S((b, t, 32), jnp.float32), S((b, 32, 128, 128), jnp.float32))
        report = fj.aot.compile(
            lambda q, k, v, g, beta, s, c=chunk: fj.gated_delta_rule(
                q, k, v, g, beta, state=s, chunk_size=c),
            *args, target="h100", implementation="pallas")
        assert report.compiled, (dtype, chunk, report.error)
        assert [k.name for k in report.kernels] == ["forge_jax_gpu_gated_delta_rule"]


@pytest.mark.parametrize("change,reason", [
    (dict(chunk_size=48), "chunk_size=48; the kernel is built for (16, 32, 64, 128)"),
    (dict(dk=64), "head dims dk=64, dv=128"),
    (dict(seq=1), "one token is a decode step"),
])
def test_tpu_supports_rejections(change, reason):
    chunk = change.pop("chunk_size", 64)
    S = jax.ShapeDtypeStruct
    shape = dict(batch=1, seq=64, **QWEN3_NEXT)
    shape.update(change)
    args = dict(q=S((shape["batch"], shape["seq"], 16, shape["dk"]), jnp.bfloat16),
                v=S((shape["batch"], shape["seq"], 32, shape["dv"]), jnp.bfloat16),
                chunk_size=chunk)
    assert reason in tpu_kernel.supports(args)


@pytest.mark.target("tpu-v5e")
def test_tpu_compile_on_qwen3_next_heads():
    """libtpu's compile for TPU v5e (deviceless) of every chunk size ``supports()`` accepts,
    bfloat16 and float32, Qwen3-Next's heads."""
    S = jax.ShapeDtypeStruct
    for dtype, chunk in ((jnp.bfloat16, 16), (jnp.bfloat16, 32), (jnp.bfloat16, 64),
                         (jnp.float32, 64), (jnp.bfloat16, 128)):
        b, t = 2, 1000
        qk = S((b, t, 16, 128), dtype)
        args = (qk, qk, S((b, t, 32, 128), dtype), S((b, t, 32), jnp.float32),
                S((b, t, 32), jnp.float32), S((b, 32, 128, 128), jnp.float32))
        report = fj.aot.compile(
            lambda q, k, v, g, beta, s, c=chunk: fj.gated_delta_rule(
                q, k, v, g, beta, state=s, chunk_size=c),
            *args, target="tpu-v5e", implementation="pallas")
        assert report.compiled, (dtype, chunk, report.error)
        assert [k.name for k in report.kernels] == ["forge_jax_tpu_gated_delta_rule"]
