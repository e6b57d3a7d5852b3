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
