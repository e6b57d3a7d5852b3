"""Gradients of every differentiable op under ``jax.grad`` against the float64 references.

The reference gradient is a central finite difference of the float64 NumPy reference
(tests/cases/references.py), which shares no code with forge_jax. For a random cotangent
``C`` and loss ``L(x) = sum(op(x) * C)``, each check compares the directional
derivative ``<grad L, D>`` from ``jax.grad`` (float32) with
``(L_ref(x + eps D) - L_ref(x - eps D)) / (2 eps)`` along a few random directions ``D``.
The error budget is the float32 tolerance scaled up, relative to ``sum |grad * D|``
(the scale of the float32 rounding in the dot product).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.inputs import normal, rng
from cases.references import (
    attention_ref,
    embedding_ref,
    f64,
    matmul_ref,
    rms_norm_ref,
    rope_ref,
    silu_mul_ref,
    softmax_ref,
)

import forge_jax as fj
from forge_jax import tolerances

EPS = 1e-6
TOL = tolerances.scaled(tolerances.tolerance(jnp.float32), 10)


def check_grads(fn, ref_fn, args, *, seed, n_dirs=3):
    """Directional derivatives of ``sum(fn(*args) * C)`` vs finite differences of ``ref_fn``.

    Returns the float32 gradients (for extra checks by the caller).
    """
    g = rng(seed)
    out = jax.jit(fn)(*args)
    cots = jax.tree.map(lambda o: g.standard_normal(o.shape).astype(np.float32), out)

    def loss(*a):
        leaves = zip(jax.tree.leaves(fn(*a)), jax.tree.leaves(cots), strict=True)
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in leaves)

    def loss_ref(*a):
        leaves = zip(jax.tree.leaves(ref_fn(*a)), jax.tree.leaves(cots), strict=True)
        return sum(float(np.sum(o * f64(c))) for o, c in leaves)

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    for a, gr in zip(args, grads, strict=True):
        assert gr.shape == a.shape and gr.dtype == a.dtype
        assert np.isfinite(f64(gr)).all()
    assert any(np.abs(f64(gr)).max() > 0 for gr in grads), "all gradients are zero"
    x64 = [f64(a) for a in args]
    for _ in range(n_dirs):
        dirs = [g.standard_normal(a.shape) for a in args]
        terms = [f64(gr) * d for gr, d in zip(grads, dirs, strict=True)]
        jvp = sum(float(t.sum()) for t in terms)
        scale = sum(float(np.abs(t).sum()) for t in terms)
        plus = loss_ref(*[x + EPS * d for x, d in zip(x64, dirs, strict=True)])
        minus = loss_ref(*[x - EPS * d for x, d in zip(x64, dirs, strict=True)])
        fd = (plus - minus) / (2 * EPS)
        assert abs(jvp - fd) <= TOL.atol + TOL.rtol * max(scale, 1.0), (jvp, fd, scale)
    return grads


@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_grad(trans_b):
    g = rng(30)
    a = normal(g, (2, 5, 7))
    b = normal(g, (3, 7) if trans_b else (7, 3))  # broadcast over a's batch
    c = normal(g, (5, 3))
    check_grads(
        lambda a, b, c: fj.matmul(a, b, trans_b=trans_b, alpha=0.7, beta=-1.3, c=c),
        lambda a, b, c: matmul_ref(a, b, trans_b=trans_b, alpha=0.7, beta=-1.3, c=c),
        (a, b, c), seed=31)


def test_matmul_grad_wrt_alpha():
    g = rng(32)
    a, b = normal(g, (4, 6)), normal(g, (6, 2))
    alpha = jnp.asarray(0.8, jnp.float32)
    check_grads(lambda a, b, al: fj.matmul(a, b, alpha=al),
                lambda a, b, al: float(al) * matmul_ref(a, b), (a, b, alpha), seed=33)


def test_rms_norm_grad():
    g = rng(34)
    x, w = normal(g, (3, 16), scale=2.0), normal(g, (16,))
    check_grads(lambda x, w: fj.rms_norm(x, w, eps=1e-5),
                lambda x, w: rms_norm_ref(x, w, eps=1e-5), (x, w), seed=35)


def test_rms_norm_residual_grad():
    g = rng(36)
    x, r, w = normal(g, (2, 3, 8)), normal(g, (2, 3, 8)), normal(g, (8,))
    check_grads(lambda x, r, w: fj.rms_norm(x, w, residual=r),
                lambda x, r, w: rms_norm_ref(x, w, residual=r), (x, r, w), seed=37)


def test_silu_mul_grad():
    g = rng(38)
    gate, up = normal(g, (4, 9), scale=3.0), normal(g, (4, 9))
    check_grads(fj.silu_mul, silu_mul_ref, (gate, up), seed=39)


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_grad_with_mask_and_fully_masked_rows(axis):
    g = rng(40)
    x = normal(g, (5, 6), scale=2.0)
    where = g.random((5, 6)) < 0.6
    where[2, :] = False  # a fully masked row
    where[:, 3] = False  # a fully masked column
    grads = check_grads(lambda x: fj.softmax(x, axis=axis, where=jnp.asarray(where)),
                        lambda x: softmax_ref(x, axis=axis, where=where), (x,), seed=41)
    # Masked entries get no gradient (and none is NaN).
    np.testing.assert_array_equal(f64(grads[0])[~where], 0.0)


def test_softmax_grad_with_neg_inf_entries():
    x = jnp.asarray(np.array([[0.5, -np.inf, 1.5, -0.3], [-np.inf] * 4], np.float32))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(fj.softmax(x) * jnp.arange(4.0))))(x)
    assert np.isfinite(f64(grad)).all()
    np.testing.assert_array_equal(f64(grad)[:, 1], 0.0)
    np.testing.assert_array_equal(f64(grad)[1], 0.0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_grad(interleaved):
    g = rng(42)
    x = normal(g, (2, 3, 2, 8))
    pos = g.integers(0, 50, (2, 3)).astype(np.int32)
    scaling = fj.RopeScaling("linear", 2.0)
    check_grads(
        lambda x: fj.rope(x, jnp.asarray(pos), scaling=scaling, interleaved=interleaved),
        lambda x: rope_ref(x, pos, scaling=scaling, interleaved=interleaved), (x,), seed=43)


ATTENTION_GRAD_CASES = {
    "causal_gqa": dict(),
    "non_causal_mqa": dict(causal=False),
    "everything": dict(q_positions=np.array([[1, 3, 5], [-1, 2, 4]], np.int32),
                       kv_lengths=np.array([6, 5], np.int32), sliding_window=3,
                       logits_soft_cap=4.0, scale=0.6),
}


@pytest.mark.parametrize("case", list(ATTENTION_GRAD_CASES))
def test_attention_grad(case):
    kw = ATTENTION_GRAD_CASES[case]
    kv_heads = 1 if case == "non_causal_mqa" else 2
    g = rng(44, len(case))
    q = normal(g, (2, 3, 4, 8), scale=1.5)
    k, v = normal(g, (2, 6, kv_heads, 8), scale=1.5), normal(g, (2, 6, kv_heads, 8))
    jkw = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    grads = check_grads(lambda q, k, v: fj.attention(q, k, v, **jkw),
                        lambda q, k, v: attention_ref(q, k, v, **kw), (q, k, v), seed=45)
    if case == "everything":
        # Query 0 of batch 1 sits at position -1 and sees no key: zero output, zero gradient.
        np.testing.assert_array_equal(f64(grads[0])[1, 0], 0.0)


def test_attention_grad_fully_masked_batch_is_finite():
    g = rng(46)
    q, k, v = normal(g, (2, 2, 2, 4)), normal(g, (2, 3, 1, 4)), normal(g, (2, 3, 1, 4))
    lengths = jnp.asarray([0, 3], jnp.int32)
    grads = check_grads(lambda q, k, v: fj.attention(q, k, v, kv_lengths=lengths),
                        lambda q, k, v: attention_ref(q, k, v, kv_lengths=np.array([0, 3])),
                        (q, k, v), seed=47)
    for gr in grads:
        np.testing.assert_array_equal(f64(gr)[0], 0.0)


def test_embedding_grad():
    g = rng(48)
    table = normal(g, (7, 5))
    ids = np.array([[1, 3, 1], [6, 0, 1]], np.int32)  # repeated ids accumulate
    grads = check_grads(lambda t: fj.embedding(t, jnp.asarray(ids)),
                        lambda t: embedding_ref(t, ids), (table,), seed=49)
    np.testing.assert_array_equal(f64(grads[0])[[2, 4, 5]], 0.0)  # rows never looked up


def test_attention_grad_with_huge_logits_is_finite():
    g = rng(50)
    q, k, v = normal(g, (1, 3, 2, 4)), normal(g, (1, 5, 1, 4)), normal(g, (1, 5, 1, 4))
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fj.attention(q, k, v, scale=1e4)),
                             argnums=(0, 1, 2)))(q, k, v)
    for gr in grads:
        assert np.isfinite(f64(gr)).all()
