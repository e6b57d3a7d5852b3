"""``fj.attention``'s ``kv_lengths`` outside ``[0, kv_len]``.

Concrete lengths outside the range raise a one-line ValueError naming the argument and
the value, before any work. Traced ones are clamped into it, the default (bottom-right)
positions included, so every implementation returns the result of the clamped lengths;
``fj.debug_checks()`` with ``checkify`` reports them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import attention_ref, f64
from jax.experimental import checkify

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import jax_nn_attention as cudnn

IMPLEMENTATIONS = ["xla", "pallas_gpu_interpret", "pallas_tpu_interpret"]
KV_LEN = 16
WILD = np.array([40, -3, 9], np.int32)
CLAMPED = np.array([KV_LEN, 0, 9], np.int32)


def _qkv(q_len=4, dtype=jnp.float32, seed=0):
    gen = rng(seed, q_len)
    return (normal(gen, (3, q_len, 4, 128), dtype), normal(gen, (3, KV_LEN, 2, 128), dtype),
            normal(gen, (3, KV_LEN, 2, 128), dtype))


@pytest.mark.parametrize("lengths,match", [
    ([40, 5, 9], r"kv_lengths\[0\]=40 must lie in \[0, kv_len=16\]"),
    ([16, -3, 9], r"kv_lengths\[1\]=-3 must lie in \[0, kv_len=16\]"),
], ids=["too_long", "negative"])
@pytest.mark.parametrize("kind", ["numpy", "jax"])
def test_concrete_kv_lengths_outside_the_keys_raise(lengths, match, kind):
    q, k, v = _qkv()
    lengths = (np.asarray if kind == "numpy" else jnp.asarray)(np.array(lengths, np.int32))
    with pytest.raises(ValueError, match=match) as info:
        fj.attention(q, k, v, kv_lengths=lengths)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=match):  # validation, before any dispatch
        fj.explain("attention", q, k, v, kv_lengths=lengths)


def test_concrete_kv_lengths_at_the_bounds_are_accepted():
    q, k, v = _qkv()
    out = fj.attention(q, k, v, kv_lengths=np.array([KV_LEN, 0, 1], np.int32))
    np.testing.assert_array_equal(f64(out)[1], 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("masking", [dict(), dict(sliding_window=3), dict(causal=False)],
                         ids=["causal", "window", "not_causal"])
def test_traced_kv_lengths_are_clamped(implementation, masking):
    q, k, v = _qkv()
    step = jax.jit(lambda n: fj.attention(q, k, v, kv_lengths=n, implementation=implementation,
                                          **masking))
    wild = f64(step(jnp.asarray(WILD)))
    np.testing.assert_array_equal(wild, f64(step(jnp.asarray(CLAMPED))))
    ref = attention_ref(q, k, v, kv_lengths=CLAMPED, **masking)
    assert_close(wild, ref, dtype=jnp.float32, implementation=implementation)


def test_traced_kv_lengths_are_clamped_in_the_cudnn_mapping():
    """The ``"cudnn"`` implementation's argument mapping, run through
    ``jax.nn.dot_product_attention``'s XLA backend (in float32, which the CPU backend takes
    under strict promotion): where ``supports`` serves lengths (not causal; causal decode),
    the wild lengths give the clamped result too."""
    for q_len, causal in ((4, False), (1, True)):
        q, k, v = _qkv(q_len)
        low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        args = fj.dispatch.bind("attention", *low, causal=causal, kv_lengths=CLAMPED)
        assert cudnn.shape_reason(args, (9, 0)) is None
        step = jax.jit(lambda n, causal=causal, q=q, k=k, v=v: cudnn.cudnn_attention(
            q, k, v, causal=causal, kv_lengths=n, implementation="xla"))
        wild = f64(step(jnp.asarray(WILD)))
        np.testing.assert_array_equal(wild, f64(step(jnp.asarray(CLAMPED))))
        assert_close(wild, attention_ref(q, k, v, causal=causal, kv_lengths=CLAMPED),
                     dtype=jnp.float32)


def test_debug_checks_report_traced_kv_lengths():
    q, k, v = _qkv()
    fn = lambda n: fj.attention(q, k, v, kv_lengths=n)
    with fj.debug_checks():
        checked = jax.jit(checkify.checkify(fn))
        err, _ = checked(jnp.asarray(CLAMPED))
        assert err.get() is None
        err, _ = checked(jnp.asarray(WILD))
    message = err.get()
    assert message is not None and "kv_lengths[0]=40" in message and "kv_len=16" in message
