"""Bad input: every validation path raises the documented ValueError / TypeError, before
any tracing, with a message that names the argument and its value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_raises_as_listed

import forge_jax as fj

F32 = jnp.float32


def z(*shape, dtype=F32):
    """A placeholder array (validation never looks at values, only shapes and dtypes)."""
    return jnp.ones(shape, dtype)


def i32(*shape):
    return jnp.zeros(shape, jnp.int32)


Q, KV = z(2, 3, 4, 8), z(2, 5, 2, 8)

CASES = {
    # matmul
    "matmul_a_rank": (lambda: fj.matmul(z(3), z(3, 2)),
        ValueError, r"a must have rank >= 2.*a\.shape=\(3,\)"),
    "matmul_b_not_array": (lambda: fj.matmul(z(2, 3), [[1.0]]), TypeError, r"b must be an array"),
    "matmul_int": (lambda: fj.matmul(i32(2, 3), z(3, 2)), TypeError, r"a\.dtype=int32"),
    "matmul_trans_flag": (lambda: fj.matmul(z(2, 3), z(3, 2), trans_a=1), TypeError, r"trans_a=1"),
    "matmul_alpha_bool": (lambda: fj.matmul(z(2, 3), z(3, 2), alpha=True),
        TypeError, r"alpha=True"),
    "matmul_alpha_vector": (lambda: fj.matmul(z(2, 3), z(3, 2), alpha=z(2)), TypeError, r"alpha"),
    "matmul_k": (lambda: fj.matmul(z(2, 3), z(4, 2)), ValueError, r"a\.shape=\(2, 3\).*K=3.*K=4"),
    "matmul_k_trans": (lambda: fj.matmul(z(3, 2), z(4, 2), trans_a=True, trans_b=True),
        ValueError, r"trans_a=True.*K=3.*K=2"),
    "matmul_batch": (lambda: fj.matmul(z(2, 3, 4), z(5, 4, 2)),
        ValueError, r"batch dimensions.*\(2, 3, 4\).*\(5, 4, 2\)"),
    "matmul_c_shape": (lambda: fj.matmul(z(2, 3), z(3, 4), beta=1.0, c=z(3, 4)),
        ValueError, r"c\.shape=\(3, 4\).*|\(2, 4\).*c\.shape"),
    "matmul_c_ignored": (lambda: fj.matmul(z(2, 3), z(3, 4), c=z(2, 4)), ValueError, r"beta=0\.0"),
    "matmul_beta_no_c": (lambda: fj.matmul(z(2, 3), z(3, 4), beta=2.0),
        ValueError, r"beta=2\.0 needs c"),
    "matmul_c_int": (lambda: fj.matmul(z(2, 3), z(3, 4), beta=1.0, c=i32(2, 4)),
        TypeError, r"c\.dtype=int32"),
    "matmul_out_dtype_int": (lambda: fj.matmul(z(2, 3), z(3, 4), out_dtype=jnp.int32),
        TypeError, r"out_dtype"),
    "matmul_out_dtype_junk": (lambda: fj.matmul(z(2, 3), z(3, 4),
                                                        out_dtype="nope"),
        TypeError, r"out_dtype='nope'"),
    "matmul_mixed_dtypes": (lambda: fj.matmul(z(2, 3, dtype=jnp.bfloat16),
                                              z(3, 4, dtype=jnp.float16)),
        TypeError, r"a\.dtype=.*bfloat16.*b\.dtype=.*float16.*out_dtype"),
    # rms_norm
    "rms_x_scalar": (lambda: fj.rms_norm(z(), z(1)), ValueError, r"x must have rank >= 1"),
    "rms_weight_rank": (lambda: fj.rms_norm(z(2, 4), z(1, 4)),
        ValueError, r"weight must have rank 1.*weight\.shape=\(1, 4\)"),
    "rms_weight_len": (lambda: fj.rms_norm(z(2, 4), z(5)),
        ValueError, r"weight\.shape=\(5,\).*x\.shape=\(2, 4\)"),
    "rms_eps_zero": (lambda: fj.rms_norm(z(2, 4), z(4), eps=0.0), ValueError, r"eps=0\.0"),
    "rms_eps_nan": (lambda: fj.rms_norm(z(2, 4), z(4), eps=float("nan")), ValueError, r"eps=nan"),
    "rms_eps_str": (lambda: fj.rms_norm(z(2, 4), z(4), eps="1e-6"), TypeError, r"eps='1e-6'"),
    "rms_residual_shape": (lambda: fj.rms_norm(z(2, 4), z(4), residual=z(1, 4)),
        ValueError, r"residual\.shape=\(1, 4\).*x\.shape=\(2, 4\)"),
    "rms_residual_int": (lambda: fj.rms_norm(z(2, 4), z(4), residual=i32(2, 4)),
        TypeError, r"residual\.dtype=int32"),
    "rms_x_int": (lambda: fj.rms_norm(i32(2, 4), z(4)), TypeError, r"x\.dtype=int32"),
    # silu_mul
    "silu_shape": (lambda: fj.silu_mul(z(2, 4), z(4)),
        ValueError, r"gate\.shape=\(2, 4\).*up\.shape=\(4,\)"),
    "silu_dtype": (lambda: fj.silu_mul(z(4), z(4, dtype=jnp.bfloat16)),
        TypeError, r"gate\.dtype=.*up\.dtype="),
    "silu_int": (lambda: fj.silu_mul(i32(4), i32(4)), TypeError, r"gate\.dtype=int32"),
    # softmax
    "softmax_axis_range": (lambda: fj.softmax(z(2, 3), axis=2), ValueError, r"axis=2"),
    "softmax_axis_bool": (lambda: fj.softmax(z(2, 3), axis=True), ValueError, r"axis=True"),
    "softmax_axis_float": (lambda: fj.softmax(z(2, 3), axis=1.0), ValueError, r"axis=1\.0"),
    "softmax_scalar": (lambda: fj.softmax(z()), ValueError, r"x must have rank >= 1"),
    "softmax_where_dtype": (lambda: fj.softmax(z(2, 3), where=i32(2, 3)),
        TypeError, r"where\.dtype=int32"),
    "softmax_where_shape": (lambda: fj.softmax(z(2, 3), where=z(2, 1, dtype=bool).reshape(2, 1, 1)),
        ValueError, r"where\.shape=\(2, 1, 1\).*x\.shape=\(2, 3\)"),
    "softmax_where_no_broadcast": (lambda: fj.softmax(z(2, 3), where=z(4, dtype=bool)),
        ValueError, r"where\.shape=\(4,\)"),
    # rope
    "rope_x_rank": (lambda: fj.rope(z(2, 3, 8), i32(2, 3)),
        ValueError, r"x must have rank 4.*x\.shape=\(2, 3, 8\)"),
    "rope_positions_float": (lambda: fj.rope(z(2, 3, 1, 8), z(2, 3)),
        TypeError, r"positions\.dtype=float32"),
    "rope_positions_shape": (lambda: fj.rope(z(2, 3, 1, 8), i32(3, 2)),
        ValueError, r"positions\.shape=\(3, 2\)"),
    "rope_odd_head_dim": (lambda: fj.rope(z(2, 3, 1, 7), i32(2, 3)), ValueError, r"head_dim=7"),
    "rope_theta": (lambda: fj.rope(z(2, 3, 1, 8), i32(2, 3), theta=-1.0),
        ValueError, r"theta=-1\.0"),
    "rope_theta_array": (lambda: fj.rope(z(2, 3, 1, 8), i32(2, 3), theta=z()),
        TypeError, r"theta="),
    "rope_scaling_dict": (lambda: fj.rope(z(2, 3, 1, 8), i32(2, 3),
                                           scaling={"rope_type": "linear"}),
        TypeError, r"scaling="),
    "rope_interleaved": (lambda: fj.rope(z(2, 3, 1, 8), i32(2, 3), interleaved="yes"),
        TypeError, r"interleaved='yes'"),
    "cos_sin_head_dim_zero": (lambda: fj.rope_cos_sin(i32(3), 0), ValueError, r"head_dim=0"),
    "cos_sin_head_dim_odd": (lambda: fj.rope_cos_sin(i32(3), 9), ValueError, r"head_dim=9"),
    "cos_sin_head_dim_float": (lambda: fj.rope_cos_sin(i32(3), 8.0), ValueError, r"head_dim=8\.0"),
    "cos_sin_positions_float": (lambda: fj.rope_cos_sin(z(3), 8),
        TypeError, r"positions\.dtype=float32"),
    "scaling_kind": (lambda: fj.RopeScaling("su", 2.0), ValueError, r"kind='su'"),
    "scaling_factor": (lambda: fj.RopeScaling("linear", 0.0), ValueError, r"factor=0\.0"),
    "scaling_llama3_order": (lambda: fj.RopeScaling("llama3", 8.0, low_freq_factor=4.0,
                                                            high_freq_factor=1.0),
        ValueError, r"high_freq_factor=1\.0.*low_freq_factor=4\.0"),
    "scaling_llama3_context": (lambda: fj.RopeScaling(
        "llama3", 8.0, original_max_position_embeddings=0),
        ValueError, r"original_max_position_embeddings=0"),
    "scaling_from_hf": (lambda: fj.RopeScaling.from_hf({"rope_type": "su", "factor": 2.0}),
        ValueError, r"unsupported rope type 'su'"),
    "scaling_from_hf_missing": (lambda: fj.RopeScaling.from_hf({"rope_type": "llama3",
                                                                 "factor": 8.0}),
        ValueError, r"llama3 rope scaling needs \['low_freq_factor'"),
    # attention
    "attn_q_rank": (lambda: fj.attention(z(2, 3, 8), KV, KV),
        ValueError, r"q must have rank 4.*q\.shape=\(2, 3, 8\)"),
    "attn_kv_shape": (lambda: fj.attention(Q, KV, z(2, 6, 2, 8)),
        ValueError, r"k\.shape=\(2, 5, 2, 8\).*v\.shape=\(2, 6, 2, 8\)"),
    "attn_batch": (lambda: fj.attention(Q, z(1, 5, 2, 8), z(1, 5, 2, 8)),
        ValueError, r"batch.*q\.shape=\(2, 3, 4, 8\).*k\.shape=\(1, 5, 2, 8\)"),
    "attn_head_dim": (lambda: fj.attention(Q, z(2, 5, 2, 4), z(2, 5, 2, 4)),
        ValueError, r"head_dim.*k\.shape=\(2, 5, 2, 4\)"),
    "attn_heads": (lambda: fj.attention(Q, z(2, 5, 3, 8), z(2, 5, 3, 8)),
        ValueError, r"q_heads \(4\).*kv_heads \(3\)"),
    "attn_int": (lambda: fj.attention(i32(2, 3, 4, 8), KV, KV), TypeError, r"q\.dtype=int32"),
    "attn_causal": (lambda: fj.attention(Q, KV, KV, causal=1), TypeError, r"causal=1"),
    "attn_positions_dtype": (lambda: fj.attention(Q, KV, KV, q_positions=z(2, 3)),
        TypeError, r"q_positions\.dtype=float32"),
    "attn_positions_shape": (lambda: fj.attention(Q, KV, KV, q_positions=i32(2, 5)),
        ValueError, r"q_positions\.shape=\(2, 5\)"),
    "attn_positions_rank": (lambda: fj.attention(Q, KV, KV, q_positions=i32(3)),
        ValueError, r"q_positions must have rank 2"),
    "attn_lengths_dtype": (lambda: fj.attention(Q, KV, KV, kv_lengths=z(2)),
        TypeError, r"kv_lengths\.dtype=float32"),
    "attn_lengths_shape": (lambda: fj.attention(Q, KV, KV, kv_lengths=i32(3)),
        ValueError, r"kv_lengths\.shape=\(3,\)"),
    "attn_window_zero": (lambda: fj.attention(Q, KV, KV, sliding_window=0),
        ValueError, r"sliding_window=0"),
    "attn_window_float": (lambda: fj.attention(Q, KV, KV, sliding_window=2.5),
        ValueError, r"sliding_window=2\.5"),
    "attn_cap": (lambda: fj.attention(Q, KV, KV, logits_soft_cap=-1.0),
        ValueError, r"logits_soft_cap=-1\.0"),
    "attn_cap_inf": (lambda: fj.attention(Q, KV, KV, logits_soft_cap=float("inf")),
        ValueError, r"logits_soft_cap=inf"),
    "attn_scale_str": (lambda: fj.attention(Q, KV, KV, scale="0.1"), TypeError, r"scale='0\.1'"),
    "attn_scale_vector": (lambda: fj.attention(Q, KV, KV, scale=z(2)), TypeError, r"scale="),
    "attn_scale_nan": (lambda: fj.attention(Q, KV, KV, scale=float("nan")),
        ValueError, r"scale must be a finite number .*scale=nan"),
    "attn_scale_inf": (lambda: fj.attention(Q, KV, KV, scale=-float("inf")),
        ValueError, r"scale=-inf"),
    "rope_negative_position": (lambda: fj.rope(z(2, 3, 1, 8), np.array([[0, 1, 2], [3, -1, 5]],
                                                                       np.int32)),
        ValueError, r"positions\[1, 1\]=-1 must be >= 0"),
    # embedding
    "emb_table_rank": (lambda: fj.embedding(z(4), i32(2)),
        ValueError, r"table must have rank 2.*table\.shape=\(4,\)"),
    "emb_ids_float": (lambda: fj.embedding(z(4, 3), z(2)), TypeError, r"ids\.dtype=float32"),
    "emb_ids_high": (lambda: fj.embedding(z(4, 3), jnp.asarray([0, 4])),
        ValueError, r"\[0, 4\).*max 4"),
    "emb_ids_negative": (lambda: fj.embedding(z(4, 3), np.array([-1, 2])), ValueError, r"min -1"),
    # dispatch arguments
    "implementation_type": (lambda: fj.silu_mul(z(2), z(2), implementation=1),
        TypeError, r"implementation=1"),
    "use_implementation_type": (lambda: fj.use_implementation(1).__enter__(), TypeError, r"name=1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises(case):
    assert_raises_as_listed(CASES[case])


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_attention_over_no_queries_is_empty(implementation):
    # As for an empty batch: [batch, 0, heads, head_dim], not an error from inside the op.
    k = jax.random.normal(jax.random.key(0), (2, 5, 2, 8), F32)
    for q in (z(2, 0, 4, 8), z(0, 3, 4, 8)):
        out = fj.attention(q, k[:q.shape[0]], k[:q.shape[0]], implementation=implementation)
        assert out.shape == q.shape and out.dtype == q.dtype


def test_a_traced_negative_position_is_caught_under_debug_checks():
    from jax.experimental import checkify

    f = jax.jit(checkify.checkify(lambda x, p: fj.rope(x, p), errors=checkify.user_checks))
    with fj.debug_checks():
        err, _ = f(z(1, 3, 1, 8), jnp.asarray([[0, -4, 2]], jnp.int32))
    with pytest.raises(Exception, match=r"positions \(flat index 1\)=-4 must be >= 0"):
        err.throw()


def test_validation_runs_before_tracing():
    # Under jit the error is the same ValueError, raised while tracing, naming the argument.
    @jax.jit
    def f(q, k, v):
        return fj.attention(q, k, v)

    with pytest.raises(ValueError, match=r"q_heads \(4\) must be a multiple of kv_heads \(3\)"):
        f(Q, z(2, 5, 3, 8), z(2, 5, 3, 8))


def test_explain_validates_like_the_op():
    with pytest.raises(ValueError, match=r"weight\.shape=\(5,\)"):
        fj.explain("rms_norm", z(2, 4), z(5))
    with pytest.raises(KeyError, match="unknown op"):
        fj.explain("not_an_op", z(2))


def test_no_silent_broadcast_of_wrong_shapes():
    # Shapes that jnp would happily broadcast are rejected, not broadcast into a result.
    with pytest.raises(ValueError, match="gate"):
        fj.silu_mul(z(3, 1), z(3, 4))
    with pytest.raises(ValueError, match="residual"):
        fj.rms_norm(z(3, 4), z(4), residual=z(1, 4))
    with pytest.raises(ValueError, match="weight"):
        fj.rms_norm(z(3, 4), z(1))


def test_rope_scaling_from_hf_formats():
    assert fj.RopeScaling.from_hf(None) is None
    assert fj.RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1e4}) is None
    # The pre-4.45 HF key "type" still works.
    assert fj.RopeScaling.from_hf({"type": "linear", "factor": 2.0}) == fj.RopeScaling(
        "linear", 2.0)


INT_DTYPES = ("int2", "int4", "int8", "int16", "int32", "int64",
              "uint2", "uint4", "uint8", "uint16", "uint32", "uint64")


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_embedding_ids_of_every_integer_dtype(dtype):
    # A vocabulary larger than 16-bit ids can count: every id a dtype can hold is valid, and
    # must be compared with the vocabulary size in a type that holds both (not the ids' own).
    vocab, dim = 70_000, 3
    dtype = np.dtype(getattr(jnp, dtype))
    gen = np.random.default_rng(abs(hash(dtype.name)) % 2**32)
    table = jnp.asarray(gen.standard_normal((vocab, dim)), F32)
    info = jnp.iinfo(dtype)
    top = min(int(info.max), vocab - 1)
    host = np.concatenate([gen.integers(0, top + 1, 13), [0, top]]).astype(dtype)
    expected = np.asarray(table)[host.astype(np.int64)]
    embed = jax.jit(fj.embedding)
    np.testing.assert_array_equal(np.asarray(fj.embedding(table, host)), expected)  # concrete
    np.testing.assert_array_equal(np.asarray(embed(table, jnp.asarray(host))), expected)
    bad = []
    if info.min < 0:
        bad.append(int(info.min))
    if info.max >= vocab:
        bad += [vocab, int(info.max)]
    for value in bad:
        ids = np.array([top, value, 0], dtype=object).astype(dtype)
        with pytest.raises(ValueError, match=rf"\[0, {vocab}\).*{'min' if value < 0 else 'max'} "
                                             rf"{value}"):
            fj.embedding(table, ids)
        traced = np.asarray(embed(table, jnp.asarray(ids)))
        # A traced id that is out of range gives NaN, never another row (x64 is off, so
        # 64-bit ids reach the jitted op as 32-bit ones; the largest wrap, still invalid).
        if jnp.asarray(ids).dtype.itemsize == dtype.itemsize or value == vocab:
            assert np.isnan(traced[1]).all(), (value, traced)
        np.testing.assert_array_equal(traced[[0, 2]], np.asarray(table)[[top, 0]])
