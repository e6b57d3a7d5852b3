"""Quantized KV pools for tests, built in NumPy (independently of forge_jax.quant) from the
poisoned float pools of :mod:`cases.paged`: every slot that holds finite data there is
quantized (a scale per token and KV head); every other slot, the ones no query may see,
gets a NaN scale and random bytes as values (for fp8 these include e4m3's NaN codes). The
float64 truth is then what the stored parts stand for (:func:`cases.quant.dequantize`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cases.quant import dequantize
from forge_jax.quant import QuantizedArray

QMAX = {"int8": 127.0, "fp8": 448.0}
FORMATS = ("int8", "fp8")


def quantize_vectors(x: np.ndarray, format: str) -> tuple[np.ndarray, np.ndarray]:
    """``x [..., d]`` (finite) -> ``(values, float32 scales [..., 1])``, round to nearest."""
    x = np.asarray(x, np.float64)
    scales = (np.abs(x).max(axis=-1, keepdims=True) / QMAX[format]).astype(np.float32)
    inv = np.where(scales == 0, 0.0, 1.0 / np.where(scales == 0, 1.0, scales.astype(np.float64)))
    if format == "int8":
        return np.clip(np.round(x * inv), -127, 127).astype(np.int8), scales
    return (x * inv).astype(ml_dtypes.float8_e4m3fn), scales


def quantized_pool(gen, pool, format: str) -> QuantizedArray:
    """A float pool ``[..., head_dim]`` as an ``format`` pool: each all-finite vector quantized,
    every other slot a NaN scale over random bytes."""
    pool = np.asarray(pool, np.float64)
    finite = np.isfinite(pool).all(axis=-1, keepdims=True)
    values, scales = quantize_vectors(np.where(finite, pool, 0.0), format)
    junk = gen.integers(0, 256, pool.shape, dtype=np.uint8)
    junk = junk.view(np.int8) if format == "int8" else junk.view(ml_dtypes.float8_e4m3fn)
    values = np.where(finite, values, junk)
    scales = np.where(finite, scales, np.float32(np.nan)).astype(np.float32)
    return QuantizedArray(jnp.asarray(values), jnp.asarray(scales), None, format,
                          (pool.shape[-1],), jnp.float32)


def dense_from_pool(pool: QuantizedArray, tables, lengths) -> np.ndarray:
    """float64 ``[batch, max_pages * page_size, kv_heads, head_dim]``: each sequence's slots
    as the pool's parts stand for them, 0 where a slot holds no data (a NaN scale) or lies
    past the sequence's length."""
    truth = dequantize(pool)  # [kv_heads, num_pages, page_size, head_dim]
    kv_heads, num_pages, page_size, head_dim = truth.shape
    tables = np.asarray(tables)
    dense = np.zeros((tables.shape[0], tables.shape[1] * page_size, kv_heads, head_dim))
    for b, n in enumerate(np.asarray(lengths)):
        for pos in range(int(n)):
            slot = truth[:, tables[b, pos // page_size], pos % page_size]
            if np.isfinite(slot).all():
                dense[b, pos] = slot
    return dense


@dataclasses.dataclass
class QuantizedCache:
    """A paged cache's pools quantized, and the float64 keys and values they hold."""

    k_pages: QuantizedArray
    v_pages: QuantizedArray
    dense_k: np.ndarray
    dense_v: np.ndarray


def quantize_cache(gen, k_pages, v_pages, tables, lengths, format: str) -> QuantizedCache:
    """:func:`quantized_pool` of both pools, with their float64 dense truth."""
    kq, vq = (quantized_pool(gen, x, format) for x in (k_pages, v_pages))
    assert np.isnan(np.asarray(kq.scales)).any(), "no poisoned slot: the test checks nothing"
    return QuantizedCache(kq, vq, dense_from_pool(kq, tables, lengths),
                          dense_from_pool(vq, tables, lengths))
