"""What the two device caches share: the checks of their arguments and the per-layer tuples."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _checks


def layer_index(layer: Any, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
        raise TypeError(f"layer must be a Python int (static), got {layer=!r}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer=}")
    return int(layer)


def check_write(k, v, positions, valid, *, batch, kv_heads, head_dim):
    _checks.array("k", k, ndim=4)
    _checks.array("v", v, ndim=4)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape: {k.shape=}, {v.shape=}")
    if k.shape[0] != batch or tuple(k.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(
            f"k must be [batch, t, kv_heads, head_dim] = [{batch}, t, {kv_heads}, {head_dim}] "
            f"for this cache, got {k.shape=}")
    bt = tuple(k.shape[:2])
    _checks.array("positions", positions, ndim=2, kind="int")
    _checks.array("valid", valid, ndim=2, kind="bool")
    if tuple(positions.shape) != bt:
        raise ValueError(f"positions must be [batch, t] = {bt}, got {positions.shape=}")
    if tuple(valid.shape) != bt:
        raise ValueError(f"valid must be [batch, t] = {bt}, got {valid.shape=}")


def lengths_array(name: str, lengths: Any, batch: int) -> jax.Array:
    lengths = jnp.asarray(lengths)
    _checks.array(name, lengths, ndim=1, kind="int")
    if lengths.shape[0] != batch:
        raise ValueError(f"{name} must be [batch] = ({batch},), got {name}.shape="
                         f"{tuple(lengths.shape)}")
    return lengths.astype(jnp.int32)


def float_dtype(dtype: Any) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype=}")
    return dtype


def replace_layer(arrays: tuple, layer: int, new: jax.Array) -> tuple:
    return arrays[:layer] + (new,) + arrays[layer + 1:]
