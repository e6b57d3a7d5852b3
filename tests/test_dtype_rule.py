"""The dtype rule of every op (stated in forge_jax/ops/__init__.py).

An op's compute inputs share one dtype, or it raises TypeError naming both dtypes; it
never promotes or rounds one silently, whatever ``jax_numpy_dtype_promotion`` says.
Parameters (rms_norm's weight, matmul's c) and KV caches (attention's k and v, the paged
pools) are storage: any float dtype, read into the float32 math, the result in the
compute dtype; k and v (and the two pools) still share one dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import attention_ref, f64, matmul_ref, rms_norm_ref, round_to

import forge_jax as fj

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
G = rng(22)


def arr(*shape, dtype=F32):
    return normal(G, shape, dtype)


POOL = (2, 6, 4, 8)  # [kv_heads, num_pages, page_size, head_dim]
TABLES = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
LENS = jnp.asarray([5, 8], jnp.int32)

# (op, positional arrays, keywords, the message's pattern)
REFUSED = {
    "rms_norm_residual_f32_x_bf16": (
        "rms_norm", (arr(3, 8, dtype=BF16), arr(8)), dict(residual=arr(3, 8)),
        r"x and residual must have the same dtype.*x\.dtype=bfloat16.*residual\.dtype=float32"),
    "rms_norm_residual_bf16_x_f32": (
        "rms_norm", (arr(3, 8), arr(8)), dict(residual=arr(3, 8, dtype=BF16)),
        r"x\.dtype=float32.*residual\.dtype=bfloat16"),
    "silu_mul": ("silu_mul", (arr(4), arr(4, dtype=BF16)), {},
                 r"gate and up must have the same dtype.*gate\.dtype=float32.*up\.dtype=bfloat16"),
    "matmul_with_out_dtype": (
        "matmul", (arr(2, 3, dtype=BF16), arr(3, 4)), dict(out_dtype=F32),
        r"a and b must have the same dtype.*a\.dtype=bfloat16.*b\.dtype=float32.*out_dtype"),
    "matmul_f16_bf16": ("matmul", (arr(2, 3, dtype=F16), arr(3, 4, dtype=BF16)), {},
                        r"a\.dtype=float16.*b\.dtype=bfloat16"),
    "attention_k_v": ("attention", (arr(1, 2, 2, 8), arr(1, 3, 2, 8), arr(1, 3, 2, 8, dtype=BF16)),
                      {}, r"k and v must have the same dtype.*k\.dtype=float32.*v\.dtype=bfloat16"),
    "paged_write_k_v": ("paged_write", (arr(*POOL), arr(*POOL), arr(2, 2, 8),
                                        arr(2, 2, 8, dtype=BF16), jnp.asarray([1, 9], jnp.int32)),
                        {}, r"k and v must.*k\.dtype=float32.*v\.dtype=bfloat16"),
    "paged_attention_pools": ("paged_attention", (arr(2, 4, 8), arr(*POOL), arr(*POOL, dtype=BF16),
                                                  TABLES, LENS), {},
                              r"k_pages\.dtype=float32.*v_pages\.dtype=bfloat16"),
    "ragged_pools": ("ragged_paged_attention",
                     (arr(2, 4, 8), arr(*POOL, dtype=BF16), arr(*POOL), TABLES, LENS,
                      jnp.asarray([0, 1, 2], jnp.int32), 2), {},
                     r"k_pages\.dtype=bfloat16.*v_pages\.dtype=float32"),
    "copy_pages_pools": ("copy_pages", (arr(*POOL), arr(*POOL, dtype=F16),
                                       jnp.asarray([[0, 1]], jnp.int32)), {},
                         r"k_pages\.dtype=float32.*v_pages\.dtype=float16"),
}


@pytest.mark.parametrize("promotion", ["strict", "standard"])
@pytest.mark.parametrize("name", list(REFUSED))
def test_mixed_compute_dtypes_are_refused_naming_both(name, promotion):
    op, args, kwargs, match = REFUSED[name]
    fn = getattr(fj, op)
    with jax.numpy_dtype_promotion(promotion):
        with pytest.raises(TypeError, match=match) as info:
            fn(*args, **kwargs)
        assert "\n" not in str(info.value)
        with pytest.raises(TypeError, match=match):  # at trace time, before any work
            jax.jit(lambda *a: fn(*a, **kwargs))(*args)
        with pytest.raises(TypeError, match=match):
            fj.explain(op, *args, **kwargs)


def test_rms_norm_weight_is_a_parameter_of_any_float_dtype():
    x = arr(3, 64, dtype=BF16)
    for w_dtype in (F32, BF16, F16):
        w = arr(64, dtype=w_dtype)
        out = fj.rms_norm(x, w, eps=1e-5)
        assert out.dtype == BF16
        assert_close(out, rms_norm_ref(x, w, eps=1e-5))
        y, h = fj.rms_norm(x, w, eps=1e-5, residual=arr(3, 64, dtype=BF16))
        assert y.dtype == h.dtype == BF16


def test_matmul_c_is_a_parameter_of_any_float_dtype():
    a, b, c = arr(4, 16, dtype=BF16), arr(16, 8, dtype=BF16), arr(4, 8)
    out = fj.matmul(a, b, beta=1.0, c=c, out_dtype=F32)
    assert out.dtype == F32
    assert_close(out, matmul_ref(a, b, beta=1.0, c=c))


@pytest.mark.parametrize("q_dtype,kv_dtype", [(F32, BF16), (BF16, F32)])
def test_attention_reads_a_cache_of_another_dtype(q_dtype, kv_dtype):
    q, k, v = arr(2, 3, 4, 16, dtype=q_dtype), arr(2, 7, 2, 16, dtype=kv_dtype), \
        arr(2, 7, 2, 16, dtype=kv_dtype)
    out = fj.attention(q, k, v)
    assert out.dtype == q_dtype
    assert_close(out, attention_ref(q, k, v), dtype=q_dtype)


def test_paged_ops_read_and_write_pools_of_another_dtype():
    rng_ = np.random.default_rng(5)
    pools = [jnp.asarray(rng_.standard_normal(POOL), BF16) for _ in range(2)]
    q = arr(2, 4, 8)
    out = fj.paged_attention(q, *pools, TABLES, LENS)
    assert out.dtype == F32
    rows = fj.ragged_paged_attention(q, *pools, TABLES, LENS,
                                     jnp.asarray([0, 1, 2], jnp.int32), 2)
    assert rows.dtype == F32
    np.testing.assert_allclose(f64(rows), f64(out), rtol=2e-5, atol=2e-5)
    k = arr(2, 2, 8)
    new_k, new_v = fj.paged_write(*pools, k, -k, jnp.asarray([1, 9], jnp.int32))
    assert new_k.dtype == new_v.dtype == BF16  # a store into the cache's storage dtype
    np.testing.assert_array_equal(f64(new_k[:, 0, 1]), round_to(k[0], BF16))


def test_single_float_input_ops_keep_their_dtype():
    """rope, embedding, softmax: one float input, whose dtype the result keeps; their
    index arguments must be integers."""
    x = arr(2, 3, 2, 8, dtype=BF16)
    positions = jnp.asarray([[0, 1, 2], [5, 6, 7]], jnp.int32)
    assert fj.rope(x, positions).dtype == BF16
    with pytest.raises(TypeError, match=r"positions\.dtype=float32"):
        fj.rope(x, positions.astype(F32))
    table = arr(10, 4, dtype=F16)
    assert fj.embedding(table, jnp.asarray([1, 2], jnp.int32)).dtype == F16
    with pytest.raises(TypeError, match=r"ids\.dtype=float32"):
        fj.embedding(table, jnp.asarray([1.0, 2.0], F32))
    assert fj.softmax(arr(3, 5, dtype=BF16)).dtype == BF16
