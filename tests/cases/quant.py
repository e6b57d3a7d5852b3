"""Float64 NumPy references for quantized arrays: what a :class:`forge_jax.QuantizedArray`'s
stored parts stand for, read byte by byte (independent of forge_jax.quant)."""

from __future__ import annotations

import numpy as np


def nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[..., n]`` -> 4-bit values ``[..., 2n]``: element ``2j`` is byte ``j``'s low
    nibble, ``2j + 1`` its high nibble."""
    packed = np.asarray(packed, np.uint8)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.int64)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def dequantize(q) -> np.ndarray:
    """float64 ``x = scale * value (+ minimum)`` per block, from ``q``'s stored arrays."""
    values = np.asarray(q.values)
    if q.format == "int4":
        values = nibbles(values) - (0 if q.minimums is not None else 8)
    values = values.astype(np.float64)
    block = (1,) * (values.ndim - len(q.block)) + tuple(q.block)

    def spread(s):
        s = np.asarray(s, np.float64)
        for axis, b in enumerate(block):
            s = np.repeat(s, b, axis=axis)
        return s

    out = values * spread(q.scales)
    if q.minimums is not None:
        out = out + spread(q.minimums)
    return out



def dequantize_rounded(q, dtype) -> np.ndarray:
    """:func:`dequantize` rounded once to float32, then to ``dtype``, as float64: the
    weights a kernel that dequantizes ``scale * value + minimum`` in float32 (one fused
    multiply-add, as XLA on CPU and ptxas contract it) and rounds to ``dtype`` multiplies."""
    return dequantize(q).astype(np.float32).astype(np.dtype(dtype)).astype(np.float64)


def quantize_rows(a):
    """Per-row symmetric int8 quantization of activations, written out in NumPy float32 (the
    rule of :func:`forge_jax.quant.quantize_rows`): ``(q, scale)`` as float64, ``q`` integers
    in -127..127 and ``scale = max|a| / 127`` ``[..., 1]``."""
    a = np.asarray(a, np.float32)
    scale = np.abs(a).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.where(scale == 0, np.float32(0), np.float32(1) / np.where(scale == 0, 1, scale))
    q = np.clip(np.round(a * inv.astype(np.float32)), -127, 127)
    return q.astype(np.float64), scale.astype(np.float64)


def w8a8_product(a, q) -> np.ndarray:
    """float64 ``a @ W.T`` with W8A8 numerics for ``q`` an int8 ``[N, K]`` weight with scales
    per row and group along K: ``sa[m] * sum_g sw[n, g] * (qa[m, g] . qw[n, g])``, each
    integer dot exact."""
    qa, sa = quantize_rows(a)
    values = np.asarray(q.values, np.float64)
    scales = np.repeat(np.asarray(q.scales, np.float64), values.shape[0] // q.scales.shape[0],
                       axis=0)
    group = values.shape[1] // scales.shape[1]
    out = 0.0
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        out = out + (qa[..., cols] @ values[:, cols].T) * scales[:, g]
    return out * sa


def w8a8_error_bound(a, q) -> np.ndarray:
    """How far a W8A8 product may be from the float64 product with the dequantized weight:
    each activation moves by at most half a step (``sa / 2``), so ``|out - a @ W.T|`` is at
    most ``sa / 2 * sum_k |W[n, k]|`` (``[..., N]``)."""
    _, sa = quantize_rows(a)
    return sa / 2 * np.abs(dequantize(q)).sum(axis=-1)


def fp8_blocks(w: np.ndarray):
    """``w`` [out, in] -> (float8_e4m3fn torch weight, float32 torch weight_scale_inv
    [ceil(out / 128), ceil(in / 128)], the float64 weight they stand for)."""
    import math

    import torch

    rows, cols = w.shape
    nr, nc = math.ceil(rows / 128), math.ceil(cols / 128)
    padded = np.zeros((nr * 128, nc * 128))
    padded[:rows, :cols] = w
    scale = (np.abs(padded.reshape(nr, 128, nc, 128)).max(axis=(1, 3)) / 448).astype(np.float32)
    spread = np.repeat(np.repeat(scale.astype(np.float64), 128, 0), 128, 1)[:rows, :cols]
    q = torch.from_numpy((w / spread).astype(np.float32)).to(torch.float8_e4m3fn)
    return q, torch.from_numpy(scale), q.to(torch.float64).numpy() * spread
