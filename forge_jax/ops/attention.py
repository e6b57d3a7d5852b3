"""Scaled dot-product attention with bottom-right causal alignment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks, dispatch
from forge_jax.ops.activation import safe_softmax_f32


def check_masking(*, scale, sliding_window, logits_soft_cap):
    """Validates the static masking arguments shared by dense and paged attention."""
    if scale is not None:
        scale = _checks.number("scale", scale)
    sliding_window = _checks.positive_int("sliding_window", sliding_window, allow_none=True)
    logits_soft_cap = _checks.positive_float("logits_soft_cap", logits_soft_cap, allow_none=True)
    return scale, sliding_window, logits_soft_cap


def check_heads(q_heads, kv_heads, q_shape, kv_shape):
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}): "
            f"q.shape={tuple(q_shape)}, k.shape={tuple(kv_shape)}")


def _attention_args(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None):
    _checks.array("q", q, ndim=4)
    _checks.array("k", k, ndim=4)
    _checks.array("v", v, ndim=4)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape: {k.shape=}, {v.shape=}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k disagree on batch: {q.shape=}, {k.shape=}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k disagree on head_dim: {q.shape=}, {k.shape=}")
    check_heads(q.shape[2], k.shape[2], q.shape, k.shape)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal=!r}")
    causal = bool(causal)
    batch, q_len = q.shape[:2]
    if q_positions is not None:
        _checks.array("q_positions", q_positions, ndim=2, kind="int")
        if tuple(q_positions.shape) != (batch, q_len):
            raise ValueError(
                f"q_positions must be [batch, q_len] = {(batch, q_len)}, got {q_positions.shape=}")
    if kv_lengths is not None:
        _checks.array("kv_lengths", kv_lengths, ndim=1, kind="int")
        if kv_lengths.shape[0] != batch:
            raise ValueError(f"kv_lengths must be [batch] = ({batch},), got {kv_lengths.shape=}")
    scale, sliding_window, logits_soft_cap = check_masking(
        scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return dict(q=q, k=k, v=v, scale=scale, causal=causal, q_positions=q_positions,
                kv_lengths=kv_lengths, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap)


def attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
              sliding_window=None, logits_soft_cap=None, implementation=None):
    """Multi-head scaled dot-product attention (MHA, GQA and MQA).

    ``out[b, t, h] = sum_j p[b, h, t, j] * v[b, j, h // g]`` with
    ``p = softmax_j(cap(scale * q[b, t, h] . k[b, j, h // g]))`` over the visible keys,
    ``g = q_heads // kv_heads`` and ``cap(x) = logits_soft_cap * tanh(x / logits_soft_cap)``
    when a soft cap is given. Logits, softmax and the weighted sum are float32.

    Masking: a query at absolute position ``p`` sees key ``j`` iff
    ``(not causal or j <= p)``, ``j < kv_lengths[b]`` (when given) and
    ``j > p - sliding_window`` (when given). Positions default to bottom-right
    alignment, ``p = kv_len - q_len + t``: the last query sits at the last key, which
    is what decode (q_len 1) and chunked prefill need. (``jax.nn.dot_product_attention``
    aligns top-left, so a decode query there would see only key 0.) A query that
    sees no key returns zeros.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]``, ``q_heads % kv_heads == 0``.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      causal: apply the causal mask.
      q_positions: optional int ``[batch, q_len]``, each query's position among the keys.
      kv_lengths: optional int ``[batch]``, the number of valid keys of each sequence.
      sliding_window: optional positive int, keys further back than this are hidden
        (a query sees itself and the ``sliding_window - 1`` keys before it).
      logits_soft_cap: optional positive float.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``.
    """
    args = _attention_args(q, k, v, scale=scale, causal=causal, q_positions=q_positions,
                           kv_lengths=kv_lengths, sliding_window=sliding_window,
                           logits_soft_cap=logits_soft_cap)
    return dispatch.call("attention", args, implementation)


dispatch.define("attention", _attention_args)


def visible_mask(q_positions, kv_len, *, causal, kv_lengths, sliding_window):
    """Boolean ``[batch, q_len, kv_len]``: which keys each query may see."""
    j = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    p = q_positions.astype(jnp.int32)[:, :, None]
    mask = jnp.ones((q_positions.shape[0], q_positions.shape[1], kv_len), jnp.bool_)
    if causal:
        mask &= j <= p
    if kv_lengths is not None:
        mask &= j < kv_lengths.astype(jnp.int32)[:, None, None]
    if sliding_window is not None:
        # A window wider than any int32 position distance hides nothing; clamping it keeps
        # `p - window` inside int32 (positions are assumed to lie in [-2**30, 2**30)).
        mask &= j > p - min(sliding_window, 2**30)
    return mask


def masked_probs(logits, mask, *, scale, logits_soft_cap):
    """float32 attention probabilities: ``softmax(cap(scale * logits))`` over the visible keys
    (the last axis), zeros for a query that sees none. ``mask`` broadcasts to ``logits``."""
    logits = logits * jnp.asarray(scale, jnp.float32)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    return safe_softmax_f32(logits, -1, mask)


def attention_reference(q, k, v, *, scale, causal, q_positions, kv_lengths, sliding_window,
                        logits_soft_cap):
    """The XLA implementation: materialises the ``[batch, heads, q_len, kv_len]`` logits."""
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    if scale is None:
        scale = head_dim ** -0.5
    if q_positions is None:
        q_positions = jnp.broadcast_to(
            kv_len - q_len + jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
    qg = q.reshape(batch, q_len, kv_heads, groups, head_dim)
    if q.dtype != k.dtype:
        qg, k = qg.astype(jnp.float32), k.astype(jnp.float32)
    # Products of two bfloat16/float16 values are exact in float32, so equal low-precision
    # operands stay as they are; float32 ones ask for full precision, since GPUs default to
    # TF32 and TPUs to bfloat16 passes for float32 dots (free on CPU).
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32,
                        precision=jax.lax.Precision.HIGHEST)
    mask = visible_mask(q_positions, kv_len, causal=causal, kv_lengths=kv_lengths,
                        sliding_window=sliding_window)
    probs = masked_probs(logits, mask[:, None, None, :, :], scale=scale,
                         logits_soft_cap=logits_soft_cap)  # [b, k, g, t, s]
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32),
                     preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, q_len, q_heads, head_dim).astype(q.dtype)


@dispatch.register("attention", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="einsum + masked float32 softmax")
def attention_xla(q, k, v, **kw):
    with jax.named_scope("attention"):
        return attention_reference(q, k, v, **kw)
