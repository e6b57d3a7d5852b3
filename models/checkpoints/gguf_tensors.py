"""GGUF tensors -> forge_jax arrays: float types as floats, the exact quantized types as
:class:`forge_jax.QuantizedArray` s, losslessly (the layouts:
:mod:`forge_jax.models.checkpoints.gguf`), and fused projections stacked from their parts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.models.checkpoints.generation_config import CheckpointError

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") + K_TYPES
FLOAT_TYPES = ("F32", "F16", "BF16")


def halves(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes of a 32-value block (value j in byte j's low nibble, value j + 16
    in its high one) -> the 32 nibbles in order ``[..., 32]``."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32, bit j for value j) -> ``[..., 32]`` 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    return np.split(blocks, np.cumsum(sizes)[:-1], axis=-1)


# Bytes of one GGUF block and the values it holds.
BLOCK_BYTES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32),
               "Q5_1": (24, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _float16(b: np.ndarray) -> np.ndarray:
    """Two bytes a value ``[..., 2]`` -> float32 ``[...]`` (a float16 as stored)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def quantized(kind: str, data: np.ndarray) -> fj.QuantizedArray:
    """GGUF blocks ``[rows, row bytes]`` of type ``kind`` -> a QuantizedArray ``[rows, K]``."""
    if kind in K_TYPES:
        return _k_quantized(kind, data)
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, BLOCK_BYTES[kind][0])  # [rows, K / 32, bytes]
    f16 = lambda b: np.ascontiguousarray(b).view(np.float16)[..., 0]  # [rows, K / 32]
    minimums = None
    if kind == "Q8_0":
        d, qs = _split(blocks, 2, 32)
        values, fmt = np.ascontiguousarray(qs).view(np.int8).reshape(rows, -1), "int8"
    elif kind in ("Q4_0", "Q4_1"):
        if kind == "Q4_0":
            d, qs = _split(blocks, 2, 16)
        else:
            d, m, qs = _split(blocks, 2, 2, 16)
            minimums = f16(m)
        nibbles = halves(qs).reshape(rows, -1)  # Q4_0's offset of 8 is int4's own
        # (packed in NumPy: a JAX op here compiles for every tensor shape at each start)
        values, fmt = fj.quant.pack_int4(nibbles), "int4"
    else:
        if kind == "Q5_0":
            d, qh, qs = _split(blocks, 2, 4, 16)
        else:
            d, m, qh, qs = _split(blocks, 2, 2, 4, 16)
            minimums = f16(m)
        q = (halves(qs) | (_high_bits(qh) << 4)).astype(np.int16)
        if kind == "Q5_0":
            q = q - 16
        values, fmt = q.astype(np.int8).reshape(rows, -1), "int8"
    return fj.quant.from_parts(values, f16(d), minimums, format=fmt, block=(32,))


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes ``[..., 12]`` -> the 8 sub-blocks' 6-bit scales and minimums
    ``[..., 8]`` each: bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 minimums
    0-3; scales 4-7 are the low nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 above
    them, minimums 4-7 the high nibbles of bytes 8-11 with the top 2 bits of bytes 4-7."""
    sc, mn, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([sc & 0x3F, (both & 0xF) | ((sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([mn & 0x3F, (both >> 4) | ((mn >> 6) << 4)], axis=-1)
    return scales, mins


def _k_quantized(kind: str, data: np.ndarray) -> fj.QuantizedArray:
    """K-quant super-blocks of 256 values ``[rows, row bytes]`` -> a QuantizedArray
    ``[rows, K]`` with float32 scales (and minimums) per sub-block: ``d * sc`` and
    ``-dmin * m`` are products of a float16 and an int of at most 8 bits, exact in float32,
    and ``scale * q + minimum`` is ggml's ``d * sc * q - dmin * m`` to the bit."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, BLOCK_BYTES[kind][0])  # [rows, K / 256, bytes]
    if kind == "Q6_K":
        # ql: value 128h + 64n + j is nibble n of byte 64h + j; qh: its top 2 bits are bits
        # 2s..2s+1 of byte 32h + j for value 128h + 32s + j.
        ql, qh, sc, d = _split(blocks, 128, 64, 16, 2)
        ql = ql.reshape(rows, -1, 2, 1, 64)
        low = np.concatenate([ql & 0xF, ql >> 4], axis=-2)  # [rows, K / 256, 2, 2, 64]
        qh = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = qh & 3  # [rows, K / 256, 2, 4, 32]
        q = low.reshape(rows, -1) | (high.reshape(rows, -1) << 4)
        values = (q.astype(np.int16) - 32).astype(np.int8)
        scales = _float16(d)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
        return fj.quant.from_parts(values, scales.reshape(rows, -1), format="int8",
                                   block=(16,))
    if kind == "Q4_K":
        d, dmin, packed, qs = _split(blocks, 2, 2, 12, 128)
        qh = None
    else:
        d, dmin, packed, qh, qs = _split(blocks, 2, 2, 12, 32, 128)
    sc, mn = _scales_and_mins(packed)  # [rows, K / 256, 8]
    scales = _float16(d)[..., None] * sc.astype(np.float32)
    minimums = -(_float16(dmin)[..., None] * mn.astype(np.float32))
    # Sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i..32i + 31.
    qs = qs.reshape(rows, -1, 4, 1, 32)
    nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(rows, -1, 8, 32)
    if qh is None:
        values = fj.quant.pack_int4(nibbles.reshape(rows, -1))
        fmt = "int4"
    else:  # the 5th bit of sub-block i's value j is bit i of byte j
        bit = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        values, fmt = (nibbles | (bit << 4)).astype(np.int8).reshape(rows, -1), "int8"
    return fj.quant.from_parts(values, scales.reshape(rows, -1), minimums.reshape(rows, -1),
                               format=fmt, block=(32,))


def read_tensor(tensor, param_dtype, *, keep_quantized: bool):
    """One GGUF tensor as a float array ``[rows, cols]`` (or ``[n]``) in ``param_dtype``, or,
    for the exact types with ``keep_quantized``, as a :class:`forge_jax.QuantizedArray`."""
    import gguf

    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        data = np.asarray(tensor.data)
        if kind == "BF16":
            data = gguf.quants.dequantize(data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        return jnp.asarray(data.reshape(shape), param_dtype)
    if kind not in EXACT_TYPES:
        known = ", ".join(FLOAT_TYPES + EXACT_TYPES)
        raise CheckpointError(f"GGUF tensor {tensor.name!r} has type {kind}, which forge_jax "
                              f"does not read (it reads {known})")
    data = np.asarray(tensor.data)
    size, per_block = BLOCK_BYTES[kind]
    if data.ndim != 2 or data.shape[1] % size:
        raise CheckpointError(f"GGUF tensor {tensor.name!r} ({kind}) holds bytes of shape "
                              f"{data.shape}, not rows of whole {size}-byte blocks of "
                              f"{per_block} values")
    q = quantized(kind, data)
    return q if keep_quantized else fj.dequantize(q, param_dtype)


def map_rows(x, fn):
    """``fn`` applied to the rows of an array or of each of a QuantizedArray's arrays."""
    if isinstance(x, fj.QuantizedArray):
        return fj.quant.from_parts(
            fn(np.asarray(x.values)), fn(np.asarray(x.scales)),
            None if x.minimums is None else fn(np.asarray(x.minimums)), format=x.format,
            block=x.block)
    return jnp.asarray(fn(np.asarray(x)))


def one_layout(parts: list[fj.QuantizedArray]) -> list[fj.QuantizedArray] | None:
    """Quantized parts of different int layouts in one they all fit exactly: int8 values
    (int4's widened), the smallest group (a larger one's scales repeated), minimums if any
    part has them (zero for those without), scales in the widest dtype; None where there is
    none (fp8, or groups that do not nest)."""
    if any(p.format not in ("int8", "int4") or len(p.block) != 1 for p in parts):
        return None
    group = min(p.block[0] for p in parts)
    if any(p.block[0] % group for p in parts):
        return None
    scale_dtype = np.result_type(*(np.dtype(p.scales.dtype) for p in parts))
    asymmetric = any(p.minimums is not None for p in parts)
    out = []
    for p in parts:
        widen = lambda x, r=p.block[0] // group: jnp.repeat(x.astype(scale_dtype), r, axis=-1)
        minimums = None if not asymmetric else (
            jnp.zeros(p.scales.shape, scale_dtype) if p.minimums is None else p.minimums)
        out.append(fj.quant.from_parts(
            fj.quant.int_values(p), widen(p.scales),
            None if minimums is None else widen(minimums), format="int8", block=(group,)))
    return out


def fuse(parts: list, param_dtype):
    """Row-stacks the parts of a fused projection: quantized if they share a layout or fit
    one exactly (:func:`_one_layout`), else dequantized to ``param_dtype``."""
    q = [p for p in parts if isinstance(p, fj.QuantizedArray)]
    if len(q) == len(parts) and len({(p.format, p.block, p.minimums is None) for p in q}) > 1:
        q = one_layout(q) or []
    if len(q) == len(parts):
        # float16 and float32 scales (Q4_1 beside Q4_K) meet in float32, exactly
        scale_dtype = np.result_type(*(np.dtype(p.scales.dtype) for p in q))
        cat = lambda xs: jnp.concatenate([x.astype(scale_dtype) for x in xs], axis=0)
        return fj.quant.from_parts(
            jnp.concatenate([p.values for p in q], axis=0), cat([p.scales for p in q]),
            None if q[0].minimums is None else cat([p.minimums for p in q]),
            format=q[0].format, block=q[0].block)
    return jnp.concatenate([fj.dequantize(p, param_dtype) if isinstance(p, fj.QuantizedArray)
                            else p.astype(param_dtype) for p in parts], axis=0)
