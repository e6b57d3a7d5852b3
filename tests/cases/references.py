"""Independent float64 NumPy references for the forge_jax ops.

Written from the op specifications (the ops' docstrings, Hugging Face transformers'
RoPE definitions), not from forge_jax's code: nothing here imports forge_jax or JAX.
Every function takes NumPy (or JAX) arrays of any float dtype, upcasts them to
float64 and returns float64, so tests compare an op's output against the exact
result for the inputs the op actually received (round inputs to the op's dtype
first, see :func:`round_to`).
"""

from __future__ import annotations

import math

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np


def f64(x) -> np.ndarray:
    """``x`` as a float64 NumPy array (works for bfloat16 JAX arrays too)."""
    return np.asarray(x).astype(np.float64)


def round_to(x, dtype) -> np.ndarray:
    """``x`` rounded to ``dtype`` (e.g. bfloat16) and returned as float64."""
    return np.asarray(x, np.float64).astype(np.dtype(dtype)).astype(np.float64)


# --- matmul -------------------------------------------------------------------------------


def matmul_ref(a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None):
    """``alpha * op(a) @ op(b) + beta * c`` with broadcasting batch dimensions."""
    a, b = f64(a), f64(b)
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    # Explicit sum over K instead of np.matmul, so that the reference does not share a
    # BLAS code path with anything: out[..., m, n] = sum_k a[..., m, k] * b[..., k, n].
    out = (a[..., :, :, None] * b[..., None, :, :]).sum(axis=-2)
    out = float(alpha) * out
    if c is not None:
        out = out + float(beta) * f64(c)
    return out


# --- norms and activations ----------------------------------------------------------------


def rms_norm_ref(x, weight, *, eps=1e-6, residual=None, h_dtype=None):
    """RMSNorm of ``h = x (+ residual)``.

    Args:
      h_dtype: if given, ``h`` is rounded to this dtype before it is normalised (the
        documented semantics of the fused add-and-norm: the residual stream is stored
        in ``x.dtype`` and exactly that is normalised).

    Returns:
      ``y`` when ``residual`` is None, else ``(y, h)`` with ``h`` unrounded.
    """
    x, w = f64(x), f64(weight)
    h = x if residual is None else x + f64(residual)
    hn = round_to(h, h_dtype) if h_dtype is not None else h
    y = w * hn / np.sqrt(np.mean(hn**2, axis=-1, keepdims=True) + eps)
    return y if residual is None else (y, h)


def sigmoid_ref(x):
    x = f64(x)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # Overflow-free form of 1 / (1 + exp(-x)).


def silu_mul_ref(gate, up):
    g = f64(gate)
    return g * sigmoid_ref(g) * f64(up)


def gelu_tanh_mul_ref(gate, up):
    """``gelu_tanh(gate) * up`` in float64, tanh-approximate GELU written out."""
    g = f64(gate)
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * f64(up)


def softmax_ref(x, *, axis=-1, where=None):
    """Masked softmax; ``-inf`` entries count as masked; a row with nothing valid -> zeros;
    ``+inf`` entries share their row equally; NaN in a valid entry makes its row NaN."""
    x = f64(x)
    valid = x != -np.inf
    if where is not None:
        valid = valid & np.broadcast_to(np.asarray(where, bool), x.shape)
    x = np.moveaxis(x, axis, -1)
    valid = np.moveaxis(valid, axis, -1)
    out = np.zeros_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row, ok = x[idx], valid[idx]
        if not ok.any():
            continue
        if np.isnan(row[ok]).any():
            out[idx][:] = np.nan
            continue
        if np.isposinf(row[ok]).any():
            top = ok & np.isposinf(row)
            out[idx][top] = 1.0 / top.sum()
            continue
        e = np.exp(row[ok] - row[ok].max())
        out[idx][ok] = e / e.sum()
    return np.moveaxis(out, -1, axis)


# --- RoPE ---------------------------------------------------------------------------------


def rope_inv_freq_ref(head_dim, *, theta=10000.0, scaling=None):
    """The RoPE inverse frequencies as Hugging Face transformers defines them.

    ``inv_freq[i] = 1 / theta ** (2i / head_dim)``; ``scaling`` is None or an object with
    ``kind``, ``factor`` and (llama3) ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings`` attributes:

    * linear (``_compute_linear_scaling_rope_parameters``): ``inv_freq / factor``;
    * llama3 (``_compute_llama3_parameters``): wavelengths ``2 pi / f`` shorter than
      ``old / high_freq_factor`` keep ``f``, longer than ``old / low_freq_factor`` get
      ``f / factor``, and in between ``(1 - s) f / factor + s f`` with
      ``s = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

    HF keeps the table in float32, so the result is rounded to float32 (returned as
    float64).
    """
    freqs = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        if scaling is not None and scaling.kind == "linear":
            f = f / scaling.factor
        elif scaling is not None and scaling.kind == "llama3":
            old = scaling.original_max_position_embeddings
            low, high = scaling.low_freq_factor, scaling.high_freq_factor
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                pass
            elif wavelen > old / low:
                f = f / scaling.factor
            else:
                s = (old / wavelen - low) / (high - low)
                f = (1 - s) * f / scaling.factor + s * f
        elif scaling is not None:
            raise ValueError(f"unknown scaling kind {scaling.kind!r}")
        freqs.append(f)
    return round_to(np.array(freqs), np.float32)


def rope_angles_ref(positions, head_dim, *, theta=10000.0, scaling=None):
    """``positions * inv_freq``, ``[..., head_dim // 2]``.

    The angle is the float32 product (what HF computes, and what the op documents:
    float32 angles); the product of two float32 numbers is exact in float64, so
    rounding it once to float32 gives exactly the float32 product.
    """
    pos = round_to(np.asarray(positions), np.float32)
    inv = rope_inv_freq_ref(head_dim, theta=theta, scaling=scaling)
    return round_to(pos[..., None] * inv, np.float32)


def rope_cos_sin_ref(positions, head_dim, *, theta=10000.0, scaling=None):
    angles = rope_angles_ref(positions, head_dim, theta=theta, scaling=scaling)
    return np.cos(angles), np.sin(angles)


def rope_ref(x, positions, *, theta=10000.0, scaling=None, interleaved=False):
    """RoPE on ``x [batch, seq, heads, head_dim]`` at ``positions [batch, seq]``.

    ``interleaved=False``: HF ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin``
    tables of the frequencies repeated twice (``cat((freqs, freqs))``) and
    ``rotate_half(x) = cat(-x2, x1)``. ``interleaved=True``: the pair
    ``(x[2i], x[2i+1])`` is the complex number ``x[2i] + i x[2i+1]`` multiplied by
    ``exp(i angle_i)`` (the original Meta code).
    """
    x = f64(x)
    head_dim = x.shape[-1]
    angles = rope_angles_ref(positions, head_dim, theta=theta, scaling=scaling)[:, :, None, :]
    if interleaved:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    emb = np.concatenate([angles, angles], axis=-1)
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


# --- attention and embedding --------------------------------------------------------------


def attention_mask_ref(batch, q_len, kv_len, *, causal=True, q_positions=None,
                       kv_lengths=None, sliding_window=None, scale=None, logits_soft_cap=None,
                       attention_chunk_size=None, sinks=None):
    """Boolean ``[batch, q_len, kv_len]``: key ``j`` visible to the query at position ``p``
    iff ``(not causal or j <= p) and j < kv_lengths[b] and j > p - sliding_window`` and,
    with chunked attention, ``floor(j / c) == floor(p / c)``.

    Positions default to bottom-right alignment per sequence, ``kv_lengths[b] - q_len + t``
    (``kv_len - q_len + t`` without lengths). ``scale`` and ``logits_soft_cap`` change no
    visibility; they are taken (and ignored) so that an attention call's keywords pass as
    they are (and ``sinks``, which hide nothing).
    """
    del scale, logits_soft_cap, sinks
    if q_positions is None:
        ends = (np.full(batch, kv_len) if kv_lengths is None
                else np.asarray(kv_lengths, np.int64))
        q_positions = ends[:, None] - q_len + np.arange(q_len)[None, :]
    p = np.broadcast_to(np.asarray(q_positions, np.int64), (batch, q_len))[:, :, None]
    j = np.arange(kv_len)[None, None, :]
    mask = np.ones((batch, q_len, kv_len), bool)
    if causal:
        mask &= j <= p
    if kv_lengths is not None:
        mask &= j < np.asarray(kv_lengths, np.int64)[:, None, None]
    if sliding_window is not None:
        mask &= j > p - sliding_window
    if attention_chunk_size is not None:
        mask &= np.floor_divide(j, attention_chunk_size) == np.floor_divide(
            p, attention_chunk_size)
    return mask


def attention_ref(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                  sliding_window=None, logits_soft_cap=None, sinks=None,
                  attention_chunk_size=None):
    """Scaled dot-product attention, float64.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]``.
      k, v: ``[batch, kv_len, kv_heads, head_dim]`` with ``q_heads % kv_heads == 0``;
        query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      causal, q_positions, kv_lengths, sliding_window: the visibility rule of
        :func:`attention_mask_ref`; positions default to bottom-right alignment per
        sequence, ``kv_lengths[b] - q_len + t`` (``kv_len - q_len + t`` without lengths).
      logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax.
      sinks: ``[q_heads]``, attention sinks: ``exp(sinks[h])`` joins the denominator of
        every query of head ``h`` (gpt-oss).
      attention_chunk_size: chunked attention (:func:`attention_mask_ref`).

    Returns:
      float64 ``[batch, q_len, q_heads, head_dim]``; a query that sees no key gives zeros.
    """
    q, k, v = f64(q), f64(k), f64(v)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    assert q_heads % kv_heads == 0, (q.shape, k.shape)
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    mask = attention_mask_ref(batch, q_len, kv_len, causal=causal, q_positions=q_positions,
                              kv_lengths=kv_lengths, sliding_window=sliding_window,
                              attention_chunk_size=attention_chunk_size)
    out = np.zeros((batch, q_len, q_heads, v.shape[-1]))
    for b in range(batch):
        for h in range(q_heads):
            kh = h // group
            logits = scale * (q[b, :, h, :] @ k[b, :, kh, :].T)  # [q_len, kv_len]
            if logits_soft_cap is not None:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            if sinks is None:
                probs = softmax_ref(logits, axis=-1, where=mask[b])
            else:  # the sink as one more (always visible) logit whose probability is dropped
                sink = np.full((q_len, 1), float(f64(sinks)[h]))
                probs = softmax_ref(np.concatenate([logits, sink], axis=-1), axis=-1,
                                    where=np.concatenate([mask[b], np.ones((q_len, 1), bool)],
                                                         axis=-1))[:, :-1]
                probs = np.where(mask[b].any(-1, keepdims=True), probs, 0.0)
            # Only visible values enter the sum (an invisible NaN must not reach it).
            vh = v[b, :, kh, :]
            for t in range(q_len):
                seen = mask[b, t]
                out[b, t, h, :] = probs[t, seen] @ vh[seen]
    return out


def attention_grads_ref(q, k, v, g, *, scale=None, causal=True, q_positions=None,
                        kv_lengths=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                        attention_chunk_size=None):
    """float64 ``(dq, dk, dv)`` of ``sum(attention_ref(q, k, v) * g)``, and ``dsinks`` as a
    fourth entry when ``sinks`` are given.

    Hidden keys get zero gradients, whatever they hold (NaN included): they enter neither
    the logits nor the weighted sum. A sink weighs no value: its logit's gradient is
    ``-p_sink * sum_j p_j dp_j`` over each query of its head.
    """
    q, k, v, g = f64(q), f64(k), f64(v), f64(g)
    batch, q_len, q_heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    mask = attention_mask_ref(batch, q_len, kv_len, causal=causal, q_positions=q_positions,
                              kv_lengths=kv_lengths, sliding_window=sliding_window,
                              attention_chunk_size=attention_chunk_size)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(q_heads)
    for b in range(batch):
        for h in range(q_heads):
            kh = h // group
            kk = np.where(mask[b].any(0)[:, None], k[b, :, kh], 0.0)
            vv = np.where(mask[b].any(0)[:, None], v[b, :, kh], 0.0)
            raw = scale * q[b, :, h] @ kk.T  # [q_len, kv_len]
            s = raw if logits_soft_cap is None else logits_soft_cap * np.tanh(
                raw / logits_soft_cap)
            s = np.where(mask[b], s, -np.inf)
            m = s.max(-1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, float(f64(sinks)[h]))
            shift = np.where(np.isfinite(m), m, 0.0)
            e = np.where(mask[b], np.exp(s - shift), 0.0)
            total = e.sum(-1, keepdims=True)
            e_sink = 0.0
            if sinks is not None:  # rows that see no key keep zeros
                e_sink = np.where(mask[b].any(-1, keepdims=True),
                                  np.exp(float(f64(sinks)[h]) - shift), 0.0)
                total = total + e_sink
            p = e / np.where(total > 0, total, 1.0)
            dv[b, :, kh] += p.T @ g[b, :, h]
            dp = g[b, :, h] @ vv.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            p_sink = e_sink / np.where(total > 0, total, 1.0)
            dsinks[h] -= np.sum(p_sink * (dp * p).sum(-1, keepdims=True))
            if logits_soft_cap is not None:
                ds = ds * (1.0 - np.tanh(raw / logits_soft_cap) ** 2)
            dq[b, :, h] = scale * ds @ kk
            dk[b, :, kh] += scale * ds.T @ q[b, :, h]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def ragged_paged_attention_ref(step, *, scale=None, sliding_window=None,
                               logits_soft_cap=None, sinks=None, attention_chunk_size=None):
    """float64 ragged paged attention of a step (``cases.paged.Step``: ``q [rows, q_heads,
    head_dim]``, the dense ``[num_seqs, capacity, kv_heads, head_dim]`` keys and values of
    its sequences, ``cu_q_lens``, ``kv_lengths``, ``num_seqs``).

    From the ragged definition: row ``r`` of sequence ``i`` is the query at position
    ``kv_lengths[i] - (cu_q_lens[i + 1] - r)``, attending causally over that sequence's
    ``kv_lengths[i]`` keys; rows past ``cu_q_lens[num_seqs]`` are zero.
    """
    q = f64(step.q)
    cu, kv = np.asarray(step.cu_q_lens), np.asarray(step.kv_lengths)
    out = np.zeros(q.shape)
    for i in range(step.num_seqs):
        n = int(cu[i + 1] - cu[i])
        if n == 0:
            continue
        positions = kv[i] - n + np.arange(n)
        out[cu[i]:cu[i + 1]] = attention_ref(
            q[None, cu[i]:cu[i + 1]], step.dense_k[i][None], step.dense_v[i][None],
            q_positions=positions[None], kv_lengths=kv[i:i + 1], scale=scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            attention_chunk_size=attention_chunk_size)[0]
    return out


def embedding_ref(table, ids):
    return f64(table)[np.asarray(ids)]
