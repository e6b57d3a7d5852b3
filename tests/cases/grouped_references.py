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
