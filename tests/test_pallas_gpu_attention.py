"""The Pallas GPU flash-attention kernel against a float64 reference of the attention contract
and the XLA implementation.

``TestFlashAttentionGpu`` runs the kernel compiled (``implementation="pallas"``) and is
skipped without a GPU; ``TestFlashAttentionInterpret`` runs the same cases in Pallas'
interpreter on any machine. The lowering tests export for CUDA here (Pallas -> Triton
lowering, no device needed).

The float64 reference below is written from the contract: positions default to
``kv_lengths[b] - q_len + t`` (bottom-right per sequence), only the visible keys enter a
query's softmax (so NaN in any other slot cannot reach it), NaN in a visible element
propagates, a query that sees no key gives zeros. Besides the slots no query sees, the
per-query tests poison slots that some queries of a sequence see and others do not.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.calls import case_id, jcall
from cases.checks import assert_close
from cases.inputs import normal, rng
from cases.references import f64

import forge_jax as fj
from forge_jax import _compat, tolerances
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import attention as flash

S = jax.ShapeDtypeStruct


# --- float64 reference of the contract -----------------------------------------------------


def _positions(batch, q_len, kv_len, q_positions, kv_lengths):
    if q_positions is not None:
        return np.asarray(q_positions, np.int64)
    ends = np.full(batch, kv_len) if kv_lengths is None else np.asarray(kv_lengths, np.int64)
    return ends[:, None] - q_len + np.arange(q_len)[None, :]


def visible64(batch, q_len, kv_len, *, causal=True, q_positions=None, kv_lengths=None,
              sliding_window=None, scale=None, logits_soft_cap=None):
    """Boolean ``[batch, q_len, kv_len]`` of the contract (takes and ignores the logit
    arguments, so that a case's keywords pass as they are)."""
    del scale, logits_soft_cap
    p = _positions(batch, q_len, kv_len, q_positions, kv_lengths)[:, :, None]
    j = np.arange(kv_len)[None, None, :]
    mask = np.ones((batch, q_len, kv_len), bool)
    if causal:
        mask &= j <= p
    if kv_lengths is not None:
        mask &= j < np.asarray(kv_lengths)[:, None, None]
    if sliding_window is not None:
        mask &= j > p - sliding_window
    return mask


def attention64(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                sliding_window=None, logits_soft_cap=None):
    """float64 attention; each query's softmax and weighted sum run over its visible keys only."""
    q, k, v = f64(q), f64(k), f64(v)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    mask = visible64(batch, q_len, kv_len, causal=causal, q_positions=q_positions,
                     kv_lengths=kv_lengths, sliding_window=sliding_window)
    out = np.zeros(q.shape)
    for b in range(batch):
        for t in range(q_len):
            idx = np.flatnonzero(mask[b, t])
            if idx.size == 0:
                continue
            for h in range(q_heads):
                s = scale * (k[b, idx, h // group] @ q[b, t, h])
                if logits_soft_cap is not None:
                    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                e = np.exp(s - s.max())
                out[b, t, h] = (e / e.sum()) @ v[b, idx, h // group]
    return out


def attention_grads64(q, k, v, g, *, scale=None, causal=True, q_positions=None,
                      kv_lengths=None, sliding_window=None, logits_soft_cap=None):
    """float64 ``(dq, dk, dv)`` of ``sum(attention * g)``; hidden keys get zero gradients."""
    q, k, v, g = f64(q), f64(k), f64(v), f64(g)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    mask = visible64(batch, q_len, kv_len, causal=causal, q_positions=q_positions,
                     kv_lengths=kv_lengths, sliding_window=sliding_window)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for h in range(q_heads):
            kh = h // group
            kk = np.where(mask[b].any(0)[:, None], k[b, :, kh], 0.0)
            vv = np.where(mask[b].any(0)[:, None], v[b, :, kh], 0.0)
            raw = scale * q[b, :, h] @ kk.T  # [t, s]
            s = raw if logits_soft_cap is None else logits_soft_cap * np.tanh(
                raw / logits_soft_cap)
            s = np.where(mask[b], s, -np.inf)
            m = s.max(-1, keepdims=True)
            e = np.where(mask[b], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
            total = e.sum(-1, keepdims=True)
            p = e / np.where(total > 0, total, 1.0)
            dv[b, :, kh] += p.T @ g[b, :, h]
            dp = g[b, :, h] @ vv.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            if logits_soft_cap is not None:
                ds = ds * (1.0 - np.tanh(raw / logits_soft_cap) ** 2)
            dq[b, :, h] = scale * ds @ kk
            dk[b, :, kh] += scale * ds.T @ q[b, :, h]
    return dq, dk, dv


def assert_close_nan(out, ref, *, dtype, implementation, err_msg=""):
    """Like :func:`assert_close`, for a reference with NaN: NaN exactly where ``ref`` is NaN."""
    out64, ref = f64(out), np.asarray(ref)
    np.testing.assert_array_equal(np.isnan(out64), np.isnan(ref), err_msg=err_msg)
    assert np.isnan(ref).any() and not np.isnan(ref).all(), err_msg
    tol = tolerances.tolerance(dtype, implementation)
    keep = ~np.isnan(ref)
    np.testing.assert_allclose(out64[keep], ref[keep], err_msg=err_msg, **tol.as_kwargs())


def poison_unseen(k, v, mask):
    """NaN in every K/V slot that no query of the sequence sees (``mask`` [b, t, s])."""
    unseen = ~mask.any(axis=1)[:, :, None, None]
    assert unseen.any(), "nothing to poison"
    return (jnp.where(unseen, jnp.asarray(np.nan, k.dtype), k),
            jnp.where(unseen, jnp.asarray(np.inf, v.dtype), v))


def poison_per_query(q, k, v, mask, *, seed):
    """Non-finite data hidden from some queries of a sequence and seen by others.

    Every slot of ``mask`` ``[b, t, s]`` that some but not all queries of its sequence see
    (the causal mask hides it from earlier queries, the window from later ones) gets one
    entry, cycling over a NaN key element, a NaN value and a +-inf value (random kv head
    and column); one query element of a query that sees keys is set to +inf where a key it
    sees is positive (a +inf logit). Returns the poisoned ``(q, k, v)`` and two boolean
    ``[b, t, q_heads, head_dim]`` masks: the outputs that must be NaN (their query sees a
    NaN or has a +inf logit) and those that must be non-finite (they read an inf value).
    """
    gen = rng(seed)
    q, k, v = np.array(q), np.array(k), np.array(v)  # writable copies, same dtype
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    must_nan = np.zeros(q.shape, bool)
    must_inf = np.zeros(q.shape, bool)
    kinds = ("k_nan", "v_nan", "v_inf", "v_-inf")
    for b in range(batch):
        partial = np.flatnonzero(mask[b].any(0) & ~mask[b].all(0))
        for i, j in enumerate(partial):
            kind = kinds[(b + i) % len(kinds)]
            kh, col = gen.integers(kv_heads), gen.integers(head_dim)
            heads, seers = slice(kh * group, (kh + 1) * group), mask[b, :, j]
            if kind == "k_nan":
                k[b, j, kh, col] = np.nan
                must_nan[b, seers, heads] = True
            else:
                v[b, j, kh, col] = {"v_nan": np.nan, "v_inf": np.inf, "v_-inf": -np.inf}[kind]
                (must_nan if kind == "v_nan" else must_inf)[b, seers, heads, col] = True
    assert must_nan.any() and must_inf.any(), "nothing poisoned"
    b, t = np.argwhere(mask.any(-1))[-1]
    h = gen.integers(q_heads)
    seen_k = np.asarray(k[b, mask[b, t], h // group], np.float64)
    col = int(np.nanargmax(np.nanmax(seen_k, axis=0)))
    assert np.nanmax(seen_k[:, col]) > 0
    q[b, t, h, col] = np.inf
    must_nan[b, t, h] = True
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), must_nan, must_inf


def assert_nonfinite_exactly(out, ref, must_nan, must_inf, *, dtype, implementation):
    """NaN where ``must_nan``, non-finite where ``must_inf``, elsewhere finite and close to
    the float64 ``ref`` (computed on clean data: what a query does not see is irrelevant)."""
    out64 = f64(out)
    clean = ~(must_nan | must_inf)
    assert clean.any() and np.isnan(out64[must_nan]).all()
    assert not np.isfinite(out64[must_inf]).any()
    assert np.isfinite(out64[clean]).all(), (
        f"non-finite data reached {np.argwhere(~np.isfinite(out64) & clean)[:8]} "
        "[batch, query, head, column], whose query does not see it")
    tol = tolerances.tolerance(dtype, implementation)
    np.testing.assert_allclose(out64[clean], np.asarray(ref)[clean], **tol.as_kwargs())


def inputs(seed, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
    gen = rng(seed)
    return (normal(gen, (batch, q_len, q_heads, head_dim), dtype),
            normal(gen, (batch, kv_len, kv_heads, head_dim), dtype),
            normal(gen, (batch, kv_len, kv_heads, head_dim), dtype))


# --- the kernel through fj.attention ---------------------------------------------------------

# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype): lengths end inside blocks.
SHAPES = [
    (1, 7, 21, 32, 8, 128, jnp.bfloat16),   # Llama 3 8B heads
    (1, 6, 45, 9, 3, 64, jnp.bfloat16),     # SmolLM2 135M heads
    (2, 5, 37, 12, 4, 80, jnp.float16),     # group 3, head dim 80
    (1, 9, 20, 14, 2, 96, jnp.float32),     # group 7, head dim 96
    (2, 17, 33, 4, 4, 32, jnp.float32),     # MHA
    (2, 3, 150, 8, 1, 64, jnp.bfloat16),    # MQA, three K blocks
    (1, 4, 20, 2, 1, 256, jnp.float32),     # largest head dim
]

MASKS = {
    "non_causal": dict(causal=False),
    "kv_lengths": dict(kv_lengths=np.array([150, 77])),
    "q_positions": dict(q_positions=np.array([[0, 3, 64, 65, 66, 70, 99, 120, 130, 140, 149],
                                              [-2, 0, 1, 2, 40, 41, 42, 43, 44, 45, 46]])),
    "window_soft_cap": dict(sliding_window=20, logits_soft_cap=2.0, scale=0.6),
    "non_causal_window_lengths": dict(causal=False, sliding_window=30,
                                      kv_lengths=np.array([100, 9])),
    "everything": dict(kv_lengths=np.array([140, 70]), sliding_window=33, logits_soft_cap=5.0,
                       q_positions=np.array([[5, 6, 7, 8, 50, 60, 70, 100, 110, 138, 139],
                                             [0, 10, 20, 30, 40, 50, 60, 69, 70, 80, -1]])),
}


def _jnp(kw):
    return {n: jnp.asarray(a, jnp.int32) if isinstance(a, np.ndarray) else a
            for n, a in kw.items()}


class TestFlashAttentionGpu:
    IMPLEMENTATION = "pallas"

    def setup_method(self):
        if self.IMPLEMENTATION == "pallas":
            reason = _common.gpu_reason(jax.default_backend())
            if reason:
                pytest.skip(reason)

    @property
    def interpret(self):
        return self.IMPLEMENTATION != "pallas"

    def run(self, q, k, v, **kw):
        return jcall(fj.attention, q, k, v, implementation=self.IMPLEMENTATION, **_jnp(kw))

    def check(self, q, k, v, *, xla=True, **kw):
        out = self.run(q, k, v, **kw)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_close(out, attention64(q, k, v, **kw), implementation=self.IMPLEMENTATION)
        if xla:
            want = jcall(fj.attention, q, k, v, implementation="xla", **_jnp(kw))
            assert_close(out, f64(want), implementation=self.IMPLEMENTATION, factor=2.0,
                         err_msg="against XLA")
        return out

    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "_".join(map(case_id, s)))
    def test_shapes(self, shape):
        *dims, dtype = shape
        q, k, v = inputs(1, *dims, dtype)
        self.check(q, k, v)

    @pytest.mark.parametrize("mask", MASKS)
    def test_masking(self, mask):
        kw = MASKS[mask]
        q, k, v = inputs(2, 2, 11, 150, 6, 2, 64, jnp.float32)
        self.check(q, k, v, **kw)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=case_id)
    def test_masking_low_precision_nan_in_unseen_slots(self, dtype):
        kw = MASKS["everything"]
        q, k, v = inputs(3, 2, 11, 150, 6, 2, 80, dtype)
        k, v = poison_unseen(k, v, visible64(2, 11, 150, **kw))
        self.check(q, k, v, **kw)

    @pytest.mark.parametrize("mask", ["positions", "kv_lengths"])
    def test_nan_in_every_unseen_slot(self, mask):
        if mask == "positions":  # the slots past the last query are unseen
            kw = dict(q_positions=np.array([[3, 4, 5, 9, 10, 11, 60, 61, 70, 71, 100]] * 2))
        else:
            kw = dict(MASKS[mask])
        q, k, v = inputs(4, 2, 11, 150, 6, 2, 64, jnp.float32)
        k, v = poison_unseen(k, v, visible64(2, 11, 150, **kw))
        self.check(q, k, v, **kw)

    def test_decode(self):
        kw = dict(kv_lengths=np.array([150, 3, 64]))
        q, k, v = inputs(5, 3, 1, 150, 8, 2, 128, jnp.bfloat16)
        k, v = poison_unseen(k, v, visible64(3, 1, 150, **kw))
        self.check(q, k, v, **kw)

    @pytest.mark.parametrize("kw,dtype", [
        (dict(kv_lengths=np.array([24, 13])), jnp.float32),
        (dict(kv_lengths=np.array([24, 9]), sliding_window=4), jnp.bfloat16),
    ], ids=["causal", "window"])
    def test_nonfinite_reaches_only_the_queries_that_see_it(self, kw, dtype):
        # Chunked prefill: the slots some queries of a program see and others do not hold
        # NaN/inf; each query's output is its float64 result on clean data, or NaN /
        # non-finite exactly where it sees a NaN / inf (or has a +inf logit).
        q, k, v = inputs(6, 2, 5, 24, 6, 2, 64, dtype)
        mask = visible64(2, 5, 24, **kw)
        ref = attention64(q, k, v, **kw)
        q, k, v, must_nan, must_inf = poison_per_query(q, k, v, mask, seed=6)
        out = self.run(q, k, v, **kw)
        assert_nonfinite_exactly(out, ref, must_nan, must_inf, dtype=dtype,
                                 implementation=self.IMPLEMENTATION)

    def test_nan_in_a_visible_query_propagates(self):
        # NaN/inf in keys and values: test_nonfinite_reaches_only_the_queries_that_see_it.
        q, k, v = inputs(7, 2, 5, 40, 6, 3, 64, jnp.bfloat16)
        q = q.at[1, 2, 4, 7].set(np.nan)  # query 2, head 4 of sequence 1
        out = self.run(q, k, v)
        assert_close_nan(out, attention64(q, k, v), dtype=jnp.bfloat16,
                         implementation=self.IMPLEMENTATION)

    def test_nan_scale_propagates(self):
        q, k, v = inputs(8, 1, 4, 16, 2, 1, 64, jnp.float32)
        out = self.run(q, k, v, scale=float("nan"),
                       q_positions=np.array([[-1, 0, 5, 15]]))  # query 0 sees nothing
        assert np.isnan(f64(out[0, 1:])).all()
        np.testing.assert_array_equal(f64(out[0, 0]), 0.0)

    def test_queries_that_see_no_key_give_zeros(self):
        kw = dict(q_positions=np.array([[-5, -1, 0, 40], [3, 4, 5, 6]]),
                  kv_lengths=np.array([41, 0]))
        q, k, v = inputs(9, 2, 4, 41, 4, 2, 64, jnp.float16)
        k, v = poison_unseen(k, v, visible64(2, 4, 41, **kw))
        out = self.run(q, k, v, **kw)
        np.testing.assert_array_equal(f64(out[0, :2]), 0.0)
        np.testing.assert_array_equal(f64(out[1]), 0.0)
        assert_close(out[0, 2:], attention64(q, k, v, **kw)[0, 2:],
                     implementation=self.IMPLEMENTATION)

    def test_small_blocks_skip_masked_blocks(self):
        # 16-row/16-key blocks: rows of one program straddle queries, most K/V blocks lie
        # outside the window or past kv_lengths, where the slots hold NaN.
        kw = dict(kv_lengths=np.array([100, 37]), sliding_window=9, logits_soft_cap=3.0)
        q, k, v = inputs(10, 2, 13, 100, 6, 2, 80, jnp.float32)
        k, v = poison_unseen(k, v, visible64(2, 13, 100, **kw))
        fn = functools.partial(flash.flash_attention, block_q=16, block_k=16,
                               interpret=self.interpret)
        out = jcall(fn, q, k, v, **_jnp(kw))
        assert_close(out, attention64(q, k, v, **kw), implementation=self.IMPLEMENTATION)

    @pytest.mark.parametrize("kw", [
        dict(kv_lengths=np.array([30, 12]), q_positions=np.array([[22, 25, 29], [4, 8, 11]])),
        dict(sliding_window=5, logits_soft_cap=4.0, causal=False),
    ], ids=["lengths_positions", "window_cap"])
    def test_gradients(self, kw):
        q, k, v = inputs(11, 2, 3, 30, 6, 2, 80, jnp.float32)
        if "kv_lengths" in kw:
            k, v = poison_unseen(k, v, visible64(2, 3, 30, **kw))
        g = normal(rng(12), q.shape, jnp.float32)

        def grads(implementation):
            def loss(q, k, v):
                out = fj.attention(q, k, v, implementation=implementation, **_jnp(kw))
                return jnp.sum(out * g)
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

        got = grads(self.IMPLEMENTATION)
        want64 = attention_grads64(q, k, v, g, **kw)
        xla = grads("xla")
        for name, a, ref, x in zip("qkv", got, want64, xla, strict=True):
            assert_close(a, ref, implementation=self.IMPLEMENTATION, factor=4.0,
                         err_msg=f"d{name} against float64")
            if "kv_lengths" not in kw:  # the XLA VJP sees the NaN slots too
                assert_close(a, f64(x), implementation=self.IMPLEMENTATION, factor=4.0,
                             err_msg=f"d{name} against XLA")


class TestFlashAttentionInterpret(TestFlashAttentionGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"


# --- the contract with the CUDA lowering ---------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=case_id)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_supported_cases_lower_for_cuda(dtype, head_dim):
    args = dict(q=S((2, 5, 12, head_dim), dtype), k=S((2, 37, 4, head_dim), dtype),
                v=S((2, 37, 4, head_dim), dtype))
    assert flash.supports(args) is None
    exported = _compat.export_for_cuda(
        lambda q, k, v, lengths, pos: flash.flash_attention(
            q, k, v, kv_lengths=lengths, q_positions=pos, sliding_window=7,
            logits_soft_cap=5.0),
        *args.values(), S((2,), jnp.int32), S((2, 5), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(kv_lengths=True)],
                         ids=["causal", "non_causal", "kv_lengths"])
def test_decode_and_gradients_lower_for_cuda(kw):
    q, kv = S((3, 1, 14, 64), jnp.bfloat16), S((3, 70, 2, 64), jnp.bfloat16)
    lengths = jnp.array([70, 5, 33], jnp.int32) if kw.pop("kv_lengths", False) else None

    def loss(q, k, v):
        out = flash.flash_attention(q, k, v, kv_lengths=lengths, **kw)
        return jnp.sum(out.astype(jnp.float32))

    _compat.export_for_cuda(lambda q, k, v: flash.flash_attention(q, k, v, kv_lengths=lengths,
                                                                  **kw), q, kv, kv)
    _compat.export_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)


def test_float32_dots_are_ieee_not_tf32(monkeypatch, capsys):
    # pallas_call(debug=True) prints the Triton IR; a float32 tt.dot must not ask for TF32.
    debug_pl = types.SimpleNamespace(**{n: getattr(flash.pl, n) for n in dir(flash.pl)
                                        if not n.startswith("__")})
    debug_pl.pallas_call = functools.partial(flash.pl.pallas_call, debug=True)
    monkeypatch.setattr(flash, "pl", debug_pl)
    x = S((1, 4, 2, 64), jnp.float32)
    _compat.export_for_cuda(flash.flash_attention, x, x, x)
    dots = [line for line in capsys.readouterr().out.splitlines() if "tt.dot" in line]
    assert len(dots) >= 2 and all("xf32>" in d for d in dots), dots
    assert not any("tf32" in d for d in dots), dots


@pytest.mark.parametrize("q_dtype,kv_dtype,head_dim,reason", [
    (jnp.int8, jnp.int8, 64, "q.dtype=int8"),
    (np.float64, np.float64, 64, "q.dtype=float64"),
    (jnp.bfloat16, jnp.float32, 64, "equal operand types"),
    (jnp.float32, jnp.float32, 512, "head_dim=512"),
], ids=["int8", "float64", "mixed", "head_dim_512"])
def test_supports_rejects(q_dtype, kv_dtype, head_dim, reason):
    args = dict(q=S((1, 4, 2, head_dim), q_dtype), k=S((1, 8, 2, head_dim), kv_dtype),
                v=S((1, 8, 2, head_dim), kv_dtype))
    assert reason in flash.supports(args)


def test_mixed_dtypes_fail_the_lowering_when_forced():
    q, kv = S((1, 4, 2, 64), jnp.bfloat16), S((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="same element type"):
        _compat.export_for_cuda(flash.flash_attention, q, kv, kv)


def test_rejected_case_is_refused_by_name():
    q, k, v = inputs(13, 1, 4, 8, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(fj.ImplementationError, match="equal operand types"):
        fj.attention(q, k.astype(jnp.float32), v.astype(jnp.float32),
                     implementation="pallas_gpu_interpret")


def test_blocks_must_be_powers_of_two():
    x = S((1, 4, 2, 64), jnp.bfloat16)
    for bad in (dict(block_q=24), dict(block_k=8)):
        with pytest.raises(ValueError, match="power of two"):
            _compat.export_for_cuda(functools.partial(flash.flash_attention, **bad), x, x, x)


def test_launch_table():
    default = _common.TUNING["default"]["attention"]
    assert flash.launch_params(80) == flash.Launch(**default[128])
    assert flash.launch_params(8) == flash.Launch(**default[64])
    assert flash.launch_params(256, "unknown GPU") == flash.Launch(**default[256])
    h100 = _common.TUNING["H100"]["attention"]
    assert flash.launch_params(128, "NVIDIA H100 80GB HBM3") == flash.Launch(**h100[128])
    for kind in _common.TUNING:
        for knobs in _common.TUNING[kind].get("attention", {}).values():
            launch = flash.Launch(**knobs)
            assert all(b >= _common.MIN_DOT and b & (b - 1) == 0
                       for b in (launch.block_q, launch.block_k))


def test_registered():
    names = fj.dispatch.implementations("attention")
    assert "pallas_gpu_interpret" in names
    assert flash.VERIFIED == {}
