"""Mixture-of-experts routing and the expert layer: ``fj.moe_route`` (both families'
normalisations) against float64 loops, ``fj.moe_permute`` / ``fj.moe_unpermute`` as exact
inverses, and ``fj.moe`` against the dense per-token float64 layer, with experts no token
chooses, under jit and in gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.grouped_references import moe_ref, route_ref
from cases.inputs import normal, rng
from cases.references import f64

import forge_jax as fj

ROUTINGS = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]


@pytest.mark.parametrize("routing,renormalize", ROUTINGS)
def test_route_matches_float64(routing, renormalize):
    logits = normal(rng(1), (2, 7, 8), jnp.bfloat16, scale=2.0)
    logits = logits.at[0, 0, :].set(1.0)  # a tie: the lower experts win
    fn = jax.jit(functools.partial(fj.moe_route, top_k=3, routing=routing,
                                   renormalize=renormalize))
    weights, ids = fn(logits)
    want_w, want_ids = route_ref(logits, 3, routing=routing, renormalize=renormalize)
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(ids[0, 0], [0, 1, 2])
    assert_close(weights, want_w)


def test_mixtral_forms_agree():
    """Softmax, top-k, renormalise == top-k, softmax (Mixtral's two formulations)."""
    logits = normal(rng(2), (5, 8))
    a, b = jax.jit(lambda x: (fj.moe_route(x, 2, routing="softmax_topk", renormalize=True),
                              fj.moe_route(x, 2, routing="topk_softmax")))(logits)
    np.testing.assert_array_equal(a[1], b[1])
    assert_close(a[0], f64(b[0]))


def test_permute_and_unpermute_are_inverse():
    gen = rng(3)
    x = normal(gen, (6, 4))
    ids = jnp.asarray([[2, 0], [2, 1], [0, 2], [2, 0], [1, 2], [0, 1]], jnp.int32)
    xs, sizes, order = jax.jit(fj.moe_permute, static_argnums=2)(x, ids, 4)
    np.testing.assert_array_equal(sizes, [4, 3, 5, 0])
    flat = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(flat[np.asarray(order)], np.sort(flat, kind="stable"))
    np.testing.assert_array_equal(xs, np.asarray(x)[np.asarray(order) // 2])
    weights = normal(gen, (6, 2))
    out = fj.moe_unpermute(xs, order, weights)
    assert_close(out, f64(x) * f64(weights).sum(-1, keepdims=True))


def test_traced_expert_ids_out_of_range_sort_last():
    """Under jit an id outside [0, experts) joins no group: its copy is a zero row."""
    x = normal(rng(6), (3, 4))
    ids = jnp.asarray([[1, -1], [0, 5], [1, 0]], jnp.int32)
    xs, sizes, order = jax.jit(fj.moe_permute, static_argnums=2)(x, ids, 4)
    np.testing.assert_array_equal(sizes, [2, 2, 0, 0])
    np.testing.assert_array_equal(np.asarray(order)[4:], [1, 3])  # the two invalid entries
    w = normal(rng(7), (4, 4, 4))
    ys = jax.jit(fj.grouped_matmul)(xs, w, sizes)
    np.testing.assert_array_equal(np.asarray(ys)[4:], 0.0)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\), got "
                                         r"expert_ids\[0, 1\]=-1"):
        fj.moe_permute(x, ids, 4)


@pytest.mark.parametrize("routing,renormalize,dtype", [
    ("softmax_topk", True, jnp.float32), ("topk_softmax", False, jnp.float32),
    ("softmax_topk", False, jnp.bfloat16)])
def test_moe_matches_dense_per_token_float64(routing, renormalize, dtype):
    """8 experts, top 2 of 6 tokens: some experts get no token (their rows are empty
    groups of every grouped product)."""
    gen = rng(4)
    tokens, d, f, experts = 6, 32, 48, 8
    x = normal(gen, (tokens, d), dtype)
    logits = normal(gen, (tokens, experts), scale=3.0)
    w_gate, w_up = (normal(gen, (experts, d, f), dtype, scale=0.2) for _ in range(2))
    w_down = normal(gen, (experts, f, d), dtype, scale=0.2)
    fn = jax.jit(functools.partial(fj.moe, top_k=2, routing=routing, renormalize=renormalize))
    out = fn(x, logits, w_gate, w_up, w_down)
    weights, ids = route_ref(logits, 2, routing=routing, renormalize=renormalize)
    assert len(set(ids.reshape(-1))) < experts  # some experts are empty
    assert out.dtype == dtype
    ref = moe_ref(x, w_gate, w_up, w_down, weights, ids)
    # bfloat16: the gate/up and hidden products are rounded to bfloat16 on the way.
    assert_close(out, ref, factor=1 if dtype == jnp.float32 else 2)


def test_moe_grads_are_finite_and_match_float64_difference():
    """Gradients of the layer wrt x and the expert weights: finite, zero for experts no
    token chose, and matching central differences of the float64 reference."""
    gen = rng(5)
    tokens, d, f, experts = 4, 8, 16, 6
    x = normal(gen, (tokens, d))
    logits = normal(gen, (tokens, experts), scale=3.0)
    w_gate, w_up, w_down = (normal(gen, s, scale=0.5) for s in
                            ((experts, d, f), (experts, d, f), (experts, f, d)))
    ct = normal(gen, (tokens, d))
    weights, ids = route_ref(logits, 2, renormalize=True)

    def loss(x, wg, wu, wd):
        return jnp.sum(fj.moe(x, logits, wg, wu, wd, 2, renormalize=True) * ct)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w_gate, w_up, w_down)
    unused = sorted(set(range(experts)) - set(ids.reshape(-1)))
    assert unused
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g)[unused], 0.0)
    args = [f64(a) for a in (x, w_gate, w_up, w_down)]

    def ref_loss(*a):
        return float(np.sum(moe_ref(*a, weights, ids) * f64(ct)))

    for i, g in enumerate(grads):
        assert np.isfinite(np.asarray(g)).all()
        for idx in list(zip(*np.nonzero(np.asarray(g)), strict=True))[:3]:
            up = [a.copy() for a in args]
            down = [a.copy() for a in args]
            up[i][idx] += 1e-5
            down[i][idx] -= 1e-5
            numeric = (ref_loss(*up) - ref_loss(*down)) / 2e-5
            np.testing.assert_allclose(float(g[idx]), numeric, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("call,error,match", [
    (lambda z: fj.moe_route(z((4, 8)), 9), ValueError, r"top_k must be <= .*=8, got top_k=9"),
    (lambda z: fj.moe_route(z((4, 8)), 2, routing="sparse"), ValueError, "routing must be"),
    (lambda z: fj.moe(z((4, 8)), z((4, 3)), z((3, 8, 5)), z((3, 8, 5)), z((3, 8, 5)), 1),
     ValueError, r"w_down must be \(3, 5, 8\)"),
    (lambda z: fj.moe_permute(z((4, 8)), jnp.zeros((3, 2), jnp.int32), 4), ValueError,
     r"expert_ids.shape=\(3, 2\)"),
])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match) as info:
        call(lambda shape: jnp.ones(shape, jnp.float32))
    assert "\n" not in str(info.value)
