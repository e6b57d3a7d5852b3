"""Quantized KV pools (forge_jax/ops/kv_quant.py): int8 and fp8 pages with a scale per token
and KV head, through the paged ops' XLA implementations, against NumPy quantization and
float64 references of what the stored parts stand for; bad pools get one clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import jit_paged_gather
from cases.inputs import rng
from cases.kv_quant import FORMATS, QMAX, quantize_cache, quantize_vectors, quantized_pool
from cases.kv_quant_base import QuantizedPagedCases, QuantizedRaggedCases
from cases.paged import paged_cache
from cases.paged_base import PagedCase
from cases.quant import dequantize
from cases.references import f64

import forge_jax as fj
from forge_jax.ops import kv_quant
from forge_jax.quant import QuantizedArray

F32, BF16 = jnp.float32, jnp.bfloat16


class TestQuantizedPagedAttentionXla(QuantizedPagedCases):
    IMPLEMENTATION = "xla"
    QUANT_CASES = {
        # Decode, GQA 4/2, int8 and fp8 pools, float32 queries.
        "decode-gqa-int8": (PagedCase(4, 2, 16, 4, None, F32, (0, 5, 13)), "int8"),
        "decode-gqa-fp8": (PagedCase(4, 2, 16, 4, None, F32, (9, 1, 16)), "fp8"),
        # Chunked prefill (3 new tokens), MQA, a window and a cap; bfloat16 queries.
        "prefill-mqa-window-cap-int8": (PagedCase(4, 1, 16, 4, 3, BF16, (11, 3), window=5,
                                                  cap=10.0), "int8"),
        "prefill-mha-fp8": (PagedCase(2, 2, 8, 8, 2, F32, (17, 2)), "fp8"),
    }


class TestQuantizedRaggedXla(QuantizedRaggedCases):
    IMPLEMENTATION = "xla"
    HEAD_DIM = 16
    QUANT_RAGGED_CASES = {
        "mixed-gqa-int8": ("mixed", "gqa", F32, 8, "int8"),
        "decode-mqa-fp8": ("decode", "mqa", BF16, 4, "fp8"),
    }


def _pools(format, kv_heads=2, num_pages=5, page_size=4, head_dim=8):
    shape = (kv_heads, num_pages, page_size, head_dim)
    return kv_quant.empty_pool(shape, format), kv_quant.empty_pool(shape, format)


@pytest.mark.parametrize("format", FORMATS)
def test_paged_write_quantizes_each_vector_as_numpy_does(format):
    gen = rng(1, len(format))
    k_pages, v_pages = _pools(format)
    k = (gen.standard_normal((6, 2, 8)) * gen.uniform(0.1, 30, (6, 2, 1))).astype(np.float32)
    v = gen.standard_normal((6, 2, 8)).astype(np.float32)
    slots = np.array([3, -1, 9, 19, 0, 12], np.int32)  # one skipped
    k_pages, v_pages = jax.jit(fj.paged_write)(k_pages, v_pages, jnp.asarray(k), jnp.asarray(v),
                                               jnp.asarray(slots))
    assert isinstance(k_pages, QuantizedArray) and k_pages.format == format
    for pool, x in ((k_pages, k), (v_pages, v)):
        values, scales = quantize_vectors(x, format)
        stored = np.asarray(pool.values.astype(jnp.float32))
        stored_scales = np.asarray(pool.scales)
        for t, s in enumerate(slots):
            page, off = divmod(int(s), 4)
            if s < 0:
                continue
            # float32 math against float64 rounded once: a rounding step apart at most.
            np.testing.assert_allclose(stored_scales[:, page, off], scales[t], rtol=2**-23)
            want = values[t].astype(np.float32)
            np.testing.assert_allclose(stored[:, page, off], want, rtol=2**-3, atol=1)
        # Within half a step (int8) or e4m3's relative rounding (fp8) of what was written.
        truth = dequantize(pool)[:, slots[slots >= 0] // 4, slots[slots >= 0] % 4]
        step = np.abs(x[slots >= 0]).max(-1, keepdims=True) / QMAX[format]
        err = np.abs(np.swapaxes(truth, 0, 1) - x[slots >= 0])
        bound = step / 2 if format == "int8" else np.abs(x[slots >= 0]) * 2.0**-4 + step * 2**-9
        assert np.all(err <= bound * (1 + 1e-6)), err.max()
        assert np.all(np.asarray(pool.scales)[:, 1] == 0)  # page 1: nothing written


@pytest.mark.parametrize("format", FORMATS)
def test_paged_gather_dequantizes_and_zeroes_past_lengths(format):
    gen = rng(2, len(format))
    lengths = np.array([5, 0, 9])
    cache = paged_cache(gen, lengths, page_size=4, kv_heads=2, head_dim=8, dtype=F32)
    quant = quantize_cache(gen, cache.k_pages, cache.v_pages, cache.block_tables, lengths,
                           format)
    out = jit_paged_gather(quant.k_pages, cache.block_tables, jnp.asarray(lengths, jnp.int32))
    assert out.dtype == jnp.float32 and out.shape == quant.dense_k.shape
    np.testing.assert_allclose(f64(out), quant.dense_k, rtol=1e-6, atol=0)


def test_copy_pages_carries_the_scales():
    gen = rng(3)
    pool = gen.standard_normal((2, 4, 2, 8))
    kq, vq = (quantized_pool(gen, pool * s, "int8") for s in (1.0, 3.0))
    k2, v2 = jax.jit(fj.copy_pages)(kq, vq, jnp.array([[0, 3], [-1, 1]], jnp.int32))
    for new, old in ((k2, kq), (v2, vq)):
        want = dequantize(old)
        want[:, 3] = want[:, 0]
        np.testing.assert_array_equal(dequantize(new), want)


def test_empty_pool_and_bytes():
    k = kv_quant.empty_pool((8, 32, 16, 128), "int8", jnp.bfloat16)
    assert k.shape == (8, 32, 16, 128) and k.dtype == jnp.bfloat16
    # 128 int8 values and one float32 scale per token and head, against 256 bfloat16 bytes.
    assert k.nbytes == 8 * 32 * 16 * (128 + 4)
    assert k.nbytes / (8 * 32 * 16 * 128 * 2) == pytest.approx(0.515625)


def _bad_pool(what):
    k, _ = _pools("int8")
    if what == "scales_shape":
        return QuantizedArray(k.values, k.scales[..., :1, :], None, "int8", k.block)
    if what == "format":
        return QuantizedArray(jnp.zeros((2, 5, 4, 4), jnp.uint8), k.scales, None, "int4",
                              (8,))
    return QuantizedArray(k.values.astype(jnp.int16), k.scales, None, "int8", k.block)


@pytest.mark.parametrize("what,error,match", [
    ("scales_shape", ValueError, r"k_pages.scales must be \[..., 1\] = \(2, 5, 4, 1\).*"
                                 r"got k_pages.scales.shape=\(2, 5, 1, 1\)"),
    ("format", ValueError, r"k_pages is a int4 QuantizedArray; a quantized KV pool is 'int8' "
                           r"or 'fp8'"),
    ("values_dtype", TypeError, r"k_pages.values must be int8 for int8, got .*int16"),
])
def test_bad_pools_raise_one_clear_error(what, error, match):
    _, v = _pools("int8")
    q = jnp.zeros((1, 2, 8))
    with pytest.raises(error, match=match):
        fj.paged_attention(q, _bad_pool(what), v, np.zeros((1, 2), np.int32),
                           np.array([3], np.int32))


def test_mixed_pools_and_unknown_formats_raise():
    kq, vq = _pools("int8")
    _, v8 = _pools("fp8")
    k, v, slots = jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8)), jnp.zeros((1,), jnp.int32)
    with pytest.raises(TypeError, match="k_pages and v_pages must share a format"):
        fj.paged_write(kq, v8, k, v, slots)
    with pytest.raises(TypeError, match="both be quantized or both float"):
        fj.paged_write(kq, jnp.zeros(vq.shape), k, v, slots)
    with pytest.raises(ValueError, match=r"format must be 'int8' or 'fp8'.*got format='int4'"):
        kv_quant.empty_pool((2, 2, 2, 2), "int4")


def test_quantized_pools_split_by_kv_head_on_a_mesh():
    from forge_jax import sharding

    gen = rng(4)
    k_pages, v_pages = _pools("int8", kv_heads=4, num_pages=4)
    k, v = (jnp.asarray(gen.standard_normal((6, 4, 8)), F32) for _ in range(2))
    q = jnp.asarray(gen.standard_normal((2, 8, 8)), F32)
    tables, lengths = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([4, 2], jnp.int32)
    slots = jnp.asarray([0, 1, 2, 3, 8, 9], jnp.int32)

    def step(k_pages, v_pages):
        k_pages, v_pages = fj.paged_write(k_pages, v_pages, k, v, slots)
        k_pages, v_pages = fj.copy_pages(k_pages, v_pages, jnp.asarray([[0, 3]], jnp.int32))
        return k_pages, fj.paged_attention(q, k_pages, v_pages, tables, lengths)

    want_pool, want = jax.jit(step)(k_pages, v_pages)
    with sharding.use_mesh(sharding.make_mesh("dp=2,tp=2")):
        pool, out = jax.jit(step)(k_pages, v_pages)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(dequantize(pool), dequantize(want_pool))
    assert np.abs(np.asarray(out)).max() > 0
