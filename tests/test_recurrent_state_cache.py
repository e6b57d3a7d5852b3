"""The recurrent-state pool of linear-attention layers and the hybrid cache
(``forge_jax.kv_cache.recurrent``), driven through the gated delta-rule ops and checked
against float64 references of whole sequences."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.gated_delta_references import causal_conv1d_ref, gated_delta_ref

import forge_jax as fj
from forge_jax.kv_cache import (
    PREFIX_CACHING_REFUSED,
    ContiguousKVCache,
    HybridCache,
    KVCache,
    RecurrentStatePool,
    StateCache,
)

K_HEADS, V_HEADS, DK, DV, KERNEL = 2, 4, 8, 8, 4
CONV_DIM = 2 * K_HEADS * DK + V_HEADS * DV


def sequences(seed, n, seq):
    """Per sequence: conv input, conv weight (shared), q/k/v source, gates."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, seq, CONV_DIM)).astype(np.float32)
    g = (-np.abs(r.standard_normal((n, seq, V_HEADS))) * 0.2).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.standard_normal((n, seq, V_HEADS))))).astype(np.float32)
    return x, g, beta


W = np.random.default_rng(99).standard_normal((KERNEL, CONV_DIM)).astype(np.float32)


def split_qkv(mixed):
    """[b, t, conv_dim] -> q, k [b, t, K_HEADS, DK], v [b, t, V_HEADS, DV]."""
    b, t = mixed.shape[:2]
    q, k, v = (mixed[..., :K_HEADS * DK], mixed[..., K_HEADS * DK:2 * K_HEADS * DK],
               mixed[..., 2 * K_HEADS * DK:])
    return (q.reshape(b, t, K_HEADS, DK), k.reshape(b, t, K_HEADS, DK),
            v.reshape(b, t, V_HEADS, DV))


def linear_layer(cache, layer, x, g, beta, lengths):
    """One gated delta-rule layer's state handling, as a model does it."""
    conv_state, state = cache.read(layer)
    mixed, conv_state = fj.causal_conv1d(x, jnp.asarray(W), state=conv_state, lengths=lengths)
    out, state = fj.gated_delta_rule(*split_qkv(mixed), g, beta, state=state, lengths=lengths,
                                     chunk_size=4)
    return cache.write_state(layer, conv_state, state), out


def reference(x, g, beta):
    mixed, _ = causal_conv1d_ref(x, W)
    return gated_delta_ref(*split_qkv(mixed), g, beta)


def new_pool(**kw):
    return RecurrentStatePool.create(num_layers=2, num_slots=3, conv_kernel=KERNEL,
                                     conv_dim=CONV_DIM, v_heads=V_HEADS, k_head_dim=DK,
                                     v_head_dim=DV, **kw)


def test_pool_carries_states_of_sequences_in_their_slots():
    pool = new_pool(batch=3)
    assert isinstance(pool, StateCache) and pool.num_slots == 3 and pool.batch == 3
    assert pool.bytes_per_sequence == 2 * 4 * (3 * CONV_DIM + V_HEADS * DK * DV)
    x, g, beta = sequences(0, 2, 15)
    ref_out, ref_s = reference(x, g, beta)
    # Rows 0 and 1 on slots 2 and 0, row 2 idle; prefill 9 tokens (row 1: 6), then decode.
    pool = pool.with_slots(jnp.asarray([2, 0, -1]))
    step = jax.jit(functools.partial(linear_layer, layer=1), donate_argnames=("cache",))
    lens = np.array([9, 6, 0])
    pad = lambda a: np.concatenate([a, np.zeros((1,) + a.shape[1:], a.dtype)])  # noqa: E731
    xs, gs, bs = pad(x), pad(g), pad(beta)
    prefill = [jnp.asarray(np.where((np.arange(9)[None, :] < lens[:, None]).reshape(
        (3, 9) + (1,) * (a.ndim - 2)), a[:, :9], np.nan)) for a in (xs, gs, bs)]
    pool, out = step(pool, x=prefill[0], g=prefill[1], beta=prefill[2],
                     lengths=jnp.asarray(lens))
    outs = [[np.asarray(out[0, :9])], [np.asarray(out[1, :6])]]
    pos = lens.copy()
    for _ in range(6):
        take = lambda a: jnp.asarray(np.stack([a[0, pos[0]:pos[0] + 1],  # noqa: E731
                                               a[1, pos[1]:pos[1] + 1], a[2, :1]]))
        pool, out = step(pool, x=take(xs), g=take(gs), beta=take(bs),
                         lengths=jnp.asarray([1, 1, 0]))
        outs[0].append(np.asarray(out[0]))
        outs[1].append(np.asarray(out[1]))
        pos[:2] += 1
    assert_close(np.concatenate(outs[0])[:15], ref_out[0], factor=5)
    assert_close(np.concatenate(outs[1]), ref_out[1, :12], factor=5)
    assert_close(pool.state[1][2], ref_s[0], factor=5)
    # Layer 0 and the idle row wrote nothing.
    assert not np.asarray(pool.state[0]).any() and not np.asarray(pool.state[1][1]).any()
    conv, state = pool.read(1)
    assert not np.asarray(state[2]).any() and not np.asarray(conv[2]).any()
    np.testing.assert_array_equal(np.asarray(state[0]), np.asarray(pool.state[1][2]))


def test_reset_clears_only_the_given_slots():
    pool = new_pool()
    ones = jnp.ones((3, V_HEADS, DK, DV))
    pool = pool.write_state(0, jnp.ones((3, KERNEL - 1, CONV_DIM)), ones)
    pool = pool.reset(jnp.asarray([1, -1]))
    s = np.asarray(pool.state[0])
    assert not s[1].any() and (s[[0, 2]] == 1).all()
    assert not np.asarray(pool.conv[0][1]).any()


@pytest.mark.parametrize("slots,match", [
    ([0, 3], r"slots\[1\]=3 must be -1 \(idle\) or in \[0, 3\)"),
    ([1, 1], "must not repeat a slot"),
    ([-2], r"slots\[0\]=-2"),
])
def test_pool_rejects_bad_slots(slots, match):
    with pytest.raises(ValueError, match=match):
        new_pool().with_slots(np.asarray(slots, np.int32))


def test_pool_rejects_states_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"state must be \[batch, ...\] = \(3, 4, 8, 8\)"):
        new_pool().write_state(0, jnp.zeros((3, KERNEL - 1, CONV_DIM)), jnp.zeros((3, 4, 8, 4)))


def hybrid(batch=2):
    kinds = ("linear", "linear", "linear", "attention")
    att = ContiguousKVCache.create(num_layers=1, batch=batch, max_len=16, kv_heads=2,
                                   head_dim=8)
    lin = RecurrentStatePool.create(num_layers=3, num_slots=batch, conv_kernel=KERNEL,
                                    conv_dim=CONV_DIM, v_heads=V_HEADS, k_head_dim=DK,
                                    v_head_dim=DV)
    return HybridCache(att, lin, kinds)


def test_hybrid_cache_routes_each_layer_to_its_cache():
    cache = hybrid()
    assert isinstance(cache, KVCache) and isinstance(cache, StateCache)
    assert cache.prefix_caching_refused == PREFIX_CACHING_REFUSED
    r = np.random.default_rng(3)
    k, v, q = (jnp.asarray(r.standard_normal((2, 5, n, 8)), jnp.float32) for n in (2, 2, 4))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    valid = jnp.ones((2, 5), bool)
    x, g, beta = sequences(4, 2, 5)

    @jax.jit
    def step(cache):
        cache, lin_out = linear_layer(cache, 2, jnp.asarray(x), jnp.asarray(g),
                                      jnp.asarray(beta), None)
        cache = cache.write(3, k, v, pos, valid)
        att = cache.attend(3, q, q_positions=pos, kv_lengths=jnp.asarray([5, 5]))
        return cache.with_lengths(jnp.asarray([5, 5])), lin_out, att

    cache, lin_out, att = step(cache)
    assert_close(lin_out, reference(x, g, beta)[0], factor=5)
    direct = fj.attention(q, k, v)
    assert_close(att, np.asarray(direct, np.float64), factor=2)
    np.testing.assert_array_equal(np.asarray(cache.attention.k[0][:, :5]), np.asarray(k))
    assert cache.lengths.tolist() == [5, 5] and cache.linear.lengths.tolist() == [5, 5]
    assert not np.asarray(cache.linear.state[0]).any() and np.asarray(cache.linear.state[2]).any()


def test_hybrid_cache_refuses_the_wrong_kind_of_layer():
    cache = hybrid()
    with pytest.raises(ValueError, match="layer 0 is of kind 'linear', not 'attention'"):
        cache.attend(0, jnp.zeros((2, 1, 4, 8)), q_positions=jnp.zeros((2, 1), jnp.int32),
                     kv_lengths=jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="layer 3 is of kind 'attention', not 'linear'"):
        cache.read(3)
    with pytest.raises(ValueError, match="kinds name 2 linear layers"):
        HybridCache(cache.attention, cache.linear, ("linear", "linear", "attention"))
