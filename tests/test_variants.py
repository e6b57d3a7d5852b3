"""Every op under chex's execution variants (cases/variants.py): jit, eager, committed device
arrays, host (NumPy) arrays and pmap over the 8 CPU devices that conftest.py creates.

Each variant's result is checked against the float64 reference with the project
tolerance, so all variants agree with each other within it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import variants
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import (
    attention_ref,
    embedding_ref,
    matmul_ref,
    rms_norm_ref,
    rope_cos_sin_ref,
    rope_ref,
    silu_mul_ref,
    softmax_ref,
)

import forge_jax as fj


class TestOpVariants:
    @pytest.fixture(autouse=True)
    def _eight_cpu_devices(self):
        chex.assert_devices_available(8, "cpu")

    @variants.all_variants
    def test_matmul(self, variant):
        g = rng(50)
        a, b, c = normal(g, (2, 5, 6)), normal(g, (4, 6)), normal(g, (5, 4))
        fn = variant(lambda a, b, c: fj.matmul(a, b, trans_b=True, beta=0.5, c=c))
        assert_close(fn(a, b, c), matmul_ref(a, b, trans_b=True, beta=0.5, c=c))

    @variants.all_variants
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_rms_norm(self, variant, dtype):
        g = rng(51)
        x, r, w = normal(g, (3, 32), dtype), normal(g, (3, 32), dtype), normal(g, (32,), dtype)
        y, h = variant(lambda x, r, w: fj.rms_norm(x, w, residual=r))(x, r, w)
        y_ref, h_ref = rms_norm_ref(x, w, residual=r, h_dtype=dtype)
        assert_close(y, y_ref)
        assert_close(h, h_ref)

    @variants.all_variants
    def test_silu_mul(self, variant):
        g = rng(52)
        gate, up = normal(g, (4, 10), scale=3.0), normal(g, (4, 10))
        assert_close(variant(fj.silu_mul)(gate, up), silu_mul_ref(gate, up))

    @variants.all_variants
    def test_softmax(self, variant):
        g = rng(53)
        x = normal(g, (4, 7), scale=3.0)
        where = g.random((4, 7)) < 0.5
        where[2] = False
        out = variant(lambda x, m: fj.softmax(x, where=m))(x, jnp.asarray(where))
        assert_close(out, softmax_ref(x, where=where))
        np.testing.assert_array_equal(np.asarray(out)[2], 0.0)

    @variants.all_variants
    @pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
    def test_rope(self, variant, interleaved):
        g = rng(54)
        x = normal(g, (2, 5, 3, 16))
        pos = jnp.asarray(g.integers(0, 60, (2, 5)), jnp.int32)
        scaling = fj.RopeScaling("llama3", 8.0, original_max_position_embeddings=64)
        fn = variant(
            lambda x, p: fj.rope(x, p, scaling=scaling, interleaved=interleaved))
        assert_close(fn(x, pos), rope_ref(x, pos, scaling=scaling, interleaved=interleaved))

    @variants.all_variants
    def test_rope_cos_sin(self, variant):
        pos = jnp.asarray(rng(55).integers(0, 60, (3, 4)), jnp.int32)
        cos, sin = variant(lambda p: fj.rope_cos_sin(p, 16, theta=1000.0))(pos)
        cos_ref, sin_ref = rope_cos_sin_ref(pos, 16, theta=1000.0)
        assert_close(cos, cos_ref)
        assert_close(sin, sin_ref)

    @variants.all_variants
    @pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
    def test_attention(self, variant, kv_heads):
        g = rng(56, kv_heads)
        q, k, v = normal(g, (2, 3, 4, 8)), normal(g, (2, 6, kv_heads, 8)), normal(
            g, (2, 6, kv_heads, 8))
        lengths = np.array([6, 4], np.int32)
        fn = variant(lambda q, k, v, n: fj.attention(q, k, v, kv_lengths=n,
                                                          sliding_window=4))
        out = fn(q, k, v, jnp.asarray(lengths))
        assert_close(out, attention_ref(q, k, v, kv_lengths=lengths, sliding_window=4))

    @variants.all_variants
    def test_embedding(self, variant):
        g = rng(57)
        table = normal(g, (9, 4))
        ids = jnp.asarray(g.integers(0, 9, (2, 3)), jnp.int32)
        out = variant(fj.embedding)(table, ids)
        np.testing.assert_array_equal(np.asarray(out, np.float64), embedding_ref(table, ids))

    def test_pmap_sharded_inputs(self):
        # A genuinely sharded pmap (different data per device), not the broadcast default.
        g = rng(58)
        x, w = normal(g, (8, 2, 16)), normal(g, (16,))
        fn = variants.with_pmap(lambda x: fj.rms_norm(x, w), broadcast_args_to_devices=False,
                                reduce_fn=None)
        out = fn(x)
        chex.assert_shape(out, (8, 2, 16))
        assert_close(out, rms_norm_ref(x, w))


def test_vmap_matches_batched_call():
    g = rng(59)
    q, k, v = normal(g, (3, 2, 4, 4, 8)), normal(g, (3, 2, 5, 2, 8)), normal(g, (3, 2, 5, 2, 8))
    out = jax.jit(jax.vmap(fj.attention))(q, k, v)
    ref = np.stack([attention_ref(q[i], k[i], v[i]) for i in range(3)])
    assert_close(out, ref)


def test_vmap_rms_norm_residual_and_rope():
    g = rng(63)
    x, r, w = normal(g, (3, 2, 16)), normal(g, (3, 2, 16)), normal(g, (16,))
    y, h = jax.jit(jax.vmap(lambda x, r: fj.rms_norm(x, w, residual=r)))(x, r)
    y_ref, h_ref = rms_norm_ref(x, w, residual=r, h_dtype=jnp.float32)
    assert_close(y, y_ref)
    assert_close(h, h_ref)
    xr = normal(g, (3, 1, 4, 2, 8))
    pos = jnp.asarray(g.integers(0, 50, (3, 1, 4)), jnp.int32)
    out = jax.jit(jax.vmap(lambda x, p: fj.rope(x, p, interleaved=True)))(xr, pos)
    ref = np.stack([rope_ref(xr[i], pos[i], interleaved=True) for i in range(3)])
    assert_close(out, ref)


def test_cpu_results_are_bitwise_reproducible():
    # The determinism policy in forge_jax/tolerances.py: same program, same inputs, same bits.
    g = rng(64)
    q, k, v = normal(g, (2, 5, 4, 8)), normal(g, (2, 5, 2, 8)), normal(g, (2, 5, 2, 8))
    f = jax.jit(lambda q, k, v: fj.attention(q, k, v, logits_soft_cap=5.0))
    np.testing.assert_array_equal(np.asarray(f(q, k, v)), np.asarray(f(q, k, v)))
    a, b = normal(g, (7, 33)), normal(g, (33, 5))
    np.testing.assert_array_equal(np.asarray(fj.matmul(a, b)), np.asarray(fj.matmul(a, b)))
