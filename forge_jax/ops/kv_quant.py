"""Quantized KV caches: int8 and fp8 (e4m3) keys and values, one scale per token and KV head.

Representation
--------------
A quantized pool (a paged cache's ``k_pages``/``v_pages``, a contiguous cache's ``k``/``v``)
is a :class:`forge_jax.QuantizedArray` whose logical shape is the float pool's,
``[..., head_dim]`` (paged: ``[kv_heads, num_pages, page_size, head_dim]``; contiguous:
``[batch, max_len, kv_heads, head_dim]``), with

* ``values``: int8 (``format="int8"``) or float8_e4m3fn (``format="fp8"``), that shape;
* ``scales``: float32 ``[..., 1]``, one per token and KV head (``block=(head_dim,)``);
* ``minimums``: None (symmetric);
* ``dtype``: the float dtype the pool stands for (what :func:`forge_jax.paged_gather`
  returns; the attention math is float32 whatever it is).

Slot ``s`` of head ``h`` holds ``x = scales[h, s] * values[h, s, :]``. A write quantizes each
new ``[head_dim]`` vector on its own (round to nearest): ``scale = max|x| / 127`` (int8) or
``/ 448`` (fp8, e4m3's largest value), so the pool needs no calibration and a token's error
never depends on another's. ``scales`` and ``values`` are written, copied and gathered
together, slot by slot. A non-finite input vector stores a NaN or inf scale: NaN data, which
propagates to the queries that see it and to no other (the attention contract).

The ops (:func:`forge_jax.paged_write`, :func:`forge_jax.paged_attention`,
:func:`forge_jax.ragged_paged_attention`, :func:`forge_jax.paged_gather`,
:func:`forge_jax.copy_pages`) take a quantized pool wherever they take a float one (K and V
both quantized, in one format) and hand their implementations the two arrays separately: the
pools' ``values`` as ``k_pages``/``v_pages`` and the scales as ``k_scales``/``v_scales``
(``[kv_heads, num_pages, page_size, 1]`` float32), so that a kernel reads int8/fp8 pages and
their scales and dequantizes in registers (VMEM on TPU), and one that cannot serve an int8
or fp8 page says so in its ``supports``. An int8 pool with float32 scales and
``head_dim = 128`` holds 132 bytes per token and head against bfloat16's 256 (0.52x).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import quant
from forge_jax.quant import QuantizedArray

KV_FORMATS = ("int8", "fp8")
VALUE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


def kv_format(name: str, value: Any) -> str | None:
    """``value`` checked as a KV cache format: None (a float cache), ``"int8"`` or ``"fp8"``."""
    if value is None or (isinstance(value, str) and value in KV_FORMATS):
        return value
    raise ValueError(f"{name} must be 'int8' or 'fp8' (or None for a float cache), "
                     f"got {name}={value!r}")


def empty_pool(shape: tuple[int, ...], format: str, dtype: Any = jnp.float32) -> QuantizedArray:
    """A quantized pool of logical ``shape`` (``[..., head_dim]``) holding zeros."""
    format = kv_format("format", format)
    shape = tuple(shape)
    return QuantizedArray(jnp.zeros(shape, VALUE_DTYPES[format]),
                          jnp.zeros(shape[:-1] + (1,), jnp.float32), None, format,
                          (shape[-1],), jnp.dtype(dtype))


def is_quantized(pool: Any) -> bool:
    return isinstance(pool, QuantizedArray)


def check_pool(name: str, pool: QuantizedArray) -> None:
    """A quantized KV pool as the representation above asks; ValueError/TypeError naming
    ``name`` otherwise."""
    if pool.format not in KV_FORMATS:
        raise ValueError(f"{name} is a {pool.format} QuantizedArray; a quantized KV pool is "
                         f"'int8' or 'fp8'")
    values, scales = pool.values, pool.scales
    if jnp.dtype(values.dtype) != VALUE_DTYPES[pool.format]:
        raise TypeError(f"{name}.values must be {VALUE_DTYPES[pool.format].name} for "
                        f"{pool.format}, got {name}.values.dtype={jnp.dtype(values.dtype).name}")
    if pool.minimums is not None:
        raise ValueError(f"{name} has minimums: a quantized KV pool is symmetric")
    want = tuple(values.shape[:-1]) + (1,)
    if not hasattr(scales, "shape") or tuple(scales.shape) != want:
        got = tuple(getattr(scales, "shape", ()))
        raise ValueError(f"{name}.scales must be [..., 1] = {want} (one scale per token and "
                         f"KV head of {name}.values.shape={tuple(values.shape)}), got "
                         f"{name}.scales.shape={got}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        raise TypeError(f"{name}.scales must be a float array, got "
                        f"{name}.scales.dtype={jnp.dtype(scales.dtype).name}")


def pool_parts(k_name: str, k_pool: Any, v_name: str, v_pool: Any
               ) -> tuple[Any, Any, Any, Any]:
    """``(k_values, v_values, k_scales, v_scales)`` of a K/V pool pair, the scales None for
    float pools. Both quantized in one format, or neither; checked."""
    kq, vq = is_quantized(k_pool), is_quantized(v_pool)
    if kq != vq:
        raise TypeError(f"{k_name} and {v_name} must both be quantized or both float, got "
                        f"{type(k_pool).__name__} and {type(v_pool).__name__}")
    if not kq:
        return k_pool, v_pool, None, None
    check_pool(k_name, k_pool)
    check_pool(v_name, v_pool)
    if k_pool.format != v_pool.format:
        raise TypeError(f"{k_name} and {v_name} must share a format, got "
                        f"{k_name}.format={k_pool.format!r}, {v_name}.format={v_pool.format!r}")
    return k_pool.values, v_pool.values, k_pool.scales, v_pool.scales


def scale_args(k_scales: Any, v_scales: Any) -> dict[str, Any]:
    """The implementations' extra arguments: ``k_scales``/``v_scales`` for a quantized pool,
    nothing for a float one (so float-only implementations keep their signatures)."""
    return {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)


def with_values(like: Any, values: jax.Array, scales: jax.Array | None) -> Any:
    """``values`` (and ``scales``) as a pool like ``like``: a float array as is, a quantized
    pool with the same format and dtype."""
    if not is_quantized(like):
        return values
    return QuantizedArray(values, scales, None, like.format, like.block, like.dtype)


def quantize_vectors(x: jax.Array, format: str) -> tuple[jax.Array, jax.Array]:
    """``x [..., head_dim]`` quantized vector by vector: ``(values, float32 scales [..., 1])``."""
    q = quant.quantize(x, format)  # one scale per row of the last axis
    return q.values, q.scales


def dequantize_vectors(values: jax.Array, scales: jax.Array | None) -> jax.Array:
    """float32 ``scales * values`` (``values`` as they are when ``scales`` is None)."""
    if scales is None:
        return values
    return values.astype(jnp.float32) * scales.astype(jnp.float32)


def dequantize_pool(pool: Any, dtype: Any = None) -> jax.Array:
    """A pool as float: a quantized one dequantized (to ``dtype``, default its own), a float
    one as it is."""
    if not is_quantized(pool):
        return pool
    return dequantize_vectors(pool.values, pool.scales).astype(dtype or pool.dtype)


def format_of(values: jax.Array) -> str:
    """The format of a quantized pool's ``values`` (int8 or fp8) from their dtype."""
    return "int8" if jnp.dtype(values.dtype) == VALUE_DTYPES["int8"] else "fp8"


def repack(k_like: Any, v_like: Any, out: tuple) -> tuple[Any, Any]:
    """An implementation's result (``(k, v)``, or ``(k, v, k_scales, v_scales)`` for quantized
    pools) as the caller's pools: QuantizedArrays where ``k_like``/``v_like`` are."""
    if not is_quantized(k_like):
        return out
    k, v, k_scales, v_scales = out
    return with_values(k_like, k, k_scales), with_values(v_like, v, v_scales)


def bytes_per_value(format: str | None, dtype: Any, head_dim: int) -> float:
    """Bytes a KV cache stores per key (or value) element: ``dtype``'s size for a float
    cache (``format`` None), one byte plus a float32 scale per ``head_dim`` for int8/fp8."""
    if kv_format("format", format) is None:
        return float(jnp.dtype(dtype).itemsize)
    return 1.0 + 4.0 / head_dim
