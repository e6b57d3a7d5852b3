"""The Pallas TPU (Mosaic) quantized_matmul kernel (pallas_kernels/tpu/quantized_matmul.py).

:class:`TestQuantizedMatmulPallasTpu` runs the compiled kernel (``"pallas"``, skipped off
TPU); :class:`TestQuantizedMatmulPallasTpuInterpret` the same tests in the TPU interpreter.
Each case is SmolLM2-135M's shape of a projection (in 576, out 960 fused q/k/v rows, 3072
fused gate/up rows, down 1536 -> 576) with a decode-sized or prefill-sized ``a``, against a
float64 product with the weight dequantized from its stored parts (``cases.quant``). With
libtpu (the ``aot`` extra), the real compile for TPU v5e settles ``supports()``: accepted
cases compile, the small groups it refuses run out of VMEM there.

W8A8 (``activations="int8"``): SmolLM2's 576 -> 1536 and 1536 -> 576 products at 1, 16 and
128 rows against a float64 product with the same numerics (activations quantized per row in
NumPy, integer dots exact) and within the quantization's error bound of the float product;
the Mosaic module handed to libtpu multiplies int8 x int8 into int32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import ImplementationCases, PallasTpu
from cases.checks import assert_close
from cases.quant import dequantize as dequantize_ref
from cases.quant import w8a8_error_bound, w8a8_product

import forge_jax as fj
from forge_jax.pallas_kernels.tpu import quantized_matmul as kernel

# (format, group, symmetric, M, N, K, dtype): groups of whole vregs (per channel, or 256
# int4 values), the ones libtpu compiles (test_tpu_compile_settles_supports).
CASES = {
    "int8-channel-decode-down": ("int8", None, True, 1, 576, 1536, jnp.float32),
    "int8-channel-qkv": ("int8", None, True, 5, 960, 576, jnp.float32),
    "int4-channel-gate-up-bf16": ("int4", 576, True, 16, 3072, 576, jnp.bfloat16),
    "int4-g256-asym": ("int4", 256, False, 3, 256, 512, jnp.float32),
}


def _inputs(fmt, group, symmetric, m, n, k, dtype, seed=0):
    gen = np.random.default_rng(seed)
    w = jnp.asarray(gen.normal(0, 0.05, (n, k)), jnp.float32)
    q = fj.quantize(w, fmt, group_size=group, symmetric=symmetric)
    a = jnp.asarray(gen.normal(0, 1, (m, k)), dtype)
    return a, q


class TestQuantizedMatmulPallasTpu(PallasTpu, ImplementationCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False

    @pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
    def test_matches_float64(self, case):
        fmt, group, symmetric, m, n, k, dtype = case
        a, q = _inputs(*case)
        assert kernel.supports(dict(a=a, b=q, trans_b=True)) is None
        out = jax.jit(lambda a, q: fj.matmul(a, q, trans_b=True,
                                             implementation=self.IMPLEMENTATION))(a, q)
        ref = np.asarray(a, np.float64) @ dequantize_ref(q).T
        assert out.dtype == dtype
        assert_close(out, ref, implementation=self.IMPLEMENTATION)

    @pytest.mark.parametrize("m", [1, 16, 128])
    @pytest.mark.parametrize("n, k, dtype", [(1536, 576, jnp.bfloat16), (576, 1536, jnp.float32)],
                             ids=["up-bf16", "down-f32"])
    def test_w8a8_matches_float64(self, n, k, dtype, m):
        a, q = _inputs("int8", None, True, m, n, k, dtype, seed=m)
        q = fj.quant.from_parts(q.values, q.scales, format="int8", block=q.block,
                                activations="int8")
        assert kernel.supports(dict(a=a, b=q, trans_b=True)) is None
        out = fj.matmul(a, q, trans_b=True, implementation=self.IMPLEMENTATION)
        assert fj.dispatch.last_selection("quantized_matmul").implementation == \
            self.IMPLEMENTATION
        assert out.dtype == dtype
        assert_close(out, w8a8_product(a, q), implementation=self.IMPLEMENTATION)
        # The float product with the dequantized weight, within the activations' rounding.
        float_product = np.asarray(a, np.float64) @ dequantize_ref(q).T
        slack = 1e-2 if dtype == jnp.bfloat16 else 1e-5  # the output's own rounding
        assert (np.abs(np.asarray(out, np.float64) - float_product)
                <= w8a8_error_bound(a, q) + slack * np.abs(float_product) + 1e-6).all()

    def test_alpha_beta_c_and_leading_axes(self):
        a, q = _inputs("int4", 256, True, 6, 256, 256, jnp.float32, seed=1)
        c = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 256)), jnp.float32)
        out = fj.matmul(a.reshape(2, 3, 256), q, trans_b=True, alpha=0.5, beta=2.0, c=c,
                        implementation=self.IMPLEMENTATION)
        ref = 0.5 * (np.asarray(a, np.float64) @ dequantize_ref(q).T).reshape(2, 3, 256) + 2.0 * \
            np.asarray(c, np.float64)
        assert_close(out, ref, implementation=self.IMPLEMENTATION)


class TestQuantizedMatmulPallasTpuInterpret(TestQuantizedMatmulPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def _stored(fmt, n, k, block):
    """A QuantizedArray of shape [n, k] from stored parts (nothing computed)."""
    dtype = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}[fmt]
    values = np.zeros((n, k // 2 if fmt == "int4" else k), dtype)
    rows = block[0] if len(block) == 2 else 1
    return fj.quant.from_parts(values, np.ones((n // rows, k // block[-1]), np.float32),
                               format=fmt, block=block)


def test_supports_names_what_it_refuses():
    a = jax.ShapeDtypeStruct((2, 256), jnp.float32)
    refuse = lambda b, trans_b=True, a=a: kernel.supports(dict(a=a, b=b, trans_b=trans_b))
    assert refuse(_stored("int8", 256, 256, (256,))) is None
    assert "trans_b=False" in refuse(_stored("int8", 256, 256, (256,)), trans_b=False)
    assert "'fp8'" in refuse(_stored("fp8", 256, 256, (256,)))
    assert "scales per group along K only" in refuse(_stored("int8", 256, 256, (128, 256)))
    assert "float16" in refuse(_stored("int8", 256, 256, (256,)),
                               a=jax.ShapeDtypeStruct((2, 256), jnp.float16))
    assert "not a multiple of 128 lanes" in refuse(_stored("int4", 256, 256, (32,)))
    assert "K=16384" in refuse(_stored("int8", 128, 16384, (16384,)),
                               a=jax.ShapeDtypeStruct((1, 16384), jnp.float32))
    # 1000 rows: no 128-row blocks, and too many weights for one block of all of them.
    assert "N=1000" in refuse(_stored("int8", 1000, 2048, (2048,)),
                              a=jax.ShapeDtypeStruct((1, 2048), jnp.float32))
    w8a8 = lambda block: dataclasses.replace(_stored("int8", 256, 256, block),
                                             activations="int8")
    assert refuse(w8a8((256,))) is None
    assert "one scale per output channel" in refuse(w8a8((128,)))
    with fj.targets.use("tpu-v5e"):
        assert refuse(w8a8((256,))) is None
    # TPU7x (Ironwood) multiplies fp8, not int8: no W8A8 kernel there (XLA serves it).
    v7x = dataclasses.replace(fj.targets.get("tpu-v6e"), name="tpu7x", device_kind="TPU7x")
    with fj.targets.use(v7x):
        assert "TPU7x has no int8 MXU product in Mosaic" in refuse(w8a8((256,)))
        assert refuse(_stored("int8", 256, 256, (256,))) is None  # W8A16 still served
        args = fj.dispatch.bind("quantized_matmul", a, w8a8((256,)), trans_b=True)
        assert fj.dispatch.select("quantized_matmul", args).implementation == "xla"


def _mosaic_matmuls(exported) -> list[str]:
    """The ``tpu.matmul`` lines of the Mosaic modules in ``exported`` (what libtpu compiles)."""
    import base64
    import re

    from jax._src.lib.mlir import ir
    from jaxlib.mosaic.python import tpu

    lines = []
    for body in re.findall(r"\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22", exported.mlir_module()):
        with ir.Context() as ctx:
            tpu.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            text = str(ir.Module.parse(base64.b64decode(body)))
        lines += [line.strip() for line in text.splitlines() if "tpu.matmul" in line]
    return lines


def test_w8a8_is_an_int8_mxu_product():
    """The Mosaic module of the W8A8 kernel (lowered here as for a TPU) multiplies int8 x int8
    with an int32 accumulator: the MXU's int8 path, no float conversion before it."""
    from forge_jax import _compat

    S = jax.ShapeDtypeStruct
    exported = _compat.export_for_tpu(
        lambda qa, sa, v, s: kernel.quantized_matmul_w8a8_forward(qa, sa, v, s, block_m=128,
                                                                  block_n=128),
        S((16, 576), jnp.int8), S((16, 1), jnp.float32), S((1536, 576), jnp.int8),
        S((1536, 1), jnp.float32))
    (matmul,) = _mosaic_matmuls(exported)
    assert "(vector<16x576xi8>, vector<128x576xi8>, vector<16x128xi32>) -> vector<16x128xi32>" \
        in matmul, matmul


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_accepted_cases_lower_for_tpu(case):
    """The Mosaic lowering (run here, as for a TPU) of each case the tests check."""
    from forge_jax import _compat

    a, q = _inputs(*case)
    S = jax.ShapeDtypeStruct
    exported = _compat.export_for_tpu(
        lambda a, v, s, m: kernel.quantized_matmul_forward(
            a, v, s, m, fmt=q.format, group=q.full_block()[1], block_m=128, block_n=128),
        S(a.shape, a.dtype), S(q.values.shape, q.values.dtype), S(q.scales.shape, q.scales.dtype),
        None if q.minimums is None else S(q.minimums.shape, q.minimums.dtype))
    assert "forge_jax_tpu_quantized_matmul" in exported.mlir_module()


@pytest.mark.target("tpu-v5e")
def test_tpu_compile_settles_supports():
    """libtpu's compile for TPU v5e (deviceless): accepted cases compile (W8A8 among them);
    int4 in groups of 32 (16 bytes, an eighth of a vreg's lanes) is refused, and fails that
    compile."""
    S = jax.ShapeDtypeStruct

    def stored(fmt, n, k, group, scale_dtype=jnp.float32, asymmetric=False, activations=None):
        v = S((n, k // 2), jnp.uint8) if fmt == "int4" else S((n, k), jnp.int8)
        s = S((n, k // group), scale_dtype)
        return fj.QuantizedArray(v, s, s if asymmetric else None, fmt, (group,),
                                 activations=activations)

    def compile_(a, q):
        return fj.aot.compile(
            lambda a, q: kernel.quantized_matmul(a, q, trans_b=True, alpha=1.0, beta=0.0,
                                                 c=None, out_dtype=a.dtype), a, q,
            target="tpu-v5e")

    accepted = [
        (S((5, 576), jnp.float32), stored("int8", 960, 576, 576)),
        (S((1, 8192), jnp.bfloat16), stored("int4", 2048, 8192, 256, asymmetric=True)),
        (S((64, 2048), jnp.bfloat16), stored("int8", 2048, 2048, 128, jnp.float16)),
    ]
    w8a8 = [(S((m, k), jnp.bfloat16), stored("int8", n, k, k, activations="int8"))
            for m, n, k in ((1, 576, 1536), (128, 1536, 576), (2048, 4096, 8192))]
    for a, q in accepted + w8a8:
        with fj.targets.use("tpu-v5e"):
            assert kernel.supports(dict(a=a, b=q, trans_b=True)) is None, q
        report = compile_(a, q)
        assert report.compiled, report.error
        name = "forge_jax_tpu_quantized_matmul" + ("_w8a8" if q.activations else "")
        assert [k.name for k in report.kernels] == [name]
    a, q = S((5, 576), jnp.float32), stored("int4", 960, 576, 32)
    assert "not a multiple of 128 lanes" in kernel.supports(dict(a=a, b=q, trans_b=True))
    report = compile_(a, q)
    assert not report.compiled and "Ran out of memory in memory space vmem" in report.error
