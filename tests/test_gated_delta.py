"""``fj.gated_delta_rule``, ``fj.gated_delta_gates`` and ``fj.causal_conv1d`` (XLA) against
float64 NumPy references (``cases.gated_delta_references``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.gated_delta_references import causal_conv1d_ref, gated_delta_ref
from cases.references import f64

import forge_jax as fj
from forge_jax import sharding


def gdn_inputs(seed=0, *, batch=2, seq=37, k_heads=2, v_heads=4, dk=16, dv=8,
               dtype=jnp.float32, state=True):
    """Random q/k/v, gates from ``gated_delta_gates`` with a decay mild enough that the state
    carries tokens across many chunks, and a random initial state."""
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((batch, seq, k_heads, dk)), dtype)
    k = jnp.asarray(r.standard_normal((batch, seq, k_heads, dk)), dtype)
    v = jnp.asarray(r.standard_normal((batch, seq, v_heads, dv)), dtype)
    a = jnp.asarray(r.standard_normal((batch, seq, v_heads)) - 2.0, jnp.float32)
    b = jnp.asarray(r.standard_normal((batch, seq, v_heads)), jnp.float32)
    a_log = jnp.asarray(np.log(r.uniform(0.1, 1.0, v_heads)), jnp.float32)
    dt_bias = jnp.asarray(r.standard_normal(v_heads) * 0.5, jnp.float32)
    g, beta = fj.gated_delta_gates(a, b, a_log, dt_bias)
    s0 = (jnp.asarray(r.standard_normal((batch, v_heads, dk, dv)) * 0.5, jnp.float32)
          if state else None)
    return q, k, v, g, beta, s0


def test_gates_match_their_formula():
    r = np.random.default_rng(1)
    a, b = (jnp.asarray(r.standard_normal((3, 5, 4)), jnp.float32) for _ in range(2))
    a_log, dt_bias = (jnp.asarray(r.standard_normal(4), jnp.float32) for _ in range(2))
    g, beta = fj.gated_delta_gates(a, b, a_log, dt_bias)
    x = f64(a) + f64(dt_bias)
    assert_close(g, -np.exp(f64(a_log)) * np.log1p(np.exp(x)))
    assert_close(beta, 1 / (1 + np.exp(-f64(b))))
    assert g.dtype == beta.dtype == jnp.float32 and (np.asarray(g) < 0).all()


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 16, 64])
def test_chunked_equals_the_recurrence_at_every_chunk_size(chunk_size):
    q, k, v, g, beta, s0 = gdn_inputs()
    out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0, chunk_size=chunk_size)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0)
    assert out.shape == v.shape and out.dtype == v.dtype and s.dtype == jnp.float32
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)
    assert fj.dispatch.last_selection("gated_delta_rule").implementation == "xla"


def test_recurrent_implementation_and_zero_state():
    q, k, v, g, beta, _ = gdn_inputs(2, state=False)
    out, s = fj.gated_delta_rule(q, k, v, g, beta, implementation="xla_recurrent")
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta)
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)


def test_without_l2norm_and_with_a_scale():
    q, k, v, g, beta, s0 = gdn_inputs(3, seq=20)
    k = k * 0.2  # unnormalised keys: keep the delta rule contractive
    out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0, qk_l2norm=False, scale=0.3,
                                 chunk_size=8)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0, qk_l2norm=False, scale=0.3)
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)


@pytest.mark.parametrize("pieces", [(5, 1, 17, 14), (1,) * 3 + (34,)])
def test_prefill_in_pieces_equals_prefill_at_once(pieces):
    q, k, v, g, beta, s0 = gdn_inputs(4)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0)
    outs, s, start = [], s0, 0
    for n in pieces:
        part = (x[:, start:start + n] for x in (q, k, v, g, beta))
        o, s = fj.gated_delta_rule(*part, state=s, chunk_size=8)
        outs.append(o)
        start += n
    assert_close(jnp.concatenate(outs, axis=1), ref_out, factor=5)
    assert_close(s, ref_s, factor=5)


@pytest.mark.parametrize("implementation", ["xla", "xla_recurrent"])
def test_variable_lengths_ignore_padding_even_nan(implementation):
    q, k, v, g, beta, s0 = gdn_inputs(5, batch=3)
    lengths = np.array([37, 0, 12], np.int32)
    pad = np.arange(37)[None, :] >= lengths[:, None]  # [batch, seq]
    poisoned = [jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), jnp.nan, x)
                for x in (q, k, v, g, beta)]
    out, s = fj.gated_delta_rule(*poisoned, state=s0, lengths=jnp.asarray(lengths),
                                 chunk_size=16, implementation=implementation)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0, lengths=lengths)
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)
    assert (np.asarray(out)[pad] == 0).all()
    np.testing.assert_array_equal(np.asarray(s[1]), np.asarray(s0[1]))  # length 0: untouched


def test_decode_steps_with_idle_rows():
    q, k, v, g, beta, s0 = gdn_inputs(6, seq=1, batch=3)
    lengths = jnp.asarray([1, 0, 1], jnp.int32)
    out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0, lengths=lengths)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0, lengths=np.asarray(lengths))
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype):
    q, k, v, g, beta, s0 = gdn_inputs(7, dtype=dtype, seq=24)
    out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0.astype(dtype), chunk_size=8)
    ref_out, _ = gated_delta_ref(q, k, v, g, beta, state=s0.astype(dtype))
    assert out.dtype == dtype and s.dtype == dtype
    assert_close(out, ref_out, factor=2)


def test_jit_vmap_and_grad():
    q, k, v, g, beta, s0 = gdn_inputs(8, seq=12)
    f = jax.jit(lambda *a: fj.gated_delta_rule(*a[:5], state=a[5], chunk_size=8))
    out, s = f(q, k, v, g, beta, s0)
    ref_out, _ = gated_delta_ref(q, k, v, g, beta, state=s0)
    assert_close(out, ref_out, factor=5)
    # vmap over a leading axis of rows: each row alone.
    def row(*a):
        a = [x[None] for x in a]
        return fj.gated_delta_rule(*a[:5], state=a[5], chunk_size=8)[0][0]

    vm = jax.vmap(row)
    assert_close(vm(q, k, v, g, beta, s0), ref_out, factor=5)

    # The directional derivative against central differences of the float64 reference.
    r = np.random.default_rng(9)
    dq, dv = r.standard_normal(q.shape), r.standard_normal(v.shape)
    w = r.standard_normal(out.shape)

    def loss(q_, v_):
        return jnp.sum(fj.gated_delta_rule(q_, k, v_, g, beta, state=s0, chunk_size=4)[0] * w)

    gq, gv = jax.grad(loss, argnums=(0, 1))(q, v)
    eps = 1e-5
    plus = gated_delta_ref(f64(q) + eps * dq, k, f64(v) + eps * dv, g, beta, state=s0)[0]
    minus = gated_delta_ref(f64(q) - eps * dq, k, f64(v) - eps * dv, g, beta, state=s0)[0]
    numeric = np.sum((plus - minus) * w) / (2 * eps)
    analytic = np.sum(f64(gq) * dq) + np.sum(f64(gv) * dv)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4)


def test_sharded_over_a_mesh_matches():
    q, k, v, g, beta, s0 = gdn_inputs(10, seq=12)
    ref_out, ref_s = gated_delta_ref(q, k, v, g, beta, state=s0)
    with sharding.use_mesh(sharding.make_mesh("dp=2,tp=2")):
        out, s = jax.jit(lambda *a: fj.gated_delta_rule(*a[:5], state=a[5], chunk_size=4))(
            q, k, v, g, beta, s0)
    assert_close(out, ref_out, factor=5)
    assert_close(s, ref_s, factor=5)


@pytest.mark.slow  # transformers' layer parity (tests/test_gated_deltanet_layer.py) covers it
def test_matches_transformers_qwen3_next_functions():
    torch = pytest.importorskip("torch")
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = gdn_inputs(11, seq=50)
    t = [torch.from_numpy(np.array(x)) for x in (q, k, v, g, beta, s0)]
    ref_out, ref_s = qwen3_next.torch_chunk_gated_delta_rule(
        *t[:3], g=t[3], beta=t[4], chunk_size=16, initial_state=t[5], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    out, s = fj.gated_delta_rule(q, k, v, g, beta, state=s0, chunk_size=16)
    assert_close(out, ref_out.double().numpy(), factor=5)
    assert_close(s, ref_s.double().numpy(), factor=5)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((2, 9, 6)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(13).standard_normal((4, 6)), jnp.float32)
    ref = qwen3_next.causal_conv1d_fn(torch.from_numpy(np.array(x)).transpose(1, 2),
                                      torch.from_numpy(np.array(w)).T.contiguous(),
                                      None, activation="silu")
    assert_close(fj.causal_conv1d(x, w)[0], ref.transpose(1, 2).double().numpy())


GDN_BAD = {
    "rank": (dict(q=np.zeros((2, 3, 4), np.float32)), ValueError, "q must have rank 4"),
    "dtype mix": (dict(v=np.zeros((2, 5, 4, 8), np.float16)), TypeError, "same dtype"),
    "qk shapes": (dict(k=np.zeros((2, 5, 2, 4), np.float32)), ValueError, "q and k"),
    "groups": (dict(v=np.zeros((2, 5, 3, 8), np.float32)), ValueError, "multiple of k_heads"),
    "g shape": (dict(g=np.zeros((2, 5, 2), np.float32)), ValueError, "g must be"),
    "state shape": (dict(state=np.zeros((2, 4, 8, 4), np.float32)), ValueError, "state must"),
    "lengths": (dict(lengths=np.array([1, 6], np.int32)), ValueError, r"lengths\[1\]=6"),
    "lengths dtype": (dict(lengths=np.array([1., 2.])), TypeError, "lengths must be an int"),
    "chunk": (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    "scale": (dict(scale=-1.0), ValueError, "scale must be"),
    "l2norm": (dict(qk_l2norm=1), TypeError, "qk_l2norm must be a bool"),
}


@pytest.mark.parametrize("change,error,match", list(GDN_BAD.values()), ids=list(GDN_BAD))
def test_gated_delta_rule_rejects_bad_arguments(change, error, match):
    args = dict(q=np.ones((2, 5, 2, 8), np.float32), k=np.ones((2, 5, 2, 8), np.float32),
                v=np.ones((2, 5, 4, 8), np.float32), g=np.zeros((2, 5, 4), np.float32),
                beta=np.ones((2, 5, 4), np.float32))
    args.update(change)
    with pytest.raises(error, match=match):
        fj.gated_delta_rule(**args)


def test_gates_reject_mismatched_heads():
    with pytest.raises(ValueError, match=r"A_log and dt_bias must be \[v_heads\] = \(4,\)"):
        fj.gated_delta_gates(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32),
                             np.zeros(3, np.float32), np.zeros(4, np.float32))


# ---------------------------------------------------------------------------------------
# causal_conv1d


def conv_inputs(seed=0, *, batch=3, seq=11, channels=6, kernel=4, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((batch, seq, channels)), dtype)
    w = jnp.asarray(r.standard_normal((kernel, channels)), jnp.float32)
    bias = jnp.asarray(r.standard_normal(channels), jnp.float32)
    state = jnp.asarray(r.standard_normal((batch, kernel - 1, channels)), dtype)
    return x, w, bias, state


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_conv_against_reference(activation, kernel):
    x, w, bias, state = conv_inputs(kernel=kernel)
    out, new = fj.causal_conv1d(x, w, bias, state=state, activation=activation)
    ref_out, ref_new = causal_conv1d_ref(x, w, bias, state=state, activation=activation)
    assert_close(out, ref_out)
    if kernel > 1:
        assert_close(new, ref_new)
    assert new.shape == (3, kernel - 1, 6) and new.dtype == x.dtype


def test_conv_in_pieces_equals_at_once_and_short_pieces():
    x, w, bias, _ = conv_inputs(1, seq=13)
    ref_out, ref_new = causal_conv1d_ref(x, w, bias)
    outs, state, start = [], None, 0
    for n in (2, 1, 1, 6, 3):  # pieces shorter than the kernel carry older inputs forward
        o, state = fj.causal_conv1d(x[:, start:start + n], w, bias, state=state)
        outs.append(o)
        start += n
    assert_close(jnp.concatenate(outs, axis=1), ref_out)
    assert_close(state, ref_new)


def test_conv_variable_lengths_ignore_padding_even_nan():
    x, w, bias, state = conv_inputs(2)
    lengths = np.array([11, 0, 2], np.int32)
    pad = np.arange(11)[None, :] >= lengths[:, None]
    out, new = fj.causal_conv1d(jnp.where(pad[..., None], jnp.nan, x), w, bias, state=state,
                                lengths=jnp.asarray(lengths))
    ref_out, ref_new = causal_conv1d_ref(x, w, bias, state=state, lengths=lengths)
    assert_close(out, ref_out)
    assert_close(new, ref_new)
    assert (np.asarray(out)[pad] == 0).all()


def test_conv_bfloat16_jit_and_grad():
    x, w, bias, state = conv_inputs(3, dtype=jnp.bfloat16)
    out, new = jax.jit(fj.causal_conv1d)(x, w, bias, state=state)
    assert out.dtype == new.dtype == jnp.bfloat16
    assert_close(out, causal_conv1d_ref(x, w, bias, state=state)[0])
    x32 = x.astype(jnp.float32)
    gw = jax.grad(lambda w_: jnp.sum(fj.causal_conv1d(x32, w_, activation=None)[0]))(w)
    xx = np.concatenate([np.zeros((3, 3, 6)), f64(x32)], axis=1)  # d out / d w[i] = sum xx
    ref = np.stack([xx[:, i:i + 11].sum(axis=(0, 1)) for i in range(4)])
    assert_close(gw, ref)


CONV_BAD = {
    "rank": (dict(x=np.zeros((2, 3), np.float32)), ValueError, "x must have rank 3"),
    "weight": (dict(weight=np.zeros((4, 5), np.float32)), ValueError, "weight must be"),
    "bias": (dict(bias=np.zeros(5, np.float32)), ValueError, "bias must be"),
    "state": (dict(state=np.zeros((2, 4, 6), np.float32)), ValueError, "state must be"),
    "lengths": (dict(lengths=np.array([-1, 0], np.int32)), ValueError, r"lengths\[0\]=-1"),
    "activation": (dict(activation="gelu"), ValueError, "activation must be one of"),
}


@pytest.mark.parametrize("change,error,match", list(CONV_BAD.values()), ids=list(CONV_BAD))
def test_conv_rejects_bad_arguments(change, error, match):
    args = dict(x=np.ones((2, 5, 6), np.float32), weight=np.ones((4, 6), np.float32))
    args.update(change)
    with pytest.raises(error, match=match):
        fj.causal_conv1d(**args)


def test_explain_names_the_implementations():
    q, k, v, g, beta, s0 = gdn_inputs(seq=4)
    sel = fj.explain("gated_delta_rule", q, k, v, g, beta, state=s0)
    assert sel.implementation == "xla" and "xla_recurrent" in str(sel)
    x, w, _, _ = conv_inputs()
    assert fj.explain("causal_conv1d", x, w).implementation == "xla"
