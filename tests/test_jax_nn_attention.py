"""The ``"cudnn"`` attention implementation: ``jax.nn.dot_product_attention`` with cuDNN
(pallas_kernels/gpu/jax_nn_attention.py).

On CPU: every rejection of ``supports()`` (each a sentence ``fj.explain`` shows), and the
argument mapping, run through ``jax.nn.dot_product_attention``'s XLA backend (independent
code) against the float64 reference of the attention contract. :class:`TestAttentionCudnn`
runs the real cuDNN call through the behaviours of
:class:`cases.attention_base.AttentionCases` and is skipped without a GPU of compute
capability >= 8.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.attention_base import AttentionCase, AttentionCases
from cases.calls import case_id
from cases.checks import assert_close
from cases.inputs import random_qkv
from cases.references import attention_ref

import forge_jax as fj
from forge_jax import backends, dispatch
from forge_jax.pallas_kernels.gpu import jax_nn_attention as cudnn

AMPERE, HOPPER = (8, 0), (9, 0)


QKV = dict(batch=2, q_len=8, kv_len=8, q_heads=4, kv_heads=2, head_dim=64)


def qkv(dtype=jnp.bfloat16, **shapes):
    """Random ``q, k, v`` of the ``QKV`` shapes, changed by ``shapes``."""
    dims = tuple((QKV | shapes).values())
    return random_qkv((0, dims[1], dims[2], dims[5]), *dims, dtype)


def args_of(q, k, v, **kw):
    return dispatch.bind("attention", q, k, v, **kw)


# (description, attention arguments besides q/k/v, q/k/v shapes, words of the reason)
REJECTED = [
    ("float32", dict(), dict(dtype=jnp.float32), "float16/bfloat16"),
    ("head_dim not a multiple of 8", dict(), dict(head_dim=60), "multiple of 8"),
    ("head_dim 256 before Hopper", dict(), dict(head_dim=256), "> 128"),
    ("soft cap", dict(logits_soft_cap=30.0), dict(), "soft cap"),
    ("causal, q_len != kv_len", dict(), dict(q_len=4, kv_len=8), "top-left"),
    ("causal with kv_lengths", dict(kv_lengths=jnp.asarray([8, 5])), dict(), "kv_lengths"),
    ("causal with positions", dict(q_positions=jnp.zeros((2, 8), jnp.int32)), dict(),
     "q_positions"),
    ("window without causal", dict(causal=False, sliding_window=4), dict(), "window"),
    ("decode with a window", dict(sliding_window=4), dict(q_len=1), "window"),
]


@pytest.mark.parametrize("kw,shapes,words", [r[1:] for r in REJECTED],
                         ids=[r[0] for r in REJECTED])
def test_rejections(kw, shapes, words):
    args = args_of(*qkv(**shapes), **kw)
    reason = cudnn.shape_reason(args, AMPERE)
    assert reason is not None and words in reason, reason


def test_mixed_dtypes_rejected():
    q, k, v = qkv()
    reason = cudnn.shape_reason(args_of(q.astype(jnp.float16), k, v), AMPERE)  # cache dtype
    assert "one dtype" in reason


def test_head_dim_limit_by_generation():
    args = args_of(*qkv(head_dim=256))
    assert cudnn.shape_reason(args, HOPPER) is None
    assert "Hopper" in cudnn.shape_reason(args, AMPERE)
    assert "> 256" in cudnn.shape_reason(args_of(*qkv(head_dim=264)), HOPPER)


@pytest.mark.parametrize("kw,shapes", [
    (dict(), dict()),                                    # causal self-attention, GQA
    (dict(sliding_window=3), dict(kv_heads=1)),          # MQA with a window
    (dict(kv_lengths=jnp.asarray([9, 0])), dict(q_len=1, kv_len=12)),  # decode
    (dict(causal=False, kv_lengths=jnp.asarray([3, 7])), dict(q_len=5, kv_len=7)),
    (dict(causal=False, q_positions=jnp.zeros((2, 5), jnp.int32)), dict(q_len=5)),
])
def test_accepted(kw, shapes):
    assert cudnn.shape_reason(args_of(*qkv(**shapes), **kw), AMPERE) is None


def test_device_reasons(monkeypatch):
    assert "not on cpu" in cudnn.device_reason("cpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: None)
    assert "no GPU" in cudnn.device_reason("gpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "7.5")
    assert "T4" in cudnn.device_reason("gpu") and "7.5" in cudnn.device_reason("gpu")
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "8.9")
    assert cudnn.device_reason("gpu") is None


def test_explain_shows_the_reason_and_auto_does_not_rank_it(monkeypatch):
    """On a GPU auto selection treats cuDNN as unverified (no record) and says why it
    could not serve the call anyway."""
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "8.0")
    args = args_of(*qkv(q_len=4, kv_len=8))
    rejected = dispatch.select("attention", args, platform="gpu").rejected
    assert "not yet verified" in rejected["cudnn"]
    assert "top-left" in rejected["cudnn"]
    assert cudnn.VERIFIED == {}


def test_by_name_on_cpu_names_the_platform():
    q, k, v = qkv()
    with pytest.raises(fj.ImplementationError, match="cudnn"):
        fj.attention(q, k, v, implementation="cudnn")


# The mapping onto jax.nn.dot_product_attention, run on its XLA backend (in float32, so that
# the comparison is tight), against the float64 reference of forge_jax's contract.
MAPPED = {  # id: (attention arguments besides q/k/v, q/k/v shapes)
    "causal_gqa": (dict(), dict()),
    "window_mqa": (dict(sliding_window=3), dict(kv_heads=1)),
    "window_past_every_key": (dict(sliding_window=100), dict()),
    "decode_lengths": (dict(kv_lengths=jnp.asarray([9, 0])), dict(q_len=1, kv_len=12)),
    "decode": (dict(), dict(q_len=1, kv_len=12)),
    "non_causal_lengths": (dict(causal=False, kv_lengths=jnp.asarray([3, 7])),
                           dict(q_len=5, kv_len=7)),
    "non_causal": (dict(causal=False), dict(q_len=5, kv_len=7)),
}


@pytest.mark.parametrize("kw,shapes", list(MAPPED.values()), ids=list(MAPPED))
def test_mapping_matches_the_contract(kw, shapes):
    q, k, v = qkv(**shapes, dtype=jnp.float32, head_dim=16)
    args = args_of(q, k, v, **kw)
    assert cudnn.shape_reason({**args, "q": q.astype(jnp.bfloat16), "k": k.astype(jnp.bfloat16),
                               "v": v.astype(jnp.bfloat16)}, AMPERE) is None
    out = jax.jit(lambda q, k, v: cudnn.cudnn_attention(
        q, k, v, **{n: a for n, a in args.items() if n not in "qkv"},
        implementation="xla"))(q, k, v)
    ref = attention_ref(q, k, v, **kw)
    assert_close(out, ref, allow_zero_ref=True)
    if "kv_lengths" in kw and not int(kw["kv_lengths"].min()):
        assert not np.asarray(out[1]).any()  # a sequence with no key: zeros


def test_hidden_nan_past_the_length_stays_out():
    q, k, v = qkv(q_len=1, kv_len=12, dtype=jnp.float32, head_dim=16)
    lengths = jnp.asarray([5, 9])
    k = k.at[0, 5:].set(jnp.nan)
    v = v.at[0, 5:].set(jnp.inf)
    out = cudnn.cudnn_attention(q, k, v, kv_lengths=lengths, implementation="xla")
    assert_close(out, attention_ref(q, k, v, kv_lengths=lengths))


def test_gradient_is_the_references():
    q, k, v = qkv(dtype=jnp.float32, head_dim=16)

    def loss(impl):
        return lambda q, k, v: jnp.sum(jnp.sin(impl(q, k, v)))

    got = jax.jit(jax.grad(loss(lambda q, k, v: cudnn.cudnn_attention(
        q, k, v, sliding_window=3, implementation="xla")), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(lambda q, k, v: fj.attention(
        q, k, v, sliding_window=3, implementation="xla")), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


class TestAttentionCudnn(AttentionCases):
    """The real cuDNN call (skipped without a GPU of compute capability >= 8.0)."""

    IMPLEMENTATION = "cudnn"
    CASES = {
        f"{name}-{case_id(dtype)}": AttentionCase(
            tuple((QKV | shapes).values()), dtype,
            {n: np.asarray(a) if isinstance(a, jax.Array) else a for n, a in kw.items()},
            seed=(0, *((QKV | shapes)[n] for n in ("q_len", "kv_len", "head_dim"))))
        for name, (kw, shapes) in MAPPED.items() for dtype in (jnp.bfloat16, jnp.float16)}
    # cuDNN serves the causal mask only where its top-left alignment is the contract's
    # (q_len == kv_len, no kv_lengths), not the chunked prefill the per-query poisoning
    # needs (its own causal case: test_causally_hidden_nan_stays_out); its VJP is jax.nn's,
    # checked on CPU by test_gradient_is_the_references.
    test_nonfinite_reaches_only_the_queries_that_see_it = None
    test_gradients = None

    @classmethod
    def skip_reason(cls):
        return cudnn.device_reason(jax.default_backend())

    def test_causally_hidden_nan_stays_out(self):
        """A NaN key/value hidden by the causal mask must not reach earlier queries."""
        q, k, v = qkv(q_len=64, kv_len=64, dtype=jnp.bfloat16)
        k, v = k.at[:, 40:].set(jnp.nan), v.at[:, 40:].set(jnp.nan)
        out = fj.attention(q, k, v, implementation="cudnn")
        assert np.isfinite(np.asarray(out[:, :40], np.float32)).all()


def test_info_reports_it():
    text = str(backends.summary())
    assert "attention: cudnn (gpu) -> " in text
    assert "cuDNN flash attention (Ampere+): " in text
    if backends.gpu_compute_capability() is None:
        assert "attention: cudnn (gpu) -> unavailable: no GPU device in this process" in text
