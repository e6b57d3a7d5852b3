"""What the two device caches share: the checks of their arguments and the per-layer plumbing.

:class:`KVCacheBase` is the common part of :class:`~forge_jax.kv_cache.ContiguousKVCache` and
:class:`~forge_jax.kv_cache.PagedKVCache`: the geometry read off the per-layer K and V tuples,
:meth:`~KVCacheBase.write` (checks, then the subclass's own scatter into one layer) and
:meth:`~KVCacheBase.with_lengths`. Each subclass is a frozen dataclass registered as a pytree,
with a ``lengths`` field, ``batch`` and ``kv_heads`` properties, and the three hooks
named in its docstring.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp

from forge_jax import _checks
from forge_jax.ops import kv_quant


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


def geometry(num_layers: Any, dims: Mapping[str, Any],
             dtype: Any) -> tuple[int, tuple[int, ...], jnp.dtype]:
    """``(num_layers, shape, dtype)`` checked, ``shape`` from ``dims`` (name -> size) in order."""
    shape = tuple(_checks.positive_int(name, value) for name, value in dims.items())
    return _checks.positive_int("num_layers", num_layers), shape, float_dtype(dtype)


def zeros_per_layer(num_layers: int, shape: tuple[int, ...], dtype: jnp.dtype,
                    quantize: str | None = None) -> tuple[Any, ...]:
    """``num_layers`` zero buffers of ``shape``: float ``dtype`` ones, or ``quantize``
    (``"int8"``/``"fp8"``) pools standing for ``dtype`` (:mod:`forge_jax.ops.kv_quant`)."""
    quantize = kv_quant.kv_format("quantize", quantize)
    if quantize is not None:
        return tuple(kv_quant.empty_pool(shape, quantize, dtype) for _ in range(num_layers))
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))


def replace_layer(arrays: tuple, layer: int, new: jax.Array) -> tuple:
    return arrays[:layer] + (new,) + arrays[layer + 1:]


class KVCacheBase:
    """The part of the contiguous and the paged cache that does not depend on the layout.

    Hooks for a subclass: :meth:`_kv` (its K and V tuples, one array per layer, each
    ``[..., head_dim]``), :meth:`_with_kv` (the same cache with them replaced) and
    :meth:`_write_layer` (the new K and V arrays of one layer after a checked write).
    """

    def _kv(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        raise NotImplementedError

    def _with_kv(self, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...]) -> Self:
        raise NotImplementedError

    def _write_layer(self, layer: int, k, v, positions, valid) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self._kv()[0])

    @property
    def head_dim(self) -> int:
        return self._kv()[0][0].shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        """The float dtype of the keys and values (a quantized cache's: what it stands for)."""
        return self._kv()[0][0].dtype

    @property
    def quantization(self) -> str | None:
        """``"int8"`` or ``"fp8"`` for a quantized cache (:mod:`forge_jax.ops.kv_quant`),
        else None."""
        pool = self._kv()[0][0]
        return pool.format if kv_quant.is_quantized(pool) else None

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values (scales included), measured from the arrays."""
        return sum(int(x.nbytes) for pools in self._kv() for x in pools)

    def as_stored(self, x: jax.Array) -> jax.Array:
        """``x [..., head_dim]`` as the cache holds and returns it, in :attr:`dtype`:
        rounded to the dtype, or quantized and dequantized (what attention over the cache
        will read, e.g. for a prefill that attends its own new keys directly)."""
        if self.quantization is None:
            return x.astype(self.dtype)
        return kv_quant.dequantize_vectors(
            *kv_quant.quantize_vectors(x, self.quantization)).astype(self.dtype)

    def write(self, layer: int, k, v, positions, valid) -> Self:
        """Stores ``k[b, t]`` and ``v[b, t]`` at position ``positions[b, t]`` of layer ``layer``.

        Tokens with ``valid[b, t] == False`` (padding), a negative position, or a
        position the cache has no room for are not written: ``>= max_len`` in a
        :class:`~forge_jax.kv_cache.ContiguousKVCache`; beyond the block table in a
        :class:`~forge_jax.kv_cache.PagedKVCache`, whose slots come from its block table
        (:meth:`~forge_jax.kv_cache.PagedKVCache.slots`) and whose writes go through
        :func:`forge_jax.paged_write`. ``k`` and ``v`` are cast to the cache dtype. With
        the cache donated under ``jit`` the update is in place.

        Args:
          layer: static layer index.
          k, v: ``[batch, t, kv_heads, head_dim]``, any float dtype.
          positions: int ``[batch, t]``, absolute positions in the sequence.
          valid: bool ``[batch, t]``.

        Returns:
          The cache with layer ``layer`` updated; ``lengths`` unchanged.
        """
        layer = layer_index(layer, self.num_layers)
        check_write(k, v, positions, valid, batch=self.batch, kv_heads=self.kv_heads,
                    head_dim=self.head_dim)
        new_k, new_v = self._write_layer(layer, k, v, positions, valid)
        old_k, old_v = self._kv()
        return self._with_kv(replace_layer(old_k, layer, new_k),
                             replace_layer(old_v, layer, new_v))

    def with_lengths(self, lengths) -> Self:
        """The same cache with ``lengths`` (int ``[batch]``) replaced."""
        return dataclasses.replace(self, lengths=lengths_array("lengths", lengths, self.batch))
