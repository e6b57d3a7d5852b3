"""Quantized arrays: :class:`QuantizedArray`, :func:`quantize` and :func:`dequantize`.

A quantized array stores integer or fp8 ``values`` with one ``scale`` (and, for
asymmetric int4, one ``minimum``) per *block* of the logical array::

    x[i] = scales[block(i)] * q[i] (+ minimums[block(i)])

Formats (``format``; the static metadata beside the arrays):

* ``"int8"``: ``values`` int8, ``q`` as stored. Symmetric per output channel from
  :func:`quantize` (``scale = absmax / 127``); GGUF's Q8_0 (blocks of 32, float16 scales),
  Q5_0 and Q6_K (the 5- and 6-bit values held in a byte each; Q6_K in groups of 16) and
  Q5_1 and Q5_K (with minimums) load onto it losslessly.
* ``"int4"``: ``values`` uint8, two 4-bit values a byte along the last axis (element
  ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one). Symmetric: ``q =
  nibble - 8`` (``scale = absmax / 7``); asymmetric (``minimums`` given): ``q = nibble``
  (``scale = (max - min) / 15``, ``minimum = min``). GGUF's Q4_0 (symmetric), Q4_1 and
  Q4_K (asymmetric) load onto it losslessly (the nibbles reordered).
* ``"fp8"``: ``values`` float8_e4m3fn, ``scale = absmax / 448``; per output channel or
  in 128 x 128 blocks, the layout of Hugging Face's fine-grained FP8 checkpoints
  (``weight`` and ``weight_scale_inv`` with ``weight_block_size``: ``values`` and
  ``scales`` as they are).
* ``"mxfp4"`` (OCP Microscaling FP4, gpt-oss's released experts): ``values`` uint8, two
  FP4 E2M1 codes a byte packed as int4's (element ``2j`` in the low nibble), each code
  ``(-1)**s * 2**(e - 1) * (1 + m / 2)`` (``e`` > 0) or ``(-1)**s * m / 2`` (``e`` = 0):
  the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; ``scales`` uint8 E8M0
  exponents, ``scale = 2**(byte - 127)`` (255: NaN), one per 32 values along the last
  axis. :func:`quantize` takes each block's exponent as ``floor(log2(absmax)) - 2`` and
  rounds to the nearest code (ties to an even mantissa), clamping at 6, as the OCP
  specification does. gpt-oss's ``*_blocks`` ``[..., K / 32, 16]`` and ``*_scales``
  ``[..., K / 32]`` are ``values`` (reshaped to ``[..., K / 2]``) and ``scales`` as they are.

Activations (``activations``, static): ``None`` (the default) is weight-only quantization:
a product dequantizes the weight and multiplies in the activations' float dtype (W8A16).
``"int8"`` (int8 weights only, symmetric) asks for int8 activations too (W8A8): each row of
the activations is quantized when the product runs (:func:`quantize_rows`: per token,
symmetric, ``scale = max|x| / 127``), the product is int8 x int8 with int32 accumulation, and
both scales are applied to it. A numerics choice, so only ever asked for:
``quantize(w, "int8", activations="int8")``.

``block`` gives the block's extent along the trailing axes (an axis it does not cover
has blocks of 1): ``(1, 32)`` is groups of 32 along a weight's ``in`` axis, ``(1, K)``
one scale per output channel, ``(128, 128)`` square blocks. ``scales`` (and ``minimums``)
have the array's shape divided by the block, axis by axis.

Why not qwix's ``QArray`` (qwix 0.1.8, which installs with JAX 0.10.2): its ``qvalue``
has the logical shape, one element per value, so int4 is stored as ``jnp.int4``, which
JAX on CPU keeps one value a byte (``nbytes`` counts a byte each), twice the memory of a
packed layout, and its zero point is an integer in the value's dtype, so GGUF's float
minimums (Q4_1, Q5_1, the K-quants: ``x = d * q + m``) have no exact form there. This
container is a plain pytree (arrays as children, ``format``/``block``/``dtype`` as
static data), so it passes through ``jit``, ``vmap`` (a stacked array's leading axes
have blocks of 1) and ``device_put`` with a sharding like any array. The int8 and fp8
formats hold the same numbers as a qwix ``QArray`` with per-channel or tiled scales.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "int4", "fp8", "mxfp4")
PACKED = ("int4", "mxfp4")  # two 4-bit values a byte along the last axis
ACTIVATIONS = (None, "int8")  # the activations a product quantizes: none (W8A16), or int8
_VALUE_DTYPES = {"int8": jnp.dtype(jnp.int8), "int4": jnp.dtype(jnp.uint8),
                 "fp8": jnp.dtype(jnp.float8_e4m3fn), "mxfp4": jnp.dtype(jnp.uint8)}
# The FP4 E2M1 code -> its value (codes 8..15 are the negatives of 0..7).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A quantized array: ``values`` with ``scales`` (and ``minimums``) per block.

    Attributes:
      values: the stored values (int8; uint8 holding two int4 values a byte along the last
        axis; float8_e4m3fn).
      scales: ``shape[i] // block[i]`` along each axis, a float dtype (float32 from
        :func:`quantize`; GGUF's float16 as they are; float32 for its K-quants, whose
        sub-block scales ``d * sc`` are exact there).
      minimums: like ``scales``, or None (symmetric).
      format: ``"int8"``, ``"int4"`` or ``"fp8"`` (static).
      block: the block's extent along the trailing axes (static).
      dtype: the dtype :func:`dequantize` gives by default, that of the array quantized
        (static).
      spec: how the logical array is split over a device mesh: one mesh axis name (or
        None) per axis, as a ``PartitionSpec`` would say (static; ``()``: not split).
        Set by :func:`place`; ``fj.matmul``'s partition rule reads it to run the product
        per shard (see :func:`partition_specs` for how each array of it splits).
      activations: None (a product multiplies dequantized weights in the activations'
        dtype) or ``"int8"`` (W8A8: the product quantizes each row of the activations to
        int8 and multiplies integers; int8 weights only) (static).
    """

    values: jax.Array
    scales: jax.Array
    minimums: jax.Array | None
    format: str
    block: tuple[int, ...]
    dtype: Any = jnp.float32
    spec: tuple[str | None, ...] = ()
    activations: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "spec", tuple(self.spec))
        _check_activations(self.activations, self.format)

    def tree_flatten(self):
        return (self.values, self.scales, self.minimums), (self.format, self.block,
                                                           self.dtype, self.spec,
                                                           self.activations)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (an int4 array has twice its values' last axis)."""
        shape = tuple(self.values.shape)
        return shape[:-1] + (shape[-1] * 2,) if self.format in PACKED else shape

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes stored: values, scales and minimums."""
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in (self.values, self.scales, self.minimums) if x is not None)

    def full_block(self) -> tuple[int, ...]:
        """``block`` extended with 1 over the leading axes it does not cover."""
        return (1,) * (self.ndim - len(self.block)) + tuple(self.block)

    def shard_local(self) -> QuantizedArray:
        """This array as one device's shard sees it inside ``shard_map`` (its arrays are
        that device's slices): the block along an axis whose scales were not split (one
        block spanning a split axis) shrinks to the local extent; ``spec`` is cleared."""
        lead = self.ndim - len(self.block)
        block = tuple(n // s for n, s in zip(self.shape[lead:], self.scales.shape[lead:],
                                             strict=True))
        return QuantizedArray(self.values, self.scales, self.minimums, self.format, block,
                              self.dtype, activations=self.activations)

    def __repr__(self) -> str:
        sym = "asymmetric" if self.minimums is not None else "symmetric"
        split = f", spec={self.spec}" if self.spec else ""
        act = "" if self.activations is None else f", activations={self.activations!r}"
        return (f"QuantizedArray({self.format}, shape={self.shape}, block={self.block}, "
                f"{sym}, dtype={jnp.dtype(self.dtype).name}{split}{act})")


def _check_activations(activations, format: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} must be one of {ACTIVATIONS}")
    if activations == "int8" and format != "int8":
        raise ValueError(f"activations='int8' (W8A8) is for int8 weights, not {format=}")


def _float_array(name: str, w) -> jax.Array:
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(w).__name__}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array, got {name}.dtype={jnp.dtype(w.dtype)}")
    return w


def _blocked(x: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """``x`` of shape ``[n0, n1, ...]`` -> ``[n0 / b0, b0, n1 / b1, b1, ...]``."""
    shape = []
    for n, b in zip(x.shape, block, strict=True):
        shape += [n // b, b]
    return x.reshape(shape)


def _expand(s: jax.Array, ndim: int) -> jax.Array:
    """Scales ``[s0, s1, ...]`` -> ``[s0, 1, s1, 1, ...]`` (broadcasting over a block)."""
    return s.reshape([d for n in s.shape for d in (n, 1)]) if ndim else s


def check_parts(values, scales, minimums, format: str, block) -> tuple[int, ...]:
    """Checks that the arrays of a quantized array agree with its format and block;
    returns the block. Raises ValueError/TypeError naming the argument."""
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; known: {', '.join(FORMATS)}")
    if jnp.dtype(values.dtype) != _VALUE_DTYPES[format]:
        raise TypeError(f"{format} values must be {_VALUE_DTYPES[format].name}, got "
                        f"values.dtype={jnp.dtype(values.dtype).name}")
    block = tuple(int(b) for b in block)
    ndim = len(values.shape)
    if not block or len(block) > ndim or any(b <= 0 for b in block):
        raise ValueError(f"block must be 1 to {ndim} positive ints, got {block=}")
    shape = tuple(values.shape)
    if format in PACKED:
        shape = shape[:-1] + (shape[-1] * 2,)
        if block[-1] % 2:
            raise ValueError(f"{format} blocks along the packed last axis must be even, got "
                             f"{block=}")
    full = (1,) * (ndim - len(block)) + block
    if any(n % b for n, b in zip(shape, full, strict=True)):
        raise ValueError(f"{block=} does not divide the array's shape {shape}")
    want = tuple(n // b for n, b in zip(shape, full, strict=True))
    for name, x in (("scales", scales), ("minimums", minimums)):
        if x is None:
            continue
        if tuple(x.shape) != want:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be {want} for an array of "
                             f"shape {shape} in blocks of {block}")
        if format == "mxfp4":
            if jnp.dtype(x.dtype) != jnp.uint8:
                raise TypeError(f"mxfp4 {name} must be uint8 E8M0 exponents, got {name}.dtype="
                                f"{jnp.dtype(x.dtype).name}")
        elif not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {name}.dtype="
                            f"{jnp.dtype(x.dtype).name}")
    if minimums is not None and format != "int4" and format != "int8":
        raise ValueError(f"minimums are for the int formats, not {format=}")
    return block


def from_parts(values, scales, minimums=None, *, format: str, block, dtype=jnp.float32,
               activations: str | None = None) -> QuantizedArray:
    """A :class:`QuantizedArray` from its arrays, checked (e.g. a Hugging Face FP8
    ``weight`` and its ``weight_scale_inv`` with ``block=(128, 128)``)."""
    block = check_parts(values, scales, minimums, format, block)
    _check_activations(activations, format)
    if activations is not None and minimums is not None:
        raise ValueError(f"{activations=} (W8A8) needs symmetric weights; these have minimums")
    return QuantizedArray(jnp.asarray(values), jnp.asarray(scales),
                          None if minimums is None else jnp.asarray(minimums), format, block,
                          jnp.dtype(dtype), activations=activations)


def quantize(w, format: str, *, group_size: int | None = None,
             block: tuple[int, ...] | None = None, symmetric: bool = True,
             scale_dtype=jnp.float32, activations: str | None = None) -> QuantizedArray:
    """Quantizes ``w`` (round to nearest) into ``format``.

    Args:
      w: a float array ``[..., N, K]`` (a weight in the ``[out, in]`` layout: blocks run
        along the last axis, the one a product contracts). Leading axes have blocks of
        1, so a stacked ``[experts, N, K]`` weight gets each expert its own scales (what
        :func:`forge_jax.grouped_matmul` with ``trans_w=True`` multiplies).
      format: ``"int8"``, ``"int4"``, ``"fp8"`` or ``"mxfp4"``.
      group_size: values per scale along the last axis (``int4``: 32, 64 or 128 are
        usual; default 32; ``mxfp4``: 32, the format's); None for int8 and fp8: one
        scale per output channel.
      block: instead of ``group_size``, the block over the trailing axes, e.g.
        ``(128, 128)`` for fp8 in Hugging Face's fine-grained layout.
      symmetric: False for int4 with a minimum per group (``x = s * q + m``, ``q`` in
        0..15); int8 and fp8 are symmetric only.
      scale_dtype: the dtype of the scales (and minimums); mxfp4's are uint8 E8M0
        exponents whatever it says.
      activations: None (weight-only: products multiply dequantized weights in the
        activations' dtype), or ``"int8"`` for int8 weights (W8A8: products quantize each
        row of the activations to int8, :func:`quantize_rows`, and multiply integers with
        int32 accumulation; the MXU's int8 path on TPUs that have one).

    Returns:
      A :class:`QuantizedArray` whose :func:`dequantize` approximates ``w``: each value
      within half a step (``scale / 2``) for int8 and int4, within fp8's relative
      rounding (2**-4) of its block's scale times the value for fp8; for mxfp4, each
      value rounded to the nearest FP4 value times its block's power-of-two scale
      (values over 6 times the scale clamped to 6).

    Raises:
      ValueError: an unknown format, a group size or block that does not divide ``w``'s
        shape, an odd number of values along the last axis for int4.
    """
    w = _float_array("w", w)
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; known: {', '.join(FORMATS)}")
    _check_activations(activations, format)
    if w.ndim < 1:
        raise ValueError(f"w must have rank >= 1, got w.shape={tuple(w.shape)}")
    if not symmetric and format != "int4":
        raise ValueError(f"symmetric=False is for int4 (a minimum per group); {format} is "
                         f"symmetric")
    if format in PACKED and w.shape[-1] % 2:
        raise ValueError(f"{format} packs two values a byte along the last axis: "
                         f"w.shape[-1]={w.shape[-1]} is odd")
    if group_size is not None and block is not None:
        raise ValueError(f"give group_size or block, not both ({group_size=}, {block=})")
    if block is None:
        if group_size is None:
            group_size = 32 if format in PACKED else w.shape[-1]
        if (isinstance(group_size, bool) or not isinstance(group_size, int)
                or group_size <= 0 or w.shape[-1] % group_size):
            raise ValueError(f"group_size={group_size!r} must be a positive int dividing "
                             f"w.shape[-1]={w.shape[-1]}")
        block = (group_size,)
    block = tuple(block)
    if not block or len(block) > w.ndim or any(
            isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"block must be 1 to {w.ndim} positive ints, got {block=}")
    full = (1,) * (w.ndim - len(block)) + block
    if any(n % b for n, b in zip(w.shape, full, strict=True)):
        raise ValueError(f"{block=} does not divide w.shape={tuple(w.shape)}")
    if format in PACKED and full[-1] % 2:
        raise ValueError(f"{format} groups must hold an even number of values, got {block=}")
    if format == "mxfp4":
        return _quantize_mxfp4(jnp.asarray(w), full, block)
    q = _quantize(jnp.asarray(w), format, full, symmetric, jnp.dtype(scale_dtype), block=block)
    return q if activations is None else dataclasses.replace(q, activations=activations)


def _quantize(w, format, full, symmetric, scale_dtype, *, block):
    dtype = jnp.dtype(w.dtype)
    x = _blocked(w.astype(jnp.float32), full)  # [n0/b0, b0, n1/b1, b1, ...]
    axes = tuple(range(1, 2 * w.ndim, 2))
    minimums = None
    if symmetric:
        scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / _QMAX[format]
    else:
        lo = jnp.min(x, axis=axes, keepdims=True)
        scale = (jnp.max(x, axis=axes, keepdims=True) - lo) / 15.0
        minimums = lo
    scale = scale.astype(scale_dtype).astype(jnp.float32)  # quantize with the stored scale
    if minimums is not None:
        minimums = minimums.astype(scale_dtype).astype(jnp.float32)
    inv = jnp.where(scale == 0, 0.0, 1.0 / jnp.where(scale == 0, 1.0, scale))
    if format == "fp8":
        q = (x * inv).astype(jnp.float8_e4m3fn)
    elif format == "int8":
        q = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
    elif symmetric:
        q = (jnp.clip(jnp.round(x * inv), -8, 7) + 8).astype(jnp.uint8)  # offset nibble
    else:
        q = jnp.clip(jnp.round((x - minimums) * inv), 0, 15).astype(jnp.uint8)
    q = q.reshape(w.shape)
    if format == "int4":
        q = pack_int4(q)
    squeeze = lambda s: None if s is None else s.reshape(
        [n // b for n, b in zip(w.shape, full, strict=True)]).astype(scale_dtype)
    return QuantizedArray(q, squeeze(scale), squeeze(minimums), format, block, dtype)


def _quantize_mxfp4(w, full, block):
    x = _blocked(w.astype(jnp.float32), full)  # [n0/b0, b0, n1/b1, b1, ...]
    axes = tuple(range(1, 2 * w.ndim, 2))
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    # floor(log2(amax)) exactly, from the float32 exponent bits (a normal amax), minus
    # E2M1's largest exponent (2); 2**-127 for a block of zeros (or of subnormals).
    biased = (jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
    exponent = jnp.clip(biased - 127 - 2, -127, 127)
    exponent = jnp.where(amax > 0, exponent, -127)
    v = x / e8m0_scales((exponent + 127).astype(jnp.uint8))
    m = jnp.abs(v)
    # Round to nearest, ties to the even mantissa: the midpoints between 0, 0.5, 1, 1.5,
    # 2, 3, 4, 6 (a tie goes up where the upper neighbour's mantissa bit is 0).
    code = sum((m >= t if up else m > t).astype(jnp.uint8) for t, up in (
        (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
        (5.0, False)))
    code = (code | (jnp.signbit(v).astype(jnp.uint8) << 3)).reshape(w.shape)
    scales = (exponent + 127).astype(jnp.uint8).reshape(
        [n // b for n, b in zip(w.shape, full, strict=True)])
    return QuantizedArray(pack_int4(code), scales, None, "mxfp4", block, jnp.dtype(w.dtype))


def e8m0_scales(exponents: jax.Array) -> jax.Array:
    """uint8 E8M0 exponents -> float32 ``2**(byte - 127)`` (byte 255: NaN), built from the
    float32 bits (exact, no ``exp2``; byte 0, 2**-127, is float32's subnormal)."""
    e = exponents.astype(jnp.int32)
    bits = jnp.where(e == 0, 0x00400000, e << 23)
    bits = jnp.where(e == 255, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def fp4_values(codes: jax.Array) -> jax.Array:
    """uint8 FP4 E2M1 codes (0..15) -> their float32 values (:data:`FP4_VALUES`)."""
    return jnp.asarray(FP4_VALUES, jnp.float32)[codes.astype(jnp.int32)]


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic int8 quantization of activations, per row (per token), symmetric: what a W8A8
    product (``activations="int8"``) does to its left-hand side, in every implementation.

    Args:
      x: float ``[..., K]``.

    Returns:
      ``(q, scale)``: int8 ``[..., K]`` and float32 ``[..., 1]``, with ``scale = max|x| / 127``
      over the row (float32 math), ``q = clip(round(x * (1 / scale)), -127, 127)`` (0 for a
      row of zeros), so ``x ~ scale * q`` within half a step.
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / _QMAX["int8"]
    inv = jnp.where(scale == 0, 0.0, 1.0 / jnp.where(scale == 0, 1.0, scale))
    return jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8), scale


def partition_specs(q: QuantizedArray, spec, mesh_shape: Mapping[str, int]) -> QuantizedArray:
    """The ``PartitionSpec`` of each array of ``q`` when its logical array splits by ``spec``.

    Along an axis split over ``n`` devices, ``values`` split as the logical array does
    (int4's packed last axis by half as many bytes); ``scales`` and ``minimums`` split
    with them when each device's part is whole blocks, and are replicated along an axis
    one block spans whole (a per-output-channel scale of a weight split over its input
    channels). Any other split would cut a block between devices and is refused.

    Args:
      q: a :class:`QuantizedArray` (or one of shapes only).
      spec: one mesh axis name or None per logical axis (a ``PartitionSpec``; missing
        trailing axes are not split).
      mesh_shape: the mesh's axis sizes (``mesh.shape``).

    Returns:
      A :class:`QuantizedArray` with the same static data whose arrays are
      ``PartitionSpec`` s (``shard_map``'s ``in_specs`` for ``q``; ``minimums`` None when
      ``q`` has none).

    Raises:
      ValueError: an axis that does not divide over its mesh axis, or blocks cut by the
        split (naming the block size and each device's share).
    """
    from jax.sharding import PartitionSpec as P

    spec = tuple(spec) + (None,) * (q.ndim - len(tuple(spec)))
    if len(spec) != q.ndim:
        raise ValueError(f"{spec=} has more axes than the quantized array's shape {q.shape}")
    full = q.full_block()
    scale_spec = []
    for d, (axis, size, b) in enumerate(zip(spec, q.shape, full, strict=True)):
        if axis is None:
            scale_spec.append(None)
            continue
        if not isinstance(axis, str) or axis not in mesh_shape:
            raise ValueError(f"{spec=}: {axis!r} is not an axis of the mesh "
                             f"({dict(mesh_shape)})")
        n = mesh_shape[axis]
        if size % n:
            raise ValueError(f"axis {d} of a quantized array of shape {q.shape} ({size}) does "
                             f"not split over mesh axis {axis!r} of {n} devices")
        local = size // n
        if local % b == 0:
            scale_spec.append(axis)
        elif b == size:
            scale_spec.append(None)  # one block spans the axis: its scales on every device
        else:
            what = "group size" if d == q.ndim - 1 else "block"
            raise ValueError(
                f"a {q.format} array of shape {q.shape} in blocks of {q.block} cannot split "
                f"axis {d} over mesh axis {axis!r} of {n} devices: {what} {b} does not divide "
                f"the {local} values per device (choose a {what} dividing {local})")
        if q.format in PACKED and d == q.ndim - 1 and local % 2:
            raise ValueError(f"{q.format} packs two values a byte: {local} values per device along "
                             f"the last axis (of {size} over {axis!r}={n}) is odd")
    children, aux = q.tree_flatten()
    specs = (P(*spec), P(*scale_spec), None if children[2] is None else P(*scale_spec))
    return QuantizedArray.tree_unflatten(aux, specs)


def place(q: QuantizedArray, sharding) -> QuantizedArray:
    """``q`` with its arrays placed on a mesh, the logical array split as
    ``sharding`` (a ``jax.sharding.NamedSharding``) says, its scales (and minimums) with
    the values they scale (:func:`partition_specs`); the result records the split in
    ``spec``. Each device receives only its slices (from a host copy of ``q``)."""
    from jax.sharding import NamedSharding

    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"sharding must be a NamedSharding, got {type(sharding).__name__}")
    spec = tuple(sharding.spec) + (None,) * (q.ndim - len(tuple(sharding.spec)))
    specs = partition_specs(q, spec, sharding.mesh.shape)

    def put(x, s):
        if x is None:
            return None
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, NamedSharding(sharding.mesh, s),
                                            lambda index: host[index])

    return QuantizedArray(put(q.values, specs.values), put(q.scales, specs.scales),
                          put(q.minimums, specs.minimums), q.format, q.block, q.dtype, spec,
                          q.activations)


def pack_int4(nibbles: jax.Array) -> jax.Array:
    """uint8 values 0..15 ``[..., 2n]`` -> bytes ``[..., n]`` (element ``2j`` low)."""
    pairs = nibbles.reshape(*nibbles.shape[:-1], -1, 2).astype(jnp.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """Bytes ``[..., n]`` -> uint8 nibbles ``[..., 2n]`` (the inverse of :func:`pack_int4`)."""
    both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return both.reshape(*packed.shape[:-1], -1)


def int_values(q: QuantizedArray) -> jax.Array:
    """The values ``q`` of :class:`QuantizedArray` ``q`` in the logical shape (int8 for the
    int formats, with int4's offset removed when symmetric; fp8 as stored; mxfp4's FP4
    values in float32)."""
    if q.format == "mxfp4":
        return fp4_values(unpack_int4(q.values))
    if q.format != "int4":
        return q.values
    nibbles = unpack_int4(q.values).astype(jnp.int8)
    return nibbles if q.minimums is not None else nibbles - 8


def dequantize(q: QuantizedArray, dtype=None) -> jax.Array:
    """The array ``q`` stands for: ``scales * values (+ minimums)`` block by block, in
    float32 math, cast to ``dtype`` (default: ``q.dtype``, that of the array quantized).

    Args:
      q: a :class:`QuantizedArray` of shape ``[..., N, K]``.
      dtype: the result's float dtype.

    Returns:
      ``[..., N, K]`` in ``dtype``.
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize takes a QuantizedArray, got {type(q).__name__}")
    dtype = q.dtype if dtype is None else jnp.dtype(dtype)
    full = q.full_block()
    if q.format == "mxfp4":
        x = _blocked(fp4_values(unpack_int4(q.values)), full)
        x = x * _expand(e8m0_scales(q.scales), q.ndim)
        return x.reshape(q.shape).astype(dtype)
    x = _blocked(int_values(q).astype(jnp.float32), full)
    x = x * _expand(q.scales.astype(jnp.float32), q.ndim)
    if q.minimums is not None:
        x = x + _expand(q.minimums.astype(jnp.float32), q.ndim)
    return x.reshape(q.shape).astype(dtype)


def bits_per_value(format: str, *, group_size: int | None = None, columns: int | None = None,
                   symmetric: bool = True, scale_bits: int = 32) -> float:
    """Bits a quantized weight stores per value, scales and minimums included: 8 (int8,
    fp8) or 4 (int4) plus ``scale_bits`` (and as much again for a minimum) per group of
    ``group_size`` (default: ``columns``, one scale per output channel)."""
    if format not in FORMATS:
        raise ValueError(f"unknown quantization format {format!r}; known: {', '.join(FORMATS)}")
    if format == "mxfp4":  # an 8-bit exponent per 32 values
        scale_bits, group_size = 8, group_size or 32
    group = group_size or columns or math.inf
    per_group = scale_bits * (1 if symmetric else 2)
    return (4 if format in PACKED else 8) + per_group / group
