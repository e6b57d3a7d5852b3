"""Independent float64 NumPy references for ``fj.gated_delta_rule`` and ``fj.causal_conv1d``:
the published recurrence token by token and the convolution tap by tap; nothing here imports
forge_jax or JAX. Shared by the op's tests and its kernels' tests."""

from __future__ import annotations

import numpy as np

from cases.references import f64


def gated_delta_ref(q, k, v, g, beta, *, state=None, lengths=None, scale=None, qk_l2norm=True):
    """``(out, new_state)`` of the gated delta rule, float64, token by token.

    q, k ``[batch, seq, k_heads, dk]``, v ``[batch, seq, v_heads, dv]``, g and beta
    ``[batch, seq, v_heads]``, state ``[batch, v_heads, dk, dv]``; tokens ``t >= lengths[b]``
    are skipped (zeros out, the state untouched)."""
    q, k, v, g, beta = (f64(x) for x in (q, k, v, g, beta))
    batch, seq, k_heads, dk = q.shape
    v_heads, dv = v.shape[2:]
    rep = v_heads // k_heads
    scale = dk ** -0.5 if scale is None else scale
    s = np.zeros((batch, v_heads, dk, dv)) if state is None else f64(state).copy()
    out = np.zeros((batch, seq, v_heads, dv))
    for b in range(batch):
        n = seq if lengths is None else int(lengths[b])
        for t in range(n):
            for h in range(v_heads):
                qt, kt = q[b, t, h // rep], k[b, t, h // rep]
                if qk_l2norm:
                    qt = qt / np.sqrt(qt @ qt + 1e-6)
                    kt = kt / np.sqrt(kt @ kt + 1e-6)
                qt = qt * scale
                st = s[b, h] * np.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - st.T @ kt)
                st = st + np.outer(kt, delta)
                s[b, h] = st
                out[b, t, h] = st.T @ qt
    return out, s


def causal_conv1d_ref(x, weight, bias=None, *, state=None, lengths=None, activation="silu"):
    """``(out, new_state)`` of the depthwise causal convolution, float64, tap by tap.

    x ``[batch, seq, channels]``, weight ``[kernel, channels]``, state ``[batch, kernel - 1,
    channels]``."""
    x, weight = f64(x), f64(weight)
    batch, seq, channels = x.shape
    kernel = weight.shape[0]
    prev = np.zeros((batch, kernel - 1, channels)) if state is None else f64(state)
    out = np.zeros((batch, seq, channels))
    new_state = np.zeros((batch, kernel - 1, channels))
    for b in range(batch):
        n = seq if lengths is None else int(lengths[b])
        xx = np.concatenate([prev[b], x[b, :n]], axis=0)  # [kernel - 1 + n, channels]
        for t in range(n):
            acc = np.zeros(channels) if bias is None else f64(bias).copy()
            for i in range(kernel):
                acc = acc + weight[i] * xx[t + i]
            out[b, t] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
        new_state[b] = xx[len(xx) - (kernel - 1):]
    return out, new_state
