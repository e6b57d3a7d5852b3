"""MXFP4 (OCP Microscaling FP4: E2M1 values in blocks of 32 with an E8M0 exponent), the
format of gpt-oss's released experts: decoding against a float64 reading of the bits,
``fj.quantize(w, "mxfp4")`` against a float64 quantizer written from the specification,
the fused-dequantize XLA products against the dequantized weight, and the kernels'
refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import forge_jax as fj
from forge_jax.quant import QuantizedArray


def decode_fp4_f64(codes: np.ndarray) -> np.ndarray:
    """FP4 E2M1 codes -> float64 from the bits: sign, 2 exponent bits (bias 1), 1 mantissa
    bit; exponent 0 is subnormal (``m / 2``)."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 8, -1.0, 1.0)
    e, m = (codes >> 1) & 3, codes & 1
    magnitude = np.where(e == 0, m / 2.0, 2.0 ** (e - 1) * (1 + m / 2.0))
    return sign * magnitude


def decode_f64(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Packed bytes ``[..., K / 2]`` (element 2j in the low nibble) and E8M0 exponents
    ``[..., K / 32]`` -> float64 ``[..., K]``."""
    codes = np.stack([values & 0xF, values >> 4], axis=-1).reshape(*values.shape[:-1], -1)
    x = decode_fp4_f64(codes)
    scale = 2.0 ** (scales.astype(np.float64) - 127)
    return (x.reshape(*scales.shape, 32) * scale[..., None]).reshape(x.shape)


def quantize_f64(w: np.ndarray) -> np.ndarray:
    """The OCP MX quantization of ``w [..., K]`` in float64, dequantized: per block of 32,
    ``scale = 2**(floor(log2(absmax)) - 2)``, each value rounded to the nearest E2M1 value
    (ties to the even mantissa), clamped to +-6."""
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    scale = 2.0 ** np.clip(exponent, -127, 127)
    v = np.abs(blocks / scale)
    distance = np.abs(v[..., None] - grid)
    best = distance.min(-1, keepdims=True)
    ties = distance == best
    # among equally near values, the one with an even mantissa bit (even index)
    index = np.where(ties[..., ::2].any(-1), 2 * np.argmax(ties[..., ::2], -1),
                     np.argmax(ties, -1))
    return (np.sign(blocks) * grid[index] * scale).reshape(w.shape)


def _weights(shape, seed=0):
    """Random float32 ``shape`` whose blocks of 32 have very different magnitudes (so
    the exponents differ block by block)."""
    rng = np.random.default_rng(seed)
    magnitude = np.exp2(rng.integers(-6, 6, shape[:-1] + (shape[-1] // 32,)))
    return (rng.standard_normal(shape) * np.repeat(magnitude, 32, -1)).astype(np.float32)


def test_every_code_and_exponent_decodes_as_the_bits_say():
    values = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte: every code pair
    # Exponents whose products stay in float32's normal range (XLA on CPU flushes
    # subnormals, and 6 * 2**127 overflows float32).
    scales = np.array([2, 60, 100, 127, 128, 140, 200, 250] * 2, np.uint8).reshape(16, 1)
    q = fj.quant.from_parts(values, scales, format="mxfp4", block=(32,))
    assert q.shape == (16, 32) and q.nbytes == 16 * 16 + 16
    np.testing.assert_array_equal(np.asarray(fj.dequantize(q)), decode_f64(values, scales))
    nan = fj.quant.from_parts(values[:1], np.full((1, 1), 255, np.uint8), format="mxfp4",
                              block=(32,))
    assert np.isnan(np.asarray(fj.dequantize(nan))).all()  # E8M0's NaN exponent


def test_quantize_matches_the_float64_quantizer():
    w = _weights((48, 128))
    q = fj.quantize(jnp.asarray(w), "mxfp4")
    assert q.format == "mxfp4" and q.block == (32,)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (48, 64)
    assert q.scales.dtype == jnp.uint8 and q.scales.shape == (48, 4)
    assert len(np.unique(np.asarray(q.scales))) > 4  # the blocks' exponents differ
    got = np.asarray(fj.dequantize(q, jnp.float32)).astype(np.float64)
    np.testing.assert_array_equal(got, quantize_f64(w))
    np.testing.assert_array_equal(got, decode_f64(np.asarray(q.values), np.asarray(q.scales)))
    # Within half a step of the grid (a quarter of the block's scale below 2, ...), and
    # MXFP4 numbers quantize to themselves.
    assert np.abs(got - w).max() <= np.abs(w).max() / 4
    again = fj.quantize(jnp.asarray(got, jnp.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(again.values), np.asarray(q.values))
    np.testing.assert_array_equal(np.asarray(again.scales), np.asarray(q.scales))


def test_ties_round_to_the_even_mantissa_and_large_values_clamp():
    # One block whose largest value, 4, makes the scale 1; then each midpoint of the grid.
    row = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.1, -0.1]
    w = np.zeros((1, 32), np.float32)
    w[0, :len(row)] = row
    got = np.asarray(fj.dequantize(fj.quantize(jnp.asarray(w), "mxfp4")))[0, :len(row)]
    np.testing.assert_array_equal(got, [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0,
                                        0.0, -0.0])
    w[0, 0] = 7.9  # scale 1 still (floor(log2 7.9) - 2 = 0): 7.9 clamps to 6
    assert float(fj.dequantize(fj.quantize(jnp.asarray(w), "mxfp4"))[0, 0]) == 6.0


def test_bad_mxfp4_input_is_refused_by_name():
    with pytest.raises(ValueError, match=r"group_size=24 must be a positive int dividing"):
        fj.quantize(jnp.ones((4, 64)), "mxfp4", group_size=24)
    with pytest.raises(ValueError, match="symmetric=False is for int4"):
        fj.quantize(jnp.ones((4, 64)), "mxfp4", symmetric=False)
    with pytest.raises(TypeError, match=r"mxfp4 scales must be uint8 E8M0 exponents"):
        fj.quant.from_parts(np.zeros((4, 16), np.uint8), np.ones((4, 1), np.float32),
                            format="mxfp4", block=(32,))
    assert fj.quant.bits_per_value("mxfp4") == 4.25


@pytest.mark.parametrize("n,k,m", [(40, 96, 3), (512, 4096, 2)])
def test_matmul_matches_the_dequantized_weight(n, k, m):
    """``a @ W.T`` with the dequantizing done inside the product (in blocks of rows for
    the larger weight), against float64 on the float64-decoded weight; no float array of
    the weight's shape is made outside the product's loop body."""
    w = fj.quantize(jnp.asarray(_weights((n, k), seed=1)), "mxfp4")
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    bias = np.random.default_rng(3).standard_normal((n,)).astype(np.float32)
    want = a.astype(np.float64) @ decode_f64(np.asarray(w.values), np.asarray(w.scales)).T
    tol = fj.tolerances.tolerance(jnp.float32)
    got = jax.jit(lambda a, w: fj.matmul(a, w, trans_b=True))(jnp.asarray(a), w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol.rtol,
                               atol=tol.atol * math.sqrt(k) * np.abs(want).max())
    got = fj.matmul(jnp.asarray(a), w, trans_b=True, beta=1.0, c=jnp.asarray(bias))
    np.testing.assert_allclose(np.asarray(got), want + bias, rtol=tol.rtol,
                               atol=tol.atol * math.sqrt(k) * np.abs(want).max())
    jaxpr = jax.make_jaxpr(lambda a, w: fj.matmul(a, w, trans_b=True))(jnp.asarray(a), w)
    if n * k > 1 << 18:  # more than one block of rows: the dequantizing is inside a loop
        floats = [v.aval.shape for e in jaxpr.jaxpr.eqns for v in e.outvars
                  if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.size >= n * k // 2]
        assert floats == [], floats


def test_grouped_matmul_with_stacked_mxfp4_experts():
    """Stacked ``[experts, N, K]`` experts (gpt-oss's layout: ``*_blocks [E, N, K / 32,
    16]`` reshaped, ``*_scales [E, N, K / 32]``) in ``fj.grouped_matmul`` with
    ``trans_w=True``, against float64."""
    e, n, k = 3, 24, 64
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (e, n, k // 32), dtype=np.uint8)
    w = fj.quant.from_parts(blocks.reshape(e, n, k // 2), scales, format="mxfp4", block=(32,))
    x = rng.standard_normal((10, k)).astype(np.float32)
    sizes = np.array([4, 0, 6], np.int32)
    got = np.asarray(fj.grouped_matmul(jnp.asarray(x), w, jnp.asarray(sizes), trans_w=True))
    dense = decode_f64(blocks.reshape(e, n, k // 2), scales)  # [E, N, K]
    want = np.concatenate([x[:4].astype(np.float64) @ dense[0].T,
                           x[4:].astype(np.float64) @ dense[2].T])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_transformers_reads_the_same_numbers(hf):
    """transformers' own MXFP4 decoding (``convert_moe_packed_tensors``, which gpt-oss's
    loader uses) gives fj.dequantize's values."""
    torch, _ = hf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (2, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (2, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # [E, K, N]
    q = QuantizedArray(jnp.asarray(blocks.reshape(2, 8, 32)), jnp.asarray(scales), None,
                       "mxfp4", (32,))
    np.testing.assert_array_equal(np.swapaxes(np.asarray(fj.dequantize(q)), 1, 2), theirs)
