"""Attention sinks (gpt-oss) and chunked attention (Llama 4) in the XLA implementations of
``fj.attention``, ``fj.paged_attention`` and ``fj.ragged_paged_attention``, against the
float64 references of tests/cases/references.py, with NaN / inf in every slot a query
must not see (outside its chunk included).

Shapes are the models': gpt-oss 64 query / 8 KV heads of head_dim 64 (sinks, alternate
layers with a 128-token window, scaled down here); Llama 4 40 / 8 heads of head_dim 128
(chunks of 8192 tokens, scaled down to 16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import as_jnp, jit_attention, jit_paged_attention, jit_ragged_paged_attention
from cases.checks import assert_close, assert_nonfinite_exactly
from cases.inputs import normal, poison_per_query, poison_unseen, random_qkv, rng
from cases.paged import RAGGED_MIXES, default_positions, make_step, paged_cache
from cases.references import (
    attention_grads_ref,
    attention_mask_ref,
    attention_ref,
    f64,
    ragged_paged_attention_ref,
)

import forge_jax as fj
from forge_jax import dispatch, registry

GPT_OSS = (64, 8, 64)  # q_heads, kv_heads, head_dim
LLAMA4 = (40, 8, 128)
CHUNK = 16  # Llama 4's attention_chunk_size 8192, scaled down
SMALL = (8, 2, 32)


def sinks_for(q_heads, seed=0):
    """float32 sink logits of the size of real ones (gpt-oss's lie around -1 .. 4), some
    large enough to take most of a row's probability."""
    return jnp.asarray(rng(seed, q_heads).normal(1.0, 2.0, q_heads), jnp.float32)


# --- dense ----------------------------------------------------------------------------------

# (batch, q_len, kv_len, (q_heads, kv_heads, head_dim), masking): queries that stop short of
# the cache's end and lengths below kv_len leave slots no query sees (poisoned).
DENSE = {
    "gptoss-sinks-window": (2, 24, 40, GPT_OSS, dict(
        sliding_window=12, kv_lengths=np.array([40, 29]), sinks=sinks_for(64))),
    "gptoss-sinks-decode": (2, 1, 40, GPT_OSS, dict(
        kv_lengths=np.array([40, 23]), sinks=sinks_for(64, 1))),
    "llama4-chunk": (2, 20, 56, LLAMA4, dict(
        attention_chunk_size=CHUNK, kv_lengths=np.array([56, 37]))),
    "llama4-chunk-decode": (2, 1, 56, LLAMA4, dict(
        attention_chunk_size=CHUNK, kv_lengths=np.array([49, 33]))),
    "everything": (2, 11, 45, SMALL, dict(
        attention_chunk_size=CHUNK, sliding_window=10, logits_soft_cap=5.0,
        kv_lengths=np.array([45, 30]), sinks=sinks_for(8, 2), scale=0.3)),
    "non_causal-chunk-sinks": (1, 9, 40, SMALL, dict(
        causal=False, attention_chunk_size=CHUNK, sinks=sinks_for(8, 3),
        q_positions=np.array([[33, 34, 35, 36, 37, 38, 39, 40, 47]]))),
    # More than one block of queries (the online softmax over spans of keys).
    "blocks-chunk-sinks": (1, 270, 340, (4, 2, 16), dict(
        attention_chunk_size=64, sinks=sinks_for(4, 4))),
    "blocks-sinks-unmasked": (1, 260, 300, (4, 2, 16), dict(sinks=sinks_for(4, 5))),
}


def dense_inputs(name, dtype=jnp.float32):
    batch, q_len, kv_len, heads, masking = DENSE[name]
    q, k, v = random_qkv(len(name), batch, q_len, kv_len, *heads, dtype)
    mask = attention_mask_ref(batch, q_len, kv_len, **masking)
    return q, k, v, mask, masking


def attend(q, k, v, masking, implementation="xla"):
    return jit_attention(q, k, v, implementation=implementation, **as_jnp(masking))


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_matches_float64_with_nan_where_unseen(name):
    q, k, v, mask, masking = dense_inputs(name)
    ref = attention_ref(q, k, v, **masking)
    chunk = masking.get("attention_chunk_size")
    if not mask.any(axis=1).all():
        k, v = poison_unseen(k, v, mask, gen=rng(9))
    if chunk is not None:  # some poisoned slot is hidden by the chunk alone
        unchunked = attention_mask_ref(*q.shape[:2], k.shape[1],
                                       **{**masking, "attention_chunk_size": None})
        assert (unchunked.any(axis=1) & ~mask.any(axis=1)).any()
    out = attend(q, k, v, masking)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, err_msg="against float64")
    np.testing.assert_array_equal(f64(out)[~mask.any(-1)], 0.0)


@pytest.mark.parametrize("name", ["gptoss-sinks-window", "llama4-chunk", "everything"])
def test_dense_nan_reaches_only_the_queries_that_see_it(name):
    """NaN / inf in slots some queries of a sequence see and others do not (outside their
    chunk or window): exactly the queries that see one get a non-finite output."""
    q, k, v, mask, masking = dense_inputs(name)
    # (no soft cap: it bounds the +inf logit poison_per_query plants)
    masking = {n: x for n, x in masking.items() if n != "logits_soft_cap"}
    ref = attention_ref(q, k, v, **masking)
    if not mask.any(axis=1).all():
        k, v = poison_unseen(k, v, mask)
    q, k, v, must_nan, must_inf = poison_per_query(q, k, v, mask, seed=3)
    out = attend(q, k, v, masking)
    assert_nonfinite_exactly(out, ref, must_nan, must_inf, dtype=jnp.float32,
                             implementation="xla")


def test_decode_sees_nan_in_every_slot_outside_its_chunk():
    """One query per sequence: every slot it may not see (before its chunk, past its
    length) holds NaN; its output is the float64 result of the slots it sees."""
    g = rng(21)
    q_heads, kv_heads, head_dim = LLAMA4
    lengths = np.array([50, 17, 33])
    positions = lengths[:, None] - 1
    k = np.asarray(normal(g, (3, 64, kv_heads, head_dim)))
    v = np.asarray(normal(g, (3, 64, kv_heads, head_dim)))
    q = normal(g, (3, 1, q_heads, head_dim))
    masking = dict(attention_chunk_size=CHUNK, kv_lengths=lengths, sinks=sinks_for(40, 6))
    mask = attention_mask_ref(3, 1, 64, **masking)
    ref = attention_ref(q, k, v, **masking)
    hidden = ~mask[:, 0, :, None, None]
    k_bad, v_bad = np.where(hidden, np.nan, k), np.where(hidden, np.nan, v)
    assert (np.arange(64)[None, :] < (positions // CHUNK) * CHUNK)[:, :].any()
    out = attend(q, jnp.asarray(k_bad), jnp.asarray(v_bad), masking)
    assert_close(out, ref)


def test_sink_semantics():
    q, k, v, mask, masking = dense_inputs("everything")
    plain = {n: x for n, x in masking.items() if n != "sinks"}
    h = q.shape[2]
    # -inf sinks are no sinks.
    none = f64(attend(q, k, v, plain))
    np.testing.assert_allclose(
        f64(attend(q, k, v, {**plain, "sinks": jnp.full((h,), -jnp.inf)})), none,
        rtol=1e-6, atol=1e-6)
    # A sink takes probability from every key of its head: the output shrinks by the
    # sink's share, p_sink = exp(sink) / (exp(sink) + sum exp(logits)).
    out = f64(attend(q, k, v, masking))
    assert not np.allclose(out, none)
    # A query that sees no key still returns zeros (lengths 0).
    empty = {**masking, "kv_lengths": np.array([0, 30])}
    np.testing.assert_array_equal(f64(attend(q, k, v, empty))[0], 0.0)
    # NaN in a sink: NaN in exactly that head's outputs of queries that see a key.
    bad = masking["sinks"].at[3].set(jnp.nan)
    got = f64(attend(q, k, v, {**masking, "sinks": bad}))
    seen = mask.any(-1)
    assert np.isnan(got[:, :, 3][seen]).all()
    np.testing.assert_allclose(np.delete(got, 3, axis=2), np.delete(out, 3, axis=2),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["everything", "gptoss-sinks-decode", "blocks-chunk-sinks"])
def test_dense_gradients(name):
    q, k, v, mask, masking = dense_inputs(name)
    g = normal(rng(8), q.shape)
    want = attention_grads_ref(q, k, v, g, **masking)
    if not mask.any(axis=1).all():
        k, v = poison_unseen(k, v, mask)
    kw = {n: x for n, x in as_jnp(masking).items() if n != "sinks"}

    def loss(q, k, v, sinks):
        return jnp.sum(fj.attention(q, k, v, sinks=sinks, **kw) * g)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, masking["sinks"])
    for name_, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert_close(a, b, factor=4.0, err_msg=name_)


def test_vmap_over_the_batch():
    q, k, v, mask, masking = dense_inputs("everything")
    kw = {n: x for n, x in masking.items() if n != "kv_lengths"}
    lengths = jnp.asarray(masking["kv_lengths"], jnp.int32)
    mapped = jax.vmap(lambda q, k, v, n: fj.attention(q[None], k[None], v[None],
                                                      kv_lengths=n[None], **kw)[0])(
        q, k, v, lengths)
    assert_close(mapped, attention_ref(q, k, v, **masking))


def test_explain_and_supports_name_the_options():
    """XLA serves sinks and chunks; every other implementation either serves them or says
    which option it does not take."""
    q, k, v, _, masking = dense_inputs("everything")
    kw = as_jnp(masking)
    assert fj.explain("attention", q, k, v, **kw).implementation == "xla"
    args = dispatch.bind("attention", q, k, v, **kw)
    plain = dispatch.bind("attention", q, k, v, **{n: x for n, x in kw.items()
                                                   if n not in ("sinks", "attention_chunk_size")})
    impls = [impl for impl in registry.registrations("attention") if "interpret" in impl.name]
    reasons = {impl.name: dispatch.check(impl, args, "cpu") for impl in impls}
    # (a refusal for another reason, e.g. the dtype, is the one without the options)
    others = {impl.name: dispatch.check(impl, plain, "cpu") for impl in impls}
    assert reasons
    for name, reason in reasons.items():
        assert reason is None or "sinks=" in reason or "attention_chunk_size=" in reason \
            or reason == others[name], (name, reason)


# --- paged -----------------------------------------------------------------------------------

# (heads, page_size, lengths, q_len (None: decode), masking)
PAGED = {
    "gptoss-decode-sinks-window": (GPT_OSS, 16, (40, 9, 77), None, dict(sliding_window=24)),
    "gptoss-prefill-sinks": (GPT_OSS, 8, (30, 19), 7, {}),
    "llama4-decode-chunk": (LLAMA4, 16, (50, 16, 33), None, dict(attention_chunk_size=CHUNK)),
    "llama4-prefill-chunk-sinks": (LLAMA4, 8, (45, 21), 9, dict(attention_chunk_size=CHUNK)),
    "everything": (SMALL, 4, (37, 25), 6, dict(attention_chunk_size=CHUNK, sliding_window=9,
                                               logits_soft_cap=5.0)),
}


def paged_inputs(name):
    heads, page, lengths, q_len, masking = PAGED[name]
    q_heads, kv_heads, head_dim = heads
    masking = dict(masking)
    if "sinks" in name or name == "everything":
        masking["sinks"] = sinks_for(q_heads, 7)
    gen = rng(len(name), page)
    lengths = np.array(lengths)
    t = q_len or 1
    positions = default_positions(lengths, t)
    cache = paged_cache(gen, lengths, positions=positions, page_size=page, kv_heads=kv_heads,
                        head_dim=head_dim, dtype=jnp.float32,
                        window=masking.get("sliding_window"),
                        attention_chunk_size=masking.get("attention_chunk_size"))
    shape = (len(lengths), t, q_heads, head_dim)
    q = jnp.asarray(gen.standard_normal(shape if q_len else (shape[0], *shape[2:])),
                    jnp.float32)
    ref = attention_ref(f64(q).reshape(shape), cache.dense_k, cache.dense_v,
                        q_positions=positions, kv_lengths=lengths, **masking).reshape(q.shape)
    return q, cache, lengths, positions, masking, ref


@pytest.mark.parametrize("name", list(PAGED))
def test_paged_matches_float64_with_nan_where_unseen(name):
    q, cache, lengths, _, masking, ref = paged_inputs(name)
    assert not np.isfinite(f64(cache.k_pages)).all()
    out = jit_paged_attention(q, cache.k_pages, cache.v_pages, cache.block_tables,
                              jnp.asarray(lengths, jnp.int32), implementation="xla", **masking)
    assert out.shape == q.shape
    assert_close(out, ref)


@pytest.mark.parametrize("name", ["llama4-prefill-chunk-sinks", "everything"])
def test_paged_nan_reaches_only_the_queries_that_see_it(name):
    q, cache, lengths, positions, masking, _ = paged_inputs(name)
    # (no soft cap: it bounds the +inf logit poison_per_query plants)
    masking.pop("logits_soft_cap", None)
    batch, t = positions.shape
    ref = attention_ref(f64(q), cache.dense_k, cache.dense_v, q_positions=positions,
                        kv_lengths=lengths, **masking)
    mask = attention_mask_ref(batch, t, cache.dense_k.shape[1], q_positions=positions,
                              kv_lengths=lengths, **masking)
    q, k_pages, v_pages, must_nan, must_inf = poison_per_query(
        q, cache.k_pages, cache.v_pages, mask, seed=11,
        block_tables=np.asarray(cache.block_tables))
    out = jit_paged_attention(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                              cache.block_tables, jnp.asarray(lengths, jnp.int32),
                              implementation="xla", **masking)
    assert_nonfinite_exactly(out, ref, must_nan, must_inf, dtype=jnp.float32,
                             implementation="xla")


def test_paged_sinks_gradient():
    q, cache, lengths, _, masking, _ = paged_inputs("everything")
    kw = {n: x for n, x in masking.items() if n != "sinks"}
    g = normal(rng(4), q.shape)

    def loss(q, sinks):
        return jnp.sum(fj.paged_attention(q, cache.k_pages, cache.v_pages, cache.block_tables,
                                          jnp.asarray(lengths, jnp.int32), sinks=sinks, **kw)
                       * g)

    dq, dsinks = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, masking["sinks"])
    positions = default_positions(lengths, q.shape[1])
    want = attention_grads_ref(q, cache.dense_k, cache.dense_v, g, q_positions=positions,
                               kv_lengths=lengths, **masking)
    assert_close(dq, want[0], factor=4.0, err_msg="dq")
    assert_close(dsinks, want[3], factor=4.0, err_msg="dsinks")


# --- ragged ----------------------------------------------------------------------------------

RAGGED = {
    "mixed-gptoss-sinks-window": ("mixed", "gqa", dict(sliding_window=8), True),
    "mixed-chunk": ("mixed", "gqa", dict(attention_chunk_size=8), False),
    "chunked_prefill-chunk-sinks-cap": ("chunked_prefill", "smollm2", dict(
        attention_chunk_size=8, logits_soft_cap=5.0), True),
}


def ragged_step(name):
    mix, heads, masking, with_sinks = RAGGED[name]
    masking = dict(masking)
    step = make_step(rng(len(name)), **RAGGED_MIXES[mix], page_size=4, heads=heads,
                     head_dim=32, dtype=np.float32, window=masking.get("sliding_window"),
                     attention_chunk_size=masking.get("attention_chunk_size"))
    if with_sinks:
        masking["sinks"] = sinks_for(step.q.shape[1], 8)
    return step, masking


@pytest.mark.parametrize("name", list(RAGGED))
def test_ragged_matches_float64_with_nan_where_unseen(name):
    step, masking = ragged_step(name)
    if "attention_chunk_size" in masking:  # the chunk hides slots some sequence holds
        assert np.isnan(step.k_pages).sum() > np.isnan(step.k_clean).sum()
    out = jit_ragged_paged_attention(*step.args(), implementation="xla", **masking)
    assert_close(out, ragged_paged_attention_ref(step, **masking), allow_zero_ref=True)
    np.testing.assert_array_equal(f64(out)[step.cu_q_lens[step.num_seqs]:], 0.0)


def test_ragged_sinks_gradient():
    """Through the ragged op's custom JVP (its row-by-row formulation)."""
    step, masking = ragged_step("chunked_prefill-chunk-sinks-cap")
    kw = {n: x for n, x in masking.items() if n != "sinks"}
    args = step.args(clean=True)
    g = normal(rng(5), step.q.shape)

    def loss(sinks):
        return jnp.sum(fj.ragged_paged_attention(*args, sinks=sinks, **kw) * g)

    got = jax.jit(jax.grad(loss))(masking["sinks"])
    # float64 central differences of the reference.
    sinks = f64(masking["sinks"])
    want = np.zeros_like(sinks)
    for h in range(len(sinks)):
        d = np.zeros_like(sinks)
        d[h] = 1e-5
        hi = ragged_paged_attention_ref(step, **kw, sinks=sinks + d)
        lo = ragged_paged_attention_ref(step, **kw, sinks=sinks - d)
        want[h] = np.sum((hi - lo) * f64(g)) / 2e-5
    assert_close(got, want, factor=4.0)


# --- bad arguments --------------------------------------------------------------------------


def _dense(**kw):
    q, k, v = random_qkv(0, 1, 2, 4, 4, 2, 8, jnp.float32)
    return fj.attention(q, k, v, **kw)


def _paged(**kw):
    q = jnp.ones((1, 4, 8))
    pages = jnp.ones((2, 3, 4, 8))
    return fj.paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                              jnp.array([3], jnp.int32), **kw)


def _ragged(**kw):
    q = jnp.ones((3, 4, 8))
    pages = jnp.ones((2, 3, 4, 8))
    return fj.ragged_paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                                     jnp.array([3], jnp.int32), jnp.array([0, 3], jnp.int32),
                                     1, **kw)


BAD = {
    "sinks_shape": (dict(sinks=jnp.zeros((2,))), ValueError,
                    r"sinks must be \[q_heads\] = \(4,\), got sinks.shape=\(2,\)"),
    "sinks_rank": (dict(sinks=jnp.zeros((4, 1))), ValueError, r"sinks"),
    "sinks_int": (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, r"sinks\.dtype=int32"),
    "chunk_zero": (dict(attention_chunk_size=0), ValueError, r"attention_chunk_size=0"),
    "chunk_float": (dict(attention_chunk_size=8.0), ValueError, r"attention_chunk_size=8\.0"),
}


@pytest.mark.parametrize("op", [_dense, _paged, _ragged], ids=["dense", "paged", "ragged"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_are_refused_in_one_line(op, name):
    kw, error, pattern = BAD[name]
    with pytest.raises(error, match=pattern) as info:
        op(**kw)
    assert "\n" not in str(info.value)
