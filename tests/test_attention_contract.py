"""The attention contract (docstring of ``forge_jax.ops.attention``), dense and paged alike.

* Bottom-right alignment per sequence: with ``kv_lengths``, ``p = kv_lengths[b] - q_len + t``.
* Keys a query may not see never influence its output, whatever they hold (NaN, inf).
* NaN that the caller put into visible data propagates; ``-inf`` logits hide a key.
* Degenerate shapes are refused with a ValueError naming the argument.

Dense and paged attention run on the same keys and values (the paged pool holds the
dense rows in shuffled pages); every slot a query must not see holds NaN or inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import poison_unseen
from cases.paged import pages_from_dense
from cases.references import attention_mask_ref, attention_ref, softmax_ref

import forge_jax as fj

gen = np.random.default_rng(20261122)
PAGE = 4


def _case(batch, kv_len, q_len, q_heads, kv_heads, head_dim, lengths, dtype=jnp.float32):
    q = gen.standard_normal((batch, q_len, q_heads, head_dim)).astype(np.float32)
    k = gen.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
    v = gen.standard_normal((batch, kv_len, kv_heads, head_dim)).astype(np.float32)
    return q, k, v, np.asarray(lengths, np.int32), dtype


MASKINGS = {
    "decode": dict(q_len=1),
    "chunked_prefill": dict(q_len=5),
    "sliding_window": dict(q_len=3, sliding_window=4),
    "soft_cap": dict(q_len=2, logits_soft_cap=5.0),
    "window_and_cap_decode": dict(q_len=1, sliding_window=3, logits_soft_cap=3.0),
    # Explicit positions (a query may sit before its sequence's end: later keys are hidden).
    "explicit_positions": dict(q_len=2, q_positions=np.array([[5, 13], [2, 8], [0, 6]]),
                               sliding_window=6),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(MASKINGS))
def test_dense_and_paged_agree_with_nan_in_every_invisible_slot(name, dtype):
    opts = dict(MASKINGS[name])
    q_len = opts.pop("q_len")
    batch, kv_len, q_heads, kv_heads, d = 3, 14, 8, 2, 16
    lengths = np.array([14, 9, q_len + 2], np.int32)  # ends inside pages, short sequences
    q, k, v, lengths, _ = _case(batch, kv_len, q_len, q_heads, kv_heads, d, lengths)
    mask = attention_mask_ref(batch, q_len, kv_len, kv_lengths=lengths,
                              q_positions=opts.get("q_positions"),
                              sliding_window=opts.get("sliding_window"))
    if "q_positions" in opts:
        opts["q_positions"] = jnp.asarray(opts["q_positions"], jnp.int32)
    k, v = poison_unseen(k, v, mask, gen=gen)  # NaN / inf
    qd, kd, vd = (jnp.asarray(a, dtype) for a in (q, k, v))
    ref = attention_ref(qd, kd, vd, kv_lengths=lengths, **opts)  # from the rounded inputs
    assert np.isfinite(ref).all()
    dense = jax.jit(lambda q, k, v, n: fj.attention(q, k, v, kv_lengths=n, **opts))(
        qd, kd, vd, jnp.asarray(lengths))
    k_pages, v_pages, tables = pages_from_dense(gen, np.asarray(kd.astype(jnp.float32)),
                                                np.asarray(vd.astype(jnp.float32)),
                                                num_pages=16, page_size=PAGE)
    paged_q = qd[:, 0] if q_len == 1 else qd
    paged = jax.jit(lambda q, kp, vp, t, n: fj.paged_attention(q, kp, vp, t, n, **opts))(
        paged_q, jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(tables),
        jnp.asarray(lengths))
    if q_len == 1:
        paged = paged[:, None]
    assert_close(dense, ref, err_msg=name)
    assert_close(paged, ref, err_msg=name)
    assert_close(paged, np.asarray(dense, np.float64), err_msg=name)


def test_kv_lengths_align_each_sequence_to_its_own_end():
    # A decode query with kv_lengths sees its sequence's whole length: the old alignment to
    # the buffer's end placed it at kv_len - 1 for every sequence.
    q, k, v, lengths, _ = _case(2, 10, 2, 4, 2, 8, [10, 6])
    out = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                  kv_lengths=jnp.asarray(lengths)))
    pos = lengths[:, None] - 2 + np.arange(2)[None, :]  # [[8, 9], [4, 5]]
    explicit = attention_ref(q, k, v, kv_lengths=lengths, q_positions=pos)
    assert_close(out, explicit)
    # Sequence 1's first query (position 4) must not see key 5; its second sees key 5.
    k2 = k.copy()
    k2[1, 5] = 50.0
    out2 = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v),
                                   kv_lengths=jnp.asarray(lengths)))
    np.testing.assert_array_equal(out2[1, 0], out[1, 0])
    assert not np.allclose(out2[1, 1], out[1, 1])


def test_causal_mask_keeps_nan_of_later_tokens_out_of_earlier_queries():
    # Prefill: key 4 holds NaN; queries 0..3 never see it, queries 4.. do (NaN propagates).
    q, k, v, _, _ = _case(1, 6, 6, 2, 1, 8, [6])
    v[0, 4] = np.nan
    out = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    assert np.isfinite(out[0, :4]).all()
    assert np.isnan(out[0, 4:]).all()
    clean = v.copy()
    clean[0, 4] = 0.0
    assert_close(out[0, :4], attention_ref(q, k, clean)[0, :4])


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_is_refused(scale):
    q, k, v, lengths, _ = _case(1, 6, 1, 2, 2, 8, [6])
    k_pages, v_pages, tables = pages_from_dense(gen, k, v, num_pages=4, page_size=PAGE)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        fj.paged_attention(jnp.asarray(q[:, 0]), jnp.asarray(k_pages), jnp.asarray(v_pages),
                           jnp.asarray(tables), jnp.asarray(lengths), scale=scale)


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_visible_nan_propagates(where):
    q, k, v, lengths, _ = _case(1, 6, 1, 2, 2, 8, [6])
    kwargs = {}
    {"q": q, "k": k, "v": v}[where][0, 0, 0, 0] = np.nan
    dense = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **kwargs))
    k_pages, v_pages, tables = pages_from_dense(gen, k, v, num_pages=4, page_size=PAGE)
    paged = np.asarray(fj.paged_attention(jnp.asarray(q[:, 0]), jnp.asarray(k_pages),
                                          jnp.asarray(v_pages), jnp.asarray(tables),
                                          jnp.asarray(lengths), **kwargs))
    if where == "v":  # only head 0's first feature reads the NaN value
        assert np.isnan(dense[0, 0, 0, 0]) and np.isfinite(dense[0, 0, 1]).all()
        assert np.isnan(paged[0, 0, 0]) and np.isfinite(paged[0, 1]).all()
    elif where == "k":  # kv head 0 serves query head 0: its logit is NaN, so its row is NaN
        assert np.isnan(dense[0, 0, 0]).all() and np.isfinite(dense[0, 0, 1]).all()
        assert np.isnan(paged[0, 0]).all() and np.isfinite(paged[0, 1]).all()
    else:
        assert np.isnan(dense[0, 0, 0]).all() and np.isfinite(dense[0, 0, 1]).all()
        assert np.isnan(paged[0, 0]).all()


def test_softmax_non_finite_logits():
    x = jnp.asarray([[np.inf, 1.0, 2.0], [np.inf, np.inf, 0.0], [-np.inf, 1.0, 1.0],
                     [np.nan, 1.0, 2.0], [-np.inf, -np.inf, -np.inf]], jnp.float32)
    out = np.asarray(fj.softmax(x))
    np.testing.assert_array_equal(out[0], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out[1], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(out[2], [0.0, 0.5, 0.5])
    assert np.isnan(out[3]).all()
    np.testing.assert_array_equal(out[4], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(out, softmax_ref(np.asarray(x)), equal_nan=True)
    # A masked NaN is hidden like any masked entry; an unmasked one is data.
    where = jnp.asarray([[False, True, True]] * 5)
    masked = np.asarray(fj.softmax(x, where=where))
    assert np.isfinite(masked[3]).all()
    grads = jax.grad(lambda x: fj.softmax(x, where=where)[:, 1].sum())(x)
    assert np.isfinite(np.asarray(grads)[2:]).all()


@pytest.mark.parametrize("shape,name", [
    ((1, 2, 4, 0), "head_dim"), ((1, 2, 0, 8), "q_heads")])
def test_degenerate_shapes_are_refused(shape, name):
    q = jnp.ones(shape, jnp.float32)
    k = jnp.ones((1, 3, 2 if name == "head_dim" else 1, shape[3]), jnp.float32)
    with pytest.raises(ValueError, match=name):
        fj.attention(q, k, k)
    pages = jnp.ones((k.shape[2], 4, PAGE, shape[3]), jnp.float32)
    with pytest.raises(ValueError, match=name):
        fj.paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                           jnp.ones((1,), jnp.int32))


def test_degenerate_pools_are_refused():
    q = jnp.ones((1, 4, 8), jnp.float32)
    for shape, name in [((2, 4, 0, 8), "page_size"), ((2, 0, 4, 8), "num_pages")]:
        pages = jnp.ones(shape, jnp.float32)
        with pytest.raises(ValueError, match=name):
            fj.paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                               jnp.ones((1,), jnp.int32))


@pytest.mark.parametrize("q_len", [1, 4])
def test_hidden_nan_reaches_no_gradient(q_len):
    """A slot a query does not see contributes nothing to any gradient, even when it holds
    NaN or inf (dq would otherwise read 0 * NaN through the masked logits)."""
    q, k, v, lengths, _ = _case(2, 12, q_len, 4, 2, 8, [12, 7])
    mask = attention_mask_ref(2, q_len, 12, kv_lengths=lengths, sliding_window=5)
    k, v = poison_unseen(k, v, mask, gen=gen)  # NaN / inf
    k_pages, v_pages, tables = pages_from_dense(gen, k, v, num_pages=8, page_size=PAGE)
    args = dict(kv_lengths=jnp.asarray(lengths), sliding_window=5)

    def dense(q, k, v):
        return jnp.sum(fj.attention(q, k, v, **args) ** 2)

    def paged(q, kp, vp):
        qq = q[:, 0] if q_len == 1 else q
        return jnp.sum(fj.paged_attention(qq, kp, vp, jnp.asarray(tables), jnp.asarray(lengths),
                                          sliding_window=5) ** 2)

    dq, dk, dv = jax.grad(dense, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k),
                                                     jnp.asarray(v))
    pq, pk, pv = jax.grad(paged, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k_pages),
                                                     jnp.asarray(v_pages))
    for g in (dq, dk, dv, pq, pk, pv):
        assert np.isfinite(np.asarray(g)).all()
    hidden = ~mask.any(axis=1)
    assert (np.asarray(dk)[hidden] == 0).all() and (np.asarray(dv)[hidden] == 0).all()
    clean_k, clean_v = np.where(np.isfinite(k), k, 0), np.where(np.isfinite(v), v, 0)
    ref = jax.grad(dense)(jnp.asarray(q), jnp.asarray(clean_k), jnp.asarray(clean_v))
    np.testing.assert_allclose(np.asarray(dq), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pq), np.asarray(ref), rtol=1e-4, atol=1e-5)


def test_a_plus_inf_logit_gives_nan_for_its_query_only():
    q, k, v, lengths, _ = _case(1, 6, 2, 2, 1, 8, [6])
    q[0, 1, 0, 0] = np.inf
    k[0, :, 0, 0] = np.abs(k[0, :, 0, 0]) + 0.1  # so that the logits are +inf, not -inf
    out = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()
    assert np.isfinite(out[0, 1, 1]).all()
    capped = np.asarray(fj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     logits_soft_cap=5.0))
    assert np.isfinite(capped).all()  # the cap bounds an infinite logit too
