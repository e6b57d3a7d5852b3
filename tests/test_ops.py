"""Every op against the independent float64 references in tests/cases/references.py.

Inputs are fresh random values (never zeros) rounded to the op's dtype; the reference
is computed from those rounded inputs, so the only error left is the op's own, which
must stay within forge_jax.tolerances.
"""

from __future__ import annotations

import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import case_id, jcall
from cases.checks import assert_close, assert_rope_close, rope_angle_slack
from cases.inputs import FLOAT_DTYPES, normal, rng
from cases.references import (
    attention_ref,
    embedding_ref,
    f64,
    gelu_tanh_mul_ref,
    matmul_ref,
    rms_norm_ref,
    rope_cos_sin_ref,
    rope_inv_freq_ref,
    rope_ref,
    silu_mul_ref,
    softmax_ref,
)
from cases.shapes import LINEAR_SCALING, LLAMA31_SCALING

import forge_jax as fj
from forge_jax import tolerances

DTYPE_IDS = ["f32", "f16", "bf16"]
dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)

LLAMA3 = LLAMA31_SCALING
LINEAR = LINEAR_SCALING


# --- matmul ------------------------------------------------------------------------------

MATMUL_SHAPES = [  # (batch_a, batch_b, M, K, N)
    ((), (), 1, 1, 1),
    ((), (), 3, 5, 7),
    ((2,), (), 17, 33, 9),
    ((2, 1), (3,), 4, 8, 5),
]


MATMUL_CASES = ([(jnp.float32, shape) for shape in MATMUL_SHAPES]
                + [(dtype, shape) for dtype in (jnp.float16, jnp.bfloat16)
                   for shape in (MATMUL_SHAPES[2], ((), (), 1, 33, 9))])


@pytest.mark.parametrize("dtype,shape", MATMUL_CASES, ids=case_id)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_matmul(dtype, shape, trans_a, trans_b):
    batch_a, batch_b, m, k, n = shape
    g = rng(1, m, k, n)
    a = normal(g, (*batch_a, *((k, m) if trans_a else (m, k))), dtype)
    b = normal(g, (*batch_b, *((n, k) if trans_b else (k, n))), dtype)
    out = jcall(fj.matmul, a, b, trans_a=trans_a, trans_b=trans_b)
    assert out.dtype == dtype
    assert_close(out, matmul_ref(a, b, trans_a=trans_a, trans_b=trans_b))


@dtypes
def test_matmul_alpha_beta_c(dtype):
    g = rng(2)
    a, b = normal(g, (2, 6, 10), dtype), normal(g, (10, 3), dtype)
    c = normal(g, (6, 1), dtype)  # broadcasts over the batch and N
    out = jcall(fj.matmul, a, b, alpha=0.5, beta=-2.0, c=c)
    assert out.shape == (2, 6, 3)
    assert_close(out, matmul_ref(a, b, alpha=0.5, beta=-2.0, c=c))
    # Traced scalars work for alpha and beta.
    alpha, beta = jnp.float32(1.5), jnp.float32(0.25)
    out = jax.jit(lambda a, b, c, al, be: jcall(fj.matmul, a, b, alpha=al, beta=be, c=c))(
        a, b, c, alpha, beta)
    assert_close(out, matmul_ref(a, b, alpha=1.5, beta=0.25, c=c))


def test_matmul_out_dtype_and_float32_accumulation():
    g = rng(3)
    # bfloat16 inputs, float32 result: the sum must not be rounded to bfloat16 on the way.
    a, b = normal(g, (8, 256), jnp.bfloat16), normal(g, (256, 4), jnp.bfloat16)
    out = jcall(fj.matmul, a, b, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    assert_close(out, matmul_ref(a, b), dtype=jnp.float32, factor=5)
    # Mixed input dtypes are refused even with out_dtype (the dtype rule of forge_jax.ops;
    # tests/test_dtype_rule.py): the caller casts.
    c32 = normal(g, (256, 4), jnp.float32)
    with pytest.raises(TypeError, match=r"a\.dtype=bfloat16.*b\.dtype=float32"):
        jcall(fj.matmul, a, c32, out_dtype=jnp.float32)
    out = jcall(fj.matmul, a.astype(jnp.float32), c32, out_dtype=jnp.float32)
    assert_close(out, matmul_ref(a, c32), dtype=jnp.float32, factor=5)


# --- rms_norm ----------------------------------------------------------------------------


@dtypes
@pytest.mark.parametrize("shape", [(7,), (3, 5, 33), (2, 4, 64)], ids=case_id)
def test_rms_norm(dtype, shape):
    g = rng(4, *shape)
    x = normal(g, shape, dtype, scale=3.0)
    w = normal(g, shape[-1:], dtype)
    out = jcall(fj.rms_norm, x, w, eps=1e-5)
    assert out.dtype == dtype and out.shape == shape
    assert_close(out, rms_norm_ref(x, w, eps=1e-5))


@dtypes
@pytest.mark.parametrize("shape", [(1, 9), (3, 2, 48)], ids=case_id)
def test_rms_norm_residual(dtype, shape):
    g = rng(5, *shape)
    x, r = normal(g, shape, dtype), normal(g, shape, dtype, scale=2.0)
    w = normal(g, shape[-1:], jnp.float32)  # weights may be kept in float32
    y, h = jcall(fj.rms_norm, x, w, residual=r)
    assert y.dtype == h.dtype == dtype
    y_ref, h_ref = rms_norm_ref(x, w, residual=r, h_dtype=dtype)
    assert_close(h, h_ref)
    assert_close(y, y_ref)
    # The fused form equals normalising the returned residual stream.
    np.testing.assert_array_equal(f64(jcall(fj.rms_norm, h, w)), f64(y))


def test_rms_norm_tiny_and_huge_rows():
    x = jnp.asarray(np.array([[1e-4, -2e-4, 3e-4, 1e-4], [3e4, -1e4, 2e4, 5e4]], np.float32))
    w = jnp.asarray(np.array([1.0, 2.0, 0.5, -1.0], np.float32))
    out = jcall(fj.rms_norm, x, w, eps=1e-6)
    assert_close(out, rms_norm_ref(x, w, eps=1e-6))


# --- silu_mul / softmax ------------------------------------------------------------------


# name: (the op, its reference, a seed)
GATED = {"silu_mul": (fj.silu_mul, silu_mul_ref, 6),
         "gelu_tanh_mul": (fj.gelu_tanh_mul, gelu_tanh_mul_ref, 61)}


@dtypes
@pytest.mark.parametrize("shape", [(1,), (5, 7), (2, 3, 64)], ids=case_id)
@pytest.mark.parametrize("name", sorted(GATED))
def test_gated_activation(name, dtype, shape):
    op, ref, seed = GATED[name]
    g = rng(seed, *shape)
    gate, up = normal(g, shape, dtype, scale=4.0), normal(g, shape, dtype)
    out = jcall(op, gate, up)
    assert out.dtype == dtype
    assert_close(out, ref(gate, up))


@pytest.mark.parametrize("name", sorted(GATED))
def test_gated_activation_extreme_gates_and_mixed_dtypes(name):
    op, ref, _ = GATED[name]
    gate = jnp.asarray(np.array([-100.0, -30.0, -1.0, 0.5, 30.0, 100.0], np.float32))
    up = jnp.asarray(np.array([1.0, 2.0, -3.0, 4.0, -5.0, 6.0], np.float32))
    assert_close(jcall(op, gate, up), ref(gate, up))
    with pytest.raises(TypeError, match="dtype"):
        op(gate, up.astype(jnp.bfloat16))


@dtypes
@pytest.mark.parametrize("shape,axis", [((5,), -1), ((3, 17), -1), ((4, 6, 3), 1),
                                        ((4, 6, 3), 0)], ids=case_id)
def test_softmax(dtype, shape, axis):
    g = rng(7, *shape)
    x = normal(g, shape, dtype, scale=5.0)
    out = jcall(fj.softmax, x, axis=axis)
    assert out.dtype == dtype
    assert_close(out, softmax_ref(x, axis=axis))


@dtypes
def test_softmax_where_and_fully_masked_rows(dtype):
    g = rng(8)
    x = normal(g, (5, 9), dtype, scale=3.0)
    where = g.random((5, 9)) < 0.5
    where[1] = False  # a fully masked row
    where[3] = True
    out = jcall(fj.softmax, x, where=jnp.asarray(where))
    ref = softmax_ref(x, where=where)
    assert_close(out, ref)
    np.testing.assert_array_equal(f64(out)[1], 0.0)
    np.testing.assert_array_equal(f64(out)[~where], 0.0)
    # A broadcast mask [1, 9] and -inf entries (masked like where=False).
    col = jnp.asarray(g.random((1, 9)) < 0.7)
    xi = x.at[0, 2].set(-jnp.inf).at[4].set(-jnp.inf)
    out = jcall(fj.softmax, xi, where=col)
    assert_close(out, softmax_ref(xi, where=np.asarray(col)))
    np.testing.assert_array_equal(f64(out)[4], 0.0)


def test_softmax_huge_logits_stay_finite():
    x = jnp.asarray(np.array([[1e4, -1e4, 9999.0, 0.0], [-1e4, -1e4, -1e4, -1e4]], np.float32))
    assert_close(jcall(fj.softmax, x), softmax_ref(x))


# --- RoPE --------------------------------------------------------------------------------
#
# The inverse-frequency table is float32, as in Hugging Face; the rope checks allow its
# error, which grows with the position, on top of the dtype tolerance
# (cases.checks.rope_angle_slack).

ROPE_SCALINGS = pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3],
                                        ids=["none", "linear", "llama3"])


ROPE_CASES = (  # (dtype, scaling, shape, theta)
    [(jnp.float32, sc, sh, th) for sc in (None, LINEAR, LLAMA3)
     for sh, th in (((2, 5, 3, 16), 10000.0), ((2, 7, 2, 64), 500000.0))]
    + [(dt, sc, (2, 5, 3, 16), 10000.0) for dt in (jnp.float16, jnp.bfloat16)
       for sc in (None, LLAMA3)]
    + [(jnp.float32, None, (1, 1, 1, 2), 10000.0)])


@pytest.mark.parametrize("dtype,scaling,shape,theta", ROPE_CASES, ids=case_id)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope(dtype, scaling, interleaved, shape, theta):
    g = rng(9, *shape)
    x = normal(g, shape, dtype)
    positions = jnp.asarray(g.integers(0, 40000, shape[:2]), jnp.int32)
    out = jcall(fj.rope, x, positions, theta=theta, scaling=scaling, interleaved=interleaved)
    assert out.dtype == dtype and out.shape == shape
    assert_rope_close(out, x, positions, theta=theta, scaling=scaling, interleaved=interleaved)
    # Small positions: the plain dtype tolerance.
    small = positions % 64
    out = jcall(fj.rope, x, small, theta=theta, scaling=scaling, interleaved=interleaved)
    assert_close(out, rope_ref(x, small, theta=theta, scaling=scaling, interleaved=interleaved))


def test_rope_conventions_are_permutations_of_each_other():
    # The same rotation in the two layouts: interleaved pairs (2i, 2i+1) are rotate-half
    # pairs (i, i + d/2) after a fixed permutation of the head dimension.
    g = rng(10)
    x = normal(g, (2, 6, 2, 8))
    pos = jnp.asarray(g.integers(0, 100, (2, 6)), jnp.int32)
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    half = jcall(fj.rope, x[..., perm], pos)
    inter = jcall(fj.rope, x, pos, interleaved=True)
    assert_close(half, f64(inter)[..., perm])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a property of XLA:CPU's kernels")
@pytest.mark.parametrize("trans_a", [False, True])
def test_matmul_bfloat16_row_is_two_rows_on_cpu(trans_a):
    # XLA:CPU multiplies a bfloat16 [1, K] row by a matrix in a slow loop, [2, K] in a fast
    # kernel (BENCHMARKS.md): the xla implementation pads a bfloat16 row to two. The
    # product, its gradient and its vmap stay the reference's.
    g = rng(4)
    a = normal(g, (33, 1) if trans_a else (1, 33), jnp.bfloat16)
    b = normal(g, (9, 33), jnp.bfloat16)
    f = jax.jit(lambda a, b: fj.matmul(a, b, trans_a=trans_a, trans_b=True))
    hlo = f.lower(a, b).compile().as_text()
    assert re.search(r"= f32\[2,9\]\{[0-9,]*\} dot\(", hlo), hlo
    assert_close(f(a, b), matmul_ref(a, b, trans_a=trans_a, trans_b=True))

    def loss(a, b):
        return jnp.sum(fj.matmul(a, b, trans_a=trans_a, trans_b=True).astype(jnp.float32) ** 2)

    def loss_ref(a, b):  # float32, from the same bfloat16 values
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.sum(((a.T if trans_a else a) @ b.T) ** 2)

    for got, want in zip(jax.grad(loss, (0, 1))(a, b), jax.grad(loss_ref, (0, 1))(a, b),
                         strict=True):
        assert_close(got, want.astype(jnp.bfloat16))
    rows = normal(g, (4, *a.shape), jnp.bfloat16)
    out = jax.vmap(lambda a: fj.matmul(a, b, trans_a=trans_a, trans_b=True))(rows)
    for i in range(rows.shape[0]):
        assert_close(out[i], matmul_ref(rows[i], b, trans_a=trans_a, trans_b=True))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a property of XLA:CPU's fusion")
def test_rope_tables_are_written_once_on_cpu():
    # XLA:CPU fuses elementwise producers into their consumers: left to it, each rotation
    # evaluated the sine and cosine again for every head and half (4-8 ms a layer at 2048
    # tokens). The xla implementation writes the tables once; queries and keys at the
    # same positions share them, and the values stay the reference's.
    g = rng(12)
    q, k = normal(g, (1, 16, 3, 8)), normal(g, (1, 16, 1, 8))
    pos = jnp.asarray(g.integers(0, 1000, (1, 16)), jnp.int32)
    f = jax.jit(lambda q, k, p: (fj.rope(q, p), fj.rope(k, p)))
    hlo = f.lower(q, k, pos).compile().as_text()
    assert (hlo.count(" sine("), hlo.count(" cosine(")) == (1, 1), hlo
    for out, x in zip(f(q, k, pos), (q, k), strict=True):
        assert_rope_close(out, x, pos, theta=10000.0, scaling=None, interleaved=False)


def test_rope_relative_positions():
    # <rope(q, p), rope(k, s)> depends only on p - s.
    g = rng(11)
    q, k = normal(g, (1, 1, 1, 32)), normal(g, (1, 1, 1, 32))

    def dot(p, s):
        rq = jcall(fj.rope, q, jnp.full((1, 1), p, jnp.int32))
        rk = jcall(fj.rope, k, jnp.full((1, 1), s, jnp.int32))
        return float(jnp.sum(rq * rk))

    assert dot(3, 1) == pytest.approx(dot(103, 101), rel=1e-4, abs=1e-4)
    assert dot(3, 1) != pytest.approx(dot(3, 2), rel=1e-3)


@ROPE_SCALINGS
@pytest.mark.parametrize("pos_shape", [(5,), (2, 7)], ids=case_id)
def test_rope_cos_sin(scaling, pos_shape):
    g = rng(12, *pos_shape)
    positions = jnp.asarray(g.integers(0, 70000, pos_shape), jnp.int32)
    cos, sin = jcall(fj.rope_cos_sin, positions, head_dim=64, theta=500000.0, scaling=scaling)
    assert cos.shape == sin.shape == (*pos_shape, 32)
    assert cos.dtype == sin.dtype == jnp.float32
    cos_ref, sin_ref = rope_cos_sin_ref(positions, 64, theta=500000.0, scaling=scaling)
    slack = rope_angle_slack(positions, 64, theta=500000.0, scaling=scaling)
    tol = tolerances.tolerance(jnp.float32)
    for got, want in ((cos, cos_ref), (sin, sin_ref)):
        err = np.abs(f64(got) - want)
        assert (err <= tol.atol + tol.rtol * np.abs(want) + slack).all()


def test_llama3_scaling_regions():
    # The three regions of llama3 scaling: kept, divided by factor, interpolated.
    inv = rope_inv_freq_ref(128, theta=500000.0)
    scaled = rope_inv_freq_ref(128, theta=500000.0, scaling=LLAMA3)
    wavelen = 2 * np.pi / inv
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(scaled[high], inv[high], rtol=1e-7)
    np.testing.assert_allclose(scaled[low], inv[low] / 8, rtol=1e-7)
    mid = ~high & ~low
    assert ((scaled[mid] < inv[mid]) & (scaled[mid] > inv[mid] / 8)).all()
    # And the op uses exactly these frequencies: angle at position 1 = inv_freq.
    cos, sin = jcall(fj.rope_cos_sin, jnp.ones((1,), jnp.int32), head_dim=128, theta=500000.0,
                     scaling=LLAMA3)
    assert_close(np.arctan2(f64(sin), f64(cos))[0], scaled, dtype=jnp.float32)


def test_rope_inv_freq_matches_hugging_face():
    """Parity of the reference frequencies with transformers' own definitions."""
    pytest.importorskip("torch")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    for scaling in (LINEAR, LLAMA3):
        params = {"rope_type": scaling.kind, "rope_theta": 500000.0, "factor": scaling.factor}
        if scaling.kind == "llama3":
            params.update(low_freq_factor=scaling.low_freq_factor,
                          high_freq_factor=scaling.high_freq_factor,
                          original_max_position_embeddings=8192)
        init = rope_utils.ROPE_INIT_FUNCTIONS[scaling.kind]
        base = dict(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072)
        try:  # transformers >= 5: rope_parameters
            inv_hf, _ = init(transformers.LlamaConfig(**base, rope_parameters=params), None)
        except (TypeError, KeyError, AttributeError):  # 4.x: rope_theta + rope_scaling
            config = transformers.LlamaConfig(**base, rope_theta=500000.0, rope_scaling=params)
            inv_hf, _ = init(config, None)
        np.testing.assert_allclose(
            rope_inv_freq_ref(128, theta=500000.0, scaling=scaling),
            inv_hf.double().numpy(), rtol=1e-6)
        assert fj.RopeScaling.from_hf(params) == scaling


# --- attention ---------------------------------------------------------------------------

HEADS = pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 1)],
                                ids=["mha", "gqa", "mqa"])


def _qkv(g, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype=jnp.float32, scale=1.0):
    return (normal(g, (batch, q_len, q_heads, head_dim), dtype, scale),
            normal(g, (batch, kv_len, kv_heads, head_dim), dtype, scale),
            normal(g, (batch, kv_len, kv_heads, head_dim), dtype))


ATTENTION_SHAPES = [(1, 1, 8), (5, 5, 16), (3, 7, 8), (7, 13, 32)]  # (q_len, kv_len, head_dim)
ATTENTION_CASES = (  # (dtype, q_heads, kv_heads, shape)
    [(jnp.float32, qh, kh, shape) for qh, kh in ((4, 4), (4, 2), (6, 1))
     for shape in ATTENTION_SHAPES]
    + [(jnp.float16, 4, 2, (7, 13, 32)), (jnp.bfloat16, 4, 2, (7, 13, 32)),
       (jnp.bfloat16, 6, 1, (1, 1, 8)), (jnp.float16, 4, 4, (3, 7, 8))])


@pytest.mark.parametrize("dtype,q_heads,kv_heads,shape", ATTENTION_CASES, ids=case_id)
def test_attention_causal(dtype, q_heads, kv_heads, shape):
    q_len, kv_len, head_dim = shape
    g = rng(13, q_len, kv_len, q_heads, kv_heads)
    q, k, v = _qkv(g, 2, q_len, kv_len, q_heads, kv_heads, head_dim, dtype, scale=2.0)
    out = jcall(fj.attention, q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, attention_ref(q, k, v))


ATTENTION_OPTIONS = {
    "non_causal": dict(causal=False),
    "scale": dict(scale=0.3),
    "soft_cap": dict(logits_soft_cap=2.0),
    "window": dict(sliding_window=3),
    "window_non_causal": dict(sliding_window=2, causal=False),
    "kv_lengths": dict(kv_lengths=np.array([9, 4], np.int32)),
    "positions": dict(q_positions=np.array([[0, 3, 3, 8], [5, 6, 7, 1]], np.int32)),
    "everything": dict(q_positions=np.array([[2, 4, 6, 8], [1, 1, 2, 3]], np.int32),
                       kv_lengths=np.array([7, 10], np.int32), sliding_window=4,
                       logits_soft_cap=5.0, scale=0.5),
}


OPTION_CASES = (  # (dtype, q_heads, kv_heads, option)
    [(jnp.float32, 4, 2, option) for option in ATTENTION_OPTIONS]
    + [(jnp.float32, 4, 4, "everything"), (jnp.float32, 6, 1, "everything"),
       (jnp.bfloat16, 4, 2, "everything"), (jnp.bfloat16, 6, 1, "soft_cap")])


@pytest.mark.parametrize("dtype,q_heads,kv_heads,option", OPTION_CASES, ids=case_id)
def test_attention_options(dtype, q_heads, kv_heads, option):
    kw = ATTENTION_OPTIONS[option]
    g = rng(14, q_heads, kv_heads)
    q, k, v = _qkv(g, 2, 4, 10, q_heads, kv_heads, 16, dtype, scale=2.0)
    jkw = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out = jcall(fj.attention, q, k, v, **jkw)
    assert_close(out, attention_ref(q, k, v, **kw))


@HEADS
def test_attention_decode_equals_last_row(q_heads, kv_heads):
    g = rng(15)
    q, k, v = _qkv(g, 2, 9, 9, q_heads, kv_heads, 16)
    full = jcall(fj.attention, q, k, v)
    dec = jcall(fj.attention, q[:, -1:], k, v)
    assert_close(dec, f64(full)[:, -1:])
    # The decode query sees every key, not just key 0 (top-left alignment would).
    assert_close(dec, attention_ref(q[:, -1:], k, v, causal=False))
    # Each earlier row too, as a decode step against its own key prefix.
    for t in (0, 4):
        step = jcall(fj.attention, q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1])
        assert_close(step, f64(full)[:, t:t + 1])


@pytest.mark.parametrize("chunk,extra", [(4, {}), (3, {"sliding_window": 4}),
                                         (4, {"logits_soft_cap": 3.0}),
                                         (2, {"sliding_window": 3, "logits_soft_cap": 5.0})],
                         ids=case_id)
def test_attention_chunked_prefill_equals_full(chunk, extra):
    g = rng(16, chunk)
    seq = 9
    q, k, v = _qkv(g, 2, seq, seq, 4, 2, 16)
    full = f64(jcall(fj.attention, q, k, v, **extra))
    pieces = []
    for start in range(0, seq, chunk):
        end = min(start + chunk, seq)
        # Queries [start, end) against the growing key prefix [0, end).
        pieces.append(f64(jcall(fj.attention, q[:, start:end], k[:, :end], v[:, :end], **extra)))
    assert_close(np.concatenate(pieces, axis=1), full, dtype=jnp.float32)
    assert_close(full, attention_ref(q, k, v, **extra), dtype=jnp.float32)


def test_attention_explicit_positions_match_default_alignment():
    g = rng(17)
    q, k, v = _qkv(g, 2, 3, 8, 4, 2, 8)
    default = jcall(fj.attention, q, k, v)
    explicit = jcall(fj.attention, q, k, v, q_positions=jnp.broadcast_to(
        jnp.arange(5, 8, dtype=jnp.int32), (2, 3)))
    assert_close(explicit, f64(default))
    # Decode against a padded cache: kv_lengths hide the padding, positions place the query.
    kv_lengths = jnp.asarray([5, 8], jnp.int32)
    pos = (kv_lengths - 1)[:, None]
    out = jcall(fj.attention, q[:, :1], k, v, q_positions=pos, kv_lengths=kv_lengths)
    for b, n in enumerate((5, 8)):
        assert_close(out[b:b + 1], attention_ref(q[b:b + 1, :1], k[b:b + 1, :n], v[b:b + 1, :n]))


def test_attention_huge_logits_stay_finite():
    g = rng(18)
    q, k, v = _qkv(g, 1, 4, 6, 2, 1, 8)
    # scale=1e4 / |q.k| ~ 1: logits of order 1e4.
    out = jcall(fj.attention, q, k, v, scale=1e4)
    assert_close(out, attention_ref(q, k, v, scale=1e4))
    out = jcall(fj.attention, q, k, v, scale=1e4, logits_soft_cap=50.0)
    assert_close(out, attention_ref(q, k, v, scale=1e4, logits_soft_cap=50.0))


def test_attention_fully_masked_queries_give_zeros():
    g = rng(19)
    q, k, v = _qkv(g, 2, 3, 6, 4, 2, 8)
    # Batch 1 has no valid key; batch 0 query 0 sits before the first key.
    kv_lengths = jnp.asarray([6, 0], jnp.int32)
    pos = jnp.asarray([[-1, 2, 5], [0, 1, 2]], jnp.int32)
    out = f64(jcall(fj.attention, q, k, v, q_positions=pos, kv_lengths=kv_lengths))
    ref = attention_ref(q, k, v, q_positions=np.asarray(pos), kv_lengths=np.asarray(kv_lengths))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[0, 0], 0.0)
    assert_close(out, ref, dtype=jnp.float32)
    # A q_len longer than kv_len: the bottom-right default puts early queries before key 0.
    q2 = normal(g, (1, 5, 2, 8))
    out = f64(jcall(fj.attention, q2, k[:1, :3], v[:1, :3]))
    np.testing.assert_array_equal(out[0, :2], 0.0)
    assert_close(out, attention_ref(q2, k[:1, :3], v[:1, :3]), dtype=jnp.float32)


def test_attention_without_keys_and_with_huge_window():
    g = rng(22)
    q, k, v = _qkv(g, 2, 3, 4, 2, 1, 8)
    # kv_len 0: no query sees a key, so every output is zero (not a reduction error).
    out = jcall(fj.attention, q, k[:, :0], v[:, :0])
    assert out.shape == q.shape
    np.testing.assert_array_equal(f64(out), 0.0)
    np.testing.assert_array_equal(f64(jcall(fj.softmax, q[..., :0])), np.zeros((2, 3, 2, 0)))
    # A window wider than int32 hides nothing (and does not overflow).
    out = jcall(fj.attention, q, k, v, sliding_window=2**40)
    assert_close(out, attention_ref(q, k, v))


@hypothesis.settings(max_examples=12)
@hypothesis.given(
    batch=st.integers(1, 2), q_len=st.integers(1, 6), extra_kv=st.integers(0, 5),
    kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([4, 8]), causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 6)),
    cap=st.one_of(st.none(), st.floats(0.5, 30.0)),
    use_lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_property(batch, q_len, extra_kv, kv_heads, group, head_dim, causal, window,
                            cap, use_lengths, seed):
    g = rng(seed)
    kv_len = q_len + extra_kv
    q, k, v = _qkv(g, batch, q_len, kv_len, kv_heads * group, kv_heads, head_dim, scale=2.0)
    kv_lengths = g.integers(0, kv_len + 1, (batch,)).astype(np.int32) if use_lengths else None
    out = jcall(fj.attention, q, k, v, causal=causal, sliding_window=window, logits_soft_cap=cap,
                       kv_lengths=None if kv_lengths is None else jnp.asarray(kv_lengths))
    ref = attention_ref(q, k, v, causal=causal, sliding_window=window, logits_soft_cap=cap,
                        kv_lengths=kv_lengths)
    assert_close(out, ref, allow_zero_ref=True)


# --- embedding ---------------------------------------------------------------------------


@dtypes
@pytest.mark.parametrize("ids_shape", [(), (5,), (2, 3)], ids=case_id)
def test_embedding(dtype, ids_shape):
    g = rng(20, len(ids_shape))
    table = normal(g, (11, 6), dtype)
    ids = jnp.asarray(g.integers(0, 11, ids_shape), jnp.int32)
    out = jcall(fj.embedding, table, ids)
    assert out.dtype == dtype and out.shape == (*ids_shape, 6)
    np.testing.assert_array_equal(f64(out), embedding_ref(table, ids))


def test_embedding_out_of_range_under_jit_is_nan_not_clamped():
    g = rng(21)
    table = normal(g, (4, 3))
    out = jax.jit(fj.embedding)(table, jnp.asarray([1, 4, -1], jnp.int32))
    np.testing.assert_array_equal(f64(out[0]), embedding_ref(table, [1])[0])
    assert np.isnan(f64(out[1:])).all()


# --- fuzzed shapes -----------------------------------------------------------------------


@hypothesis.settings(max_examples=15)
@hypothesis.given(
    m=st.integers(1, 9), k=st.integers(1, 17), n=st.integers(1, 9),
    batch=st.sampled_from([(), (2,), (1, 3)]), trans_a=st.booleans(), trans_b=st.booleans(),
    with_c=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_property(m, k, n, batch, trans_a, trans_b, with_c, seed):
    g = rng(seed)
    a = normal(g, (*batch, *((k, m) if trans_a else (m, k))))
    b = normal(g, (*((n, k) if trans_b else (k, n)),))
    kw = dict(alpha=0.75, beta=2.0, c=normal(g, (n,))) if with_c else {}
    out = jcall(fj.matmul, a, b, trans_a=trans_a, trans_b=trans_b, **kw)
    assert_close(out, matmul_ref(a, b, trans_a=trans_a, trans_b=trans_b, **kw))


@hypothesis.settings(max_examples=12)
@hypothesis.given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data(),
    seed=st.integers(0, 2**16))
def test_softmax_and_rms_norm_property(shape, data, seed):
    g = rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = normal(g, shape, scale=4.0)
    where = g.random(shape) < 0.6
    out = f64(jcall(fj.softmax, x, axis=axis, where=jnp.asarray(where)))
    assert_close(out, softmax_ref(x, axis=axis, where=where), dtype=jnp.float32,
                 allow_zero_ref=True)
    sums = out.sum(axis=axis)
    any_valid = where.any(axis=axis)
    np.testing.assert_allclose(sums[any_valid], 1.0, atol=1e-5)
    np.testing.assert_array_equal(sums[~any_valid], 0.0)
    w = normal(g, shape[-1:])
    assert_close(jcall(fj.rms_norm, x, w), rms_norm_ref(x, w))
