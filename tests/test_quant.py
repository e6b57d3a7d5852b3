"""Quantized arrays: fj.quantize / fj.dequantize round trips, the packed int4 layout, and
fj.matmul with a quantized right-hand side against float64 NumPy (the stored values read
byte by byte in tests/cases/quant.py), under jit, vmap and a sharding; bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import quant as qref
from cases.inputs import normal, rng

import forge_jax as fj

FORMATS = [
    ("int8", {}),
    ("int4", {"group_size": 32}),
    ("int4", {"group_size": 64}),
    ("int4", {"group_size": 128}),
    ("int4", {"group_size": 32, "symmetric": False}),
    ("fp8", {}),
    ("fp8", {"block": (128, 128)}),
]
IDS = [f"{f}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for f, kw in FORMATS]


def _weight(seed, shape=(256, 256)):
    return normal(rng(seed), shape, jnp.float32)


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=IDS)
def test_round_trip_within_half_a_step(fmt, kw):
    w = _weight(1)
    q = fj.quantize(w, fmt, **kw)
    assert q.shape == w.shape and q.format == fmt
    w64 = np.asarray(w, np.float64)
    ref = qref.dequantize(q)
    # float32 math: s * q + m rounds once more than float64 does
    np.testing.assert_allclose(np.asarray(fj.dequantize(q), np.float64), ref, rtol=1e-6,
                               atol=1e-6)
    block = (1,) * (w.ndim - len(q.block)) + q.block
    scale = np.asarray(q.scales, np.float64)
    for axis, b in enumerate(block):
        scale = np.repeat(scale, b, axis=axis)
    err = np.abs(ref - w64)
    if fmt == "fp8":  # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 of the value
        assert np.all(err <= np.abs(w64) * 2.0 ** -4 + scale * 2.0 ** -9)
    else:
        assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-7)
    assert err.max() > 0  # a lossy format that lost nothing would be suspicious


def test_int8_matches_an_independent_quantizer():
    w = _weight(2)
    q = fj.quantize(w, "int8")
    w64 = np.asarray(w, np.float64)
    scale = np.abs(w64).max(axis=1, keepdims=True) / 127
    np.testing.assert_allclose(np.asarray(q.scales, np.float64), scale, rtol=1e-6)
    diff = np.asarray(q.values, np.int64) - np.round(w64 / scale)
    assert np.abs(diff).max() <= 1 and np.mean(diff != 0) < 1e-3  # float32 ties only


def test_int4_is_packed_two_a_byte_low_nibble_first():
    w = _weight(3, (8, 64))
    q = fj.quantize(w, "int4", group_size=32)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (8, 32)
    step = np.repeat(np.asarray(q.scales, np.float64), 32, axis=1)
    expect = np.clip(np.round(np.asarray(w, np.float64) / step), -8, 7) + 8
    got = qref.nibbles(q.values)
    assert np.mean(got != expect) < 1e-3
    np.testing.assert_array_equal(np.asarray(q.values), got[:, 0::2] | (got[:, 1::2] << 4))


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=IDS)
@pytest.mark.parametrize("m", [1, 5])
def test_matmul_matches_float64(fmt, kw, m):
    w = _weight(4)
    q = fj.quantize(w, fmt, **kw)
    x = normal(rng(5, m), (m, w.shape[1]), jnp.float32)
    want = np.asarray(x, np.float64) @ qref.dequantize(q).T
    got = jax.jit(lambda x, q: fj.matmul(x, q, trans_b=True, implementation="xla"))(x, q)
    assert got.shape == (m, w.shape[0]) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-4)
    assert fj.dispatch.last_selection("quantized_matmul").implementation == "xla"


@pytest.mark.parametrize("shape, kw", [
    ((256, 256), {}), ((256, 256), {"group_size": 64}), ((256, 256), {"block": (2, 64)}),
    ((2048, 256), {}),  # two blocks of rows (the lax.map)
], ids=["channel", "g64", "block2x64", "row-blocks"])
@pytest.mark.parametrize("m", [1, 5])
def test_w8a8_matmul_matches_float64(shape, kw, m):
    q = fj.quantize(_weight(20, shape), "int8", activations="int8", **kw)
    assert q.activations == "int8" and "activations='int8'" in repr(q)
    x = normal(rng(21, m), (m, shape[1]), jnp.float32)
    got = jax.jit(lambda x, q: fj.matmul(x, q, trans_b=True))(x, q)
    assert fj.dispatch.last_selection("quantized_matmul").implementation == "xla"
    np.testing.assert_allclose(np.asarray(got, np.float64), qref.w8a8_product(x, q),
                               rtol=1e-5, atol=1e-5)
    # Not the weight-only product: the activations were rounded to int8 steps, within bound.
    float_product = np.asarray(x, np.float64) @ qref.dequantize(q).T
    diff = np.abs(np.asarray(got, np.float64) - float_product)
    assert diff.max() > 1e-4
    assert (diff <= qref.w8a8_error_bound(x, q) + 1e-5).all()


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
@pytest.mark.parametrize("fmt,kw", [("int8", {}), ("int4", {"group_size": 32}),
                                    ("int8", {"activations": "int8"})],
                         ids=["int8", "int4", "w8a8"])
def test_matmul_with_no_rows(lead, fmt, kw):
    # A batch of no tokens is an empty product (as fj.matmul with a float weight), not an
    # error.
    w = _weight(24, (32, 64))
    q = fj.quantize(w, fmt, **kw)
    x = jnp.zeros(lead + (64,), jnp.bfloat16)
    want = fj.matmul(x, fj.dequantize(q, jnp.bfloat16), trans_b=True)
    got = jax.jit(lambda x, q: fj.matmul(x, q, trans_b=True))(x, q)
    assert got.shape == want.shape == lead + (32,) and got.dtype == jnp.bfloat16


@pytest.mark.parametrize("implementation,kw", [
    ("pallas_gpu_interpret", {}), ("pallas_tpu_interpret", {}),
    ("pallas_tpu_interpret", {"activations": "int8"})], ids=["gpu", "tpu", "tpu-w8a8"])
def test_kernels_with_no_rows(implementation, kw):
    # The kernels accept any number of rows (their supports() says nothing of it): none
    # launches nothing and gives the empty product, the epilogue applied.
    q = fj.quantize(_weight(25, (128, 256)), "int8", **kw)
    x = jnp.zeros((2, 0, 256), jnp.bfloat16)
    got = fj.matmul(x, q, trans_b=True, beta=1.0, c=jnp.ones((128,), jnp.float32),
                    implementation=implementation)
    assert got.shape == (2, 0, 128) and got.dtype == jnp.bfloat16


def test_w8a8_quantizes_rows_per_token():
    x = normal(rng(22), (3, 2, 64), jnp.float32).at[1, 0].set(0.0)  # one row of zeros
    q, scale = fj.quant.quantize_rows(x)
    want_q, want_scale = qref.quantize_rows(x)
    assert q.dtype == jnp.int8 and scale.shape == (3, 2, 1)
    np.testing.assert_array_equal(np.asarray(q, np.float64), want_q)
    np.testing.assert_allclose(np.asarray(scale, np.float64), want_scale, rtol=1e-7)
    w = fj.quantize(_weight(23, (32, 64)), "int8", activations="int8")
    out = fj.matmul(x, w, trans_b=True)
    assert out.shape == (3, 2, 32) and not np.asarray(out[1, 0]).any()
    np.testing.assert_allclose(np.asarray(out, np.float64), qref.w8a8_product(x, w),
                               rtol=1e-5, atol=1e-5)


def test_matmul_bias_batch_and_bfloat16():
    w = _weight(6, (64, 96))
    q = fj.quantize(w, "int4", group_size=32, symmetric=False)
    x = normal(rng(7), (2, 3, 96), jnp.float32)
    bias = normal(rng(8), (64,), jnp.float32)
    want = np.asarray(x, np.float64) @ qref.dequantize(q).T + np.asarray(bias, np.float64)
    got = fj.matmul(x, q, trans_b=True, beta=1.0, c=bias)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    xb = x.astype(jnp.bfloat16)
    got = fj.matmul(xb, q, trans_b=True, out_dtype=jnp.float32)
    want = np.asarray(xb.astype(jnp.float32), np.float64) @ np.asarray(
        fj.dequantize(q, jnp.bfloat16).astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)


def test_matmul_untransposed_weight():
    w = _weight(9, (96, 64))  # [K, N], blocks along N
    q = fj.quantize(w, "int8")
    x = normal(rng(10), (4, 96), jnp.float32)
    want = np.asarray(x, np.float64) @ qref.dequantize(q)
    np.testing.assert_allclose(np.asarray(fj.matmul(x, q)), want, rtol=1e-5, atol=1e-4)


def test_vmap_over_stacked_quantized_weights():
    ws = [_weight(11 + i, (64, 64)) for i in range(3)]
    qs = [fj.quantize(w, "int4", group_size=32) for w in ws]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *qs)
    assert stacked.shape == (3, 64, 64)
    x = normal(rng(14), (3, 2, 64), jnp.float32)
    got = jax.vmap(lambda x, q: fj.matmul(x, q, trans_b=True))(x, stacked)
    for i, q in enumerate(qs):
        want = np.asarray(x[i], np.float64) @ qref.dequantize(q).T
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.vmap(fj.dequantize)(stacked)[1]),
                               qref.dequantize(qs[1]), rtol=1e-6, atol=1e-6)


def test_sharded_quantized_weight():
    mesh = fj.sharding.make_mesh({"x": 4})
    q = fj.quantize(_weight(15, (256, 128)), "int4", group_size=32)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    sharded = jax.device_put(q, rows)
    assert sharded.values.sharding == rows and len(sharded.scales.devices()) == 4
    x = normal(rng(16), (3, 128), jnp.float32)
    got = jax.jit(lambda x, q: fj.matmul(x, q, trans_b=True))(x, sharded)
    want = np.asarray(x, np.float64) @ qref.dequantize(q).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_from_parts_takes_the_hf_fp8_layout():
    w = _weight(17, (256, 128))
    q = fj.quantize(w, "fp8", block=(128, 128))
    again = fj.quant.from_parts(q.values, q.scales, format="fp8", block=(128, 128))
    np.testing.assert_array_equal(np.asarray(fj.dequantize(again)), np.asarray(fj.dequantize(q)))
    assert q.scales.shape == (2, 1) and q.values.dtype == jnp.float8_e4m3fn


def test_bytes_match_the_formats_ideal():
    w = _weight(18, (256, 1024))
    for fmt, kw, ideal in [("int8", {}, 0.25), ("int4", {"group_size": 32}, 5 / 32),
                           ("int4", {"group_size": 128}, 4.25 / 32)]:
        q = fj.quantize(w, fmt, **kw)
        ratio = q.nbytes / w.nbytes
        bits = fj.quant.bits_per_value(fmt, group_size=kw.get("group_size"), columns=1024)
        assert abs(ratio - bits / 32) < 1e-9 and abs(ratio - ideal) / ideal < 0.05, (fmt, ratio)


@pytest.mark.parametrize("call,message", [
    (lambda w: fj.quantize(w, "int4", group_size=100), r"group_size=100 must be a positive int "
                                                       r"dividing w.shape\[-1\]=256"),
    (lambda w: fj.quantize(w[:, :7], "int4", group_size=7), r"w.shape\[-1\]=7 is odd"),
    (lambda w: fj.quantize(w, "int3"), r"unknown quantization format 'int3'"),
    (lambda w: fj.quantize(w, "int8", symmetric=False), r"symmetric=False is for int4"),
    (lambda w: fj.quantize(w, "fp8", block=(100, 128)), r"block=\(100, 128\) does not divide"),
    (lambda w: fj.quantize(w.astype(jnp.int32), "int8"), r"w must be a float array"),
    (lambda w: fj.quant.from_parts(jnp.zeros((4, 8), jnp.int8), jnp.ones((4, 2)),
                                   format="int8", block=(8,)),
     r"scales.shape=\(4, 2\) must be \(4, 1\)"),
    (lambda w: fj.matmul(jnp.ones((2, 100)), fj.quantize(w, "int8"), trans_b=True),
     r"contracting dimensions disagree"),
    (lambda w: fj.matmul(jnp.ones((256, 2)), fj.quantize(w, "int8"), trans_a=True,
                         trans_b=True), r"trans_a=True is not supported"),
    (lambda w: fj.quantize(w, "int4", activations="int8"),
     r"activations='int8' \(W8A8\) is for int8 weights, not format='int4'"),
    (lambda w: fj.quantize(w, "int8", activations="fp8"),
     r"activations='fp8' must be one of \(None, 'int8'\)"),
    (lambda w: fj.matmul(jnp.ones((2, 256)), fj.quantize(w, "int8", activations="int8")),
     r"W8A8\) needs the \[out, in\] layout: trans_b=True"),
    (lambda w: fj.quant.from_parts(jnp.zeros((4, 8), jnp.int8), jnp.ones((4, 1)),
                                   jnp.ones((4, 1)), format="int8", block=(8,),
                                   activations="int8"), r"needs symmetric weights"),
])
def test_bad_inputs_are_one_clear_error(call, message):
    with pytest.raises((ValueError, TypeError), match=message) as info:
        call(_weight(19))
    assert "\n" not in str(info.value)


def test_w8a8_on_a_mesh_splits_output_channels_only():
    """A W8A8 weight placed column-parallel computes the one-device W8A8 product per shard;
    split over its input channels it is refused (a row's activation scale spans all of K)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from forge_jax import sharding

    x = normal(rng(24), (4, 128), jnp.float32)
    q = fj.quantize(_weight(25, (64, 128)), "int8", activations="int8")
    mesh = sharding.make_mesh("dp=2,tp=4")

    def product(b):
        with sharding.use_mesh(mesh):
            return fj.matmul(x, b, trans_b=True)

    columns = fj.quant.place(q, NamedSharding(mesh, P("tp", None)))
    assert columns.activations == "int8" and columns.spec == ("tp", None)
    np.testing.assert_allclose(np.asarray(jax.jit(product)(columns), np.float64),
                               qref.w8a8_product(x, q), rtol=1e-5, atol=1e-5)
    rows = fj.quant.place(q, NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(ValueError, match=r"W8A8\) with a weight split over its input channels"):
        jax.jit(product)(rows)
