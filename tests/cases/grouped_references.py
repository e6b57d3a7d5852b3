"""Independent float64 NumPy references for ``fj.grouped_matmul`` and the mixture-of-experts
ops (routing, permutation, the whole expert layer), written from their definitions with
explicit per-group and per-token loops; nothing here imports forge_jax or JAX."""

from __future__ import annotations

import numpy as np

from cases.references import f64


def group_rows(group_sizes, m):
    """``[(group, first row, end row)]`` of the groups' rows, clipped to ``m`` rows."""
    out, start = [], 0
    for i, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), m)
        out.append((i, start, end))
        start = end
    return out


def grouped_matmul_ref(x, w, group_sizes):
    """``out[r] = x[r] @ w[i]`` for the rows of group ``i``; rows of no group are zero."""
    x, w = f64(x), f64(w)
    out = np.zeros((x.shape[0], w.shape[2]))
    for i, start, end in group_rows(group_sizes, x.shape[0]):
        for r in range(start, end):
            out[r] = x[r] @ w[i]
    return out


def grouped_matmul_grads_ref(x, w, group_sizes, ct):
    """``(d x, d w)`` of ``sum(grouped_matmul(x, w) * ct)``: rows of no group and empty
    groups get zeros."""
    x, w, ct = f64(x), f64(w), f64(ct)
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    for i, start, end in group_rows(group_sizes, x.shape[0]):
        dx[start:end] = ct[start:end] @ w[i].T
        dw[i] = x[start:end].T @ ct[start:end]
    return dx, dw


def route_ref(logits, top_k, *, routing="softmax_topk", renormalize=False):
    """``(weights, expert_ids)`` per token: the ``top_k`` experts of largest logit (ties to
    the lower index), weighted by the softmax over all experts (optionally renormalised
    over the chosen ones) or, for ``"topk_softmax"``, by the softmax over the chosen."""
    logits = f64(logits)
    lead = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1])
    weights, ids = np.zeros((len(logits), top_k)), np.zeros((len(logits), top_k), np.int64)
    for t, row in enumerate(logits):
        chosen = sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k]
        p = np.exp(row - row.max())
        p /= p.sum()
        if routing == "topk_softmax":
            q = np.exp(row[chosen] - row[chosen].max())
            w = q / q.sum()
        else:
            w = p[chosen]
            if renormalize:
                w = w / w.sum()
        weights[t], ids[t] = w, chosen
    return weights.reshape(*lead, top_k), ids.reshape(*lead, top_k)


def moe_ref(x, w_gate, w_up, w_down, weights, expert_ids):
    """The dense per-token expert layer: ``out[t] = sum_j weights[t, j] * (silu(x[t] @
    w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]``, ``e = expert_ids[t, j]``."""
    x, w_gate, w_up, w_down, weights = map(f64, (x, w_gate, w_up, w_down, weights))
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(expert_ids)[t]):
            g, u = x[t] @ w_gate[e], x[t] @ w_up[e]
            h = g / (1.0 + np.exp(-g)) * u
            out[t] += weights[t, j] * (h @ w_down[e])
    return out
