"""An independent float64 NumPy reference for ``fj.conv2d``: explicit loops over output
positions and kernel taps (no library convolution); nothing here imports forge_jax or JAX."""

from __future__ import annotations

import numpy as np

from cases.references import f64


def conv2d_ref(x, w, *, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1,
               layout="NHWC"):
    """Cross-correlation of ``x`` with ``w`` (NHWC with HWIO weights, or NCHW with OIHW),
    explicit padding ``((top, bottom), (left, right))``."""
    x, w = f64(x), f64(w)
    if layout == "NCHW":
        x, w = x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0)
    batch, h, wd, cin = x.shape
    kh, kw, cg, cout = w.shape
    (t, b), (left, r) = padding
    xp = np.zeros((batch, h + t + b, wd + left + r, cin))
    xp[:, t:t + h, left:left + wd] = x
    (sh, sw), (dh, dw) = stride, dilation
    oh = (xp.shape[1] - (kh - 1) * dh - 1) // sh + 1
    ow = (xp.shape[2] - (kw - 1) * dw - 1) // sw + 1
    per_group = cout // groups
    out = np.zeros((batch, oh, ow, cout))
    for o in range(cout):
        c0 = (o // per_group) * cg
        for i in range(oh):
            for j in range(ow):
                for p in range(kh):
                    for q in range(kw):
                        patch = xp[:, i * sh + p * dh, j * sw + q * dw, c0:c0 + cg]  # [b, cg]
                        out[:, i, j, o] += patch @ w[p, q, :, o]
    return out.transpose(0, 3, 1, 2) if layout == "NCHW" else out
