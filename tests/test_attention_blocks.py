"""The dense XLA attention's path for several queries: blocks of queries inside ``lax.scan``,
each reading only the keys it may see when the causal alignment is static, the keys all
of a block's queries see by spans of an online softmax (see
``forge_jax.ops.attention._attend_blocks``). The block sizes are shrunk so that short
sequences go through scans, whole and partial blocks, several spans and the key bound."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import case_id, jcall
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import attention_ref, f64

import forge_jax as fj

# The module, not the function that `forge_jax.ops.attention` names.
attention_module = importlib.import_module("forge_jax.ops.attention")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 queries, scans of 2 blocks, spans of 3 keys: 13 queries run as a scan,
    a scan, then one whole block and a partial block of 1 (static bound), or as one scan of
    3 blocks and a tail; a block's unmasked keys come in spans of 3."""
    monkeypatch.setattr(attention_module, "Q_BLOCK", 4)
    monkeypatch.setattr(attention_module, "BLOCKS_PER_SCAN", 2)
    monkeypatch.setattr(attention_module, "KV_BLOCK", 3)


def _qkv(g, batch, q_len, kv_len, q_heads, kv_heads, head_dim=8, dtype=jnp.float32):
    return (normal(g, (batch, q_len, q_heads, head_dim), dtype, 2.0),
            normal(g, (batch, kv_len, kv_heads, head_dim), dtype, 2.0),
            normal(g, (batch, kv_len, kv_heads, head_dim), dtype))


CASES = {  # name: (q_len, kv_len, keyword arguments, reference keyword arguments)
    "prefill": (13, 13, {}, {}),
    "chunked_prefill": (13, 21, {}, {}),
    "more_queries_than_keys": (13, 9, {}, {}),
    "kv_lengths": (13, 21, dict(kv_lengths=np.array([21, 15])), {}),
    "q_positions": (13, 21, dict(q_positions=np.array([np.arange(3, 16), np.arange(8, 21)])),
                    {}),
    "window_and_cap": (13, 13, dict(sliding_window=5, logits_soft_cap=4.0), {}),
    "not_causal": (13, 17, dict(causal=False), {}),
}


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_blocks_agree_with_the_reference(small_blocks, name, q_heads, kv_heads):
    q_len, kv_len, kw, _ = CASES[name]
    q, k, v = _qkv(rng(31, q_len, kv_len, q_heads), 2, q_len, kv_len, q_heads, kv_heads)
    jkw = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out = jcall(fj.attention, q, k, v, **jkw)
    assert_close(out, attention_ref(q, k, v, **kw), dtype=jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=case_id)
def test_blocks_in_low_precision(small_blocks, dtype):
    q, k, v = _qkv(rng(32), 2, 13, 13, 4, 2, dtype=dtype)
    out = jcall(fj.attention, q, k, v)
    assert out.dtype == dtype
    assert_close(out, attention_ref(q, k, v))


def test_blocks_hide_nan_in_keys_no_query_sees(small_blocks):
    """Cache slots past each sequence's length hold NaN: the exact path takes over and the
    visible result is unchanged (the attention contract)."""
    q, k, v = _qkv(rng(33), 2, 13, 21, 4, 2)
    lengths = np.array([21, 15])
    k_bad = np.array(k)
    v_bad = np.array(v)
    k_bad[1, 15:], v_bad[1, 15:] = np.nan, np.inf
    out = jcall(fj.attention, q, jnp.asarray(k_bad), jnp.asarray(v_bad),
                kv_lengths=jnp.asarray(lengths))
    assert_close(out, attention_ref(q, k, v, kv_lengths=lengths), dtype=jnp.float32)


@pytest.mark.parametrize("kw", [{}, dict(sliding_window=9), dict(logits_soft_cap=3.0),
                                dict(kv_lengths=np.array([13, 6]))],
                         ids=["causal", "window", "cap", "kv_lengths"])
def test_blocks_gradients_match_one_block(small_blocks, monkeypatch, kw):
    """The scans' and spans' gradients are those of the same attention in one block and
    one span."""
    q, k, v = _qkv(rng(34), 2, 13, 13, 4, 2)
    cot = normal(rng(35), q.shape)
    jkw = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}

    def grads():
        loss = lambda q, k, v: jnp.sum(fj.attention(q, k, v, **jkw) * cot)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    blocked = grads()
    monkeypatch.setattr(attention_module, "Q_BLOCK", 64)  # one block, one span
    monkeypatch.setattr(attention_module, "KV_BLOCK", 64)
    whole = grads()
    for a, b in zip(blocked, whole, strict=True):
        assert np.isfinite(f64(a)).all() and np.abs(f64(a)).max() > 0
        np.testing.assert_allclose(f64(a), f64(b), rtol=1e-5, atol=1e-5)


def test_default_blocks_on_a_long_prefill():
    """The default block sizes: 300 queries are scans of whole blocks and a partial one."""
    q, k, v = _qkv(rng(36), 1, 300, 300, 4, 2, head_dim=16)
    assert_close(jcall(fj.attention, q, k, v), attention_ref(q, k, v), dtype=jnp.float32)
