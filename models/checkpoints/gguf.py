"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package
(ggml's own reader; ``pip install gguf``), imported only when a ``.gguf`` file is opened.

* The ``llama`` and ``smollm3`` architectures' metadata fills a :class:`LlamaConfig`;
  llama.cpp's tensor names map onto Hugging Face's (``blk.0.attn_q.weight`` is
  ``model.layers.0.self_attn.q_proj.weight``), and the rows of ``attn_q`` and ``attn_k``,
  which llama.cpp's converter permutes for its RoPE layout, are permuted back. SmolLM3's
  files carry no NoPE pattern: llama.cpp leaves RoPE out of every 4th layer (its fixed
  ``n_no_rope_layer_step``, SmolLM3's ``no_rope_layer_interval``), and so does the loader.
* Quantized linear weights stay quantized, losslessly, as :class:`forge_jax.QuantizedArray`:
  Q8_0 -> int8 (blocks of 32, float16 scales), Q4_0 -> symmetric int4, Q4_1 -> int4 with
  minimums (nibbles reordered to the packed int4 layout), Q5_0 and Q5_1 -> int8 holding the
  5-bit values (with minimums for Q5_1; a byte a value, against GGUF's 5.5 and 6 bits).
  The K-quants' super-blocks of 256 become their sub-blocks, with float32 scales and
  minimums (ggml's ``d * sc`` and ``-dmin * m``: a float16 times an int of at most 8 bits,
  exact in float32): Q4_K -> int4 groups of 32 with minimums (6 bits a value against
  GGUF's 4.5), Q5_K -> int8 holding the 5-bit values, groups of 32 with minimums (10
  against 5.5), Q6_K -> int8 ``q - 32`` in groups of 16 (10 against 6.56).
  :func:`forge_jax.dequantize` of each equals ggml's dequantization bit for bit, and
  ``fj.matmul`` reads them through the ``quantized_matmul`` op. F32, F16 and BF16 tensors
  load as they are (cast to ``param_dtype``). The token embedding (and the norms) are
  always dequantized: the embedding lookup reads a float table.
* A fused projection (q/k/v, gate/up) stays quantized: parts of one layout (format,
  group, minimums or not) as they are, float16 scales widened to float32 (exactly) where
  the parts mix them (Q4_1 with Q4_K); parts of different int layouts (llama.cpp's Q4_K_M
  files give some layers' ``attn_v`` Q6_K beside Q4_K ``attn_q`` and ``attn_k``) in one
  they all fit exactly: int8 values, the smallest group, minimums if any part has them
  (zero for the others, so a -0.0 there reads +0.0; Q4_K with Q6_K is int8 groups of 16
  with minimums, 12 bits a weight). A part stored as floats makes the projection floats
  (``param_dtype``).
* The tokenizer (``gpt2`` byte-level BPE and SentencePiece-style ``llama`` vocabularies)
  and the chat template come from the file's metadata
  (:mod:`forge_jax.models.checkpoints.gguf_tokenizer`).
* Inside :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` a file's metadata,
  tokenizer and converted weights are kept on disk and read back by a later process.

Anything else (another architecture, a tensor type not listed, a tensor name not
mapped, a file that is not GGUF or is cut short: the tensor cut is named) is one
:class:`CheckpointError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.models.checkpoints import gguf_cache
from forge_jax.models.checkpoints.abstract import ShapeOnlyRngs, abstract_llama
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.llama_model import Linear, Llama, LlamaConfig

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") + K_TYPES
FLOAT_TYPES = ("F32", "F16", "BF16")

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architecture -> forge_jax family (model_type); llama.cpp writes SmolLM3 without its
# NoPE layers, which it fixes at every 4th (SMOLLM3_NOPE_STEP).
ARCHITECTURES = {"llama": "llama", "smollm3": "smollm3"}
SMOLLM3_NOPE_STEP = 4


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return str(path).endswith(".gguf")


def hf_name(name: str) -> str:
    """llama.cpp's tensor name -> Hugging Face's (CheckpointError for one not mapped)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.weight"
    raise CheckpointError(f"GGUF tensor {name!r} is not one forge_jax's Llama maps")


# The last file read, by (path, size, modification time) -> its reader: a command reads one
# file's config, tokenizer and weights, and parsing its metadata (a 49k-token vocabulary:
# hundreds of thousands of fields) costs seconds each time.
_LAST_READER: dict[tuple, Any] = {}


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path``; CheckpointError for a missing, foreign or
    truncated file. The last file's reader is reused while the file is unchanged."""
    with contextlib.suppress(OSError):
        st = pathlib.Path(path).stat()
        key = (str(pathlib.Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key in _LAST_READER:
            return _LAST_READER[key]
        reader = _open_gguf(path)
        _LAST_READER.clear()
        _LAST_READER[key] = reader
        return reader
    return _open_gguf(path)


def _open_gguf(path: str | os.PathLike):
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"reading {path} needs the gguf package: pip install gguf") from None
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                              f"b'GGUF')")
    try:
        return _fast_reader(gguf)(path)
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a short file
        cut = _cut_tensor(gguf, path)
        if cut is not None:
            raise CheckpointError(f"cannot read {path}: {cut} (truncated or corrupt?)") from None
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} (truncated or "
                              f"corrupt?)") from None


@functools.cache
def _fast_reader(gguf):
    """``gguf.GGUFReader`` reading its fields from a plain array over the file's memory map:
    slicing the ``np.memmap`` itself runs Python (``memmap.__array_finalize__``) for each
    of the hundreds of thousands of fields a vocabulary makes (4.5 s for SmolLM2's 49k
    tokens against 1.0 s). Tensor data stay views of the map, never copies."""

    class FastReader(gguf.GGUFReader):
        _sizes: dict = {}

        def _get(self, offset, dtype, count=1, override_order=None):
            if self.__dict__.get("_map") is not self.data:  # the map, as a plain array
                self._map, self._plain = self.data, self.data.view(np.ndarray)
            size = self._sizes.get(dtype)
            if size is None:
                size = self._sizes[dtype] = np.dtype(dtype).itemsize
            count = int(count)
            arr = self._plain[offset:offset + size * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    return FastReader


def _cut_tensor(gguf, path: pathlib.Path) -> str | None:
    """Names the first tensor whose data runs past the end of ``path``, or None (the header
    itself is cut or corrupt, or the gguf package reads differently).

    The header is read again by a reader whose short reads come back zero-filled (overriding
    ``GGUFReader._get``), so that every tensor's offset and size are known; its data is
    never used."""

    class _Padded(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            got = super()._get(offset, dtype, count, override_order)
            return got if len(got) == int(count) else np.zeros(int(count), got.dtype)

    size = path.stat().st_size
    try:
        tensors = _Padded(path).tensors
        for t in tensors:
            if t.data_offset + t.n_bytes > size:
                shape = tuple(int(n) for n in reversed(t.shape))
                return (f"GGUF tensor {t.name!r} ({t.tensor_type.name}, shape {shape}) is cut "
                        f"short: its {t.n_bytes} bytes at offset {t.data_offset} run past the "
                        f"file's end ({size} bytes)")
    except Exception:
        return None
    return None


def load_config(path: str | os.PathLike, reader=None) -> LlamaConfig:
    """The :class:`LlamaConfig` a GGUF file's metadata describes (an architecture of
    :data:`ARCHITECTURES`); inside :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache`
    the metadata is read from (and kept in) the cache."""
    meta = None if reader is not None else gguf_cache.get(path, "metadata")
    if meta is None:
        meta = _metadata(open_gguf(path) if reader is None else reader)
        gguf_cache.put(path, "metadata", meta)
    return _config(path, meta)


def _metadata(reader) -> dict[str, Any]:
    """What a config is made from: the file's fields but its arrays (of those, the length,
    under ``"#" + key``) and, under ``"#tensors"``, its tensors' names."""
    import gguf

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            meta["#" + key] = len(field.data)
        else:
            meta[key] = field.contents()
    meta["#tensors"] = [t.name for t in reader.tensors]
    return meta


def _config(path, meta: dict[str, Any]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; forge_jax "
                              f"reads {', '.join(map(repr, ARCHITECTURES))}")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    layers = int(get("block_count", 0))
    family = {} if arch == "llama" else dict(model_type=ARCHITECTURES[arch])
    if arch == "smollm3":
        family["nope_layers"] = tuple(i for i in range(layers)
                                      if (i + 1) % SMOLLM3_NOPE_STEP == 0)
    names = set(meta.get("#tensors", ()))
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: its rope_freqs tensor (Llama 3's RoPE scaling) is not "
                              f"supported in GGUF files yet")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        if get("rope.scaling.type") != "linear":
            raise CheckpointError(f"{path}: rope scaling {get('rope.scaling.type')!r} is not "
                                  f"supported")
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    try:
        return LlamaConfig(
            vocab_size=int(get("vocab_size", meta.get("#tokenizer.ggml.tokens", 0))),
            hidden_size=int(hidden), intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=layers, num_attention_heads=int(heads),
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(get("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), **family)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its {arch} metadata does not make a config: {e}") from None


# --------------------------------------------------------------------------------------
# Tensors


def _halves(qs: np.ndarray) -> np.ndarray:
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


def _quantized(kind: str, data: np.ndarray) -> fj.QuantizedArray:
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
        nibbles = _halves(qs).reshape(rows, -1)  # Q4_0's offset of 8 is int4's own
        # (packed in NumPy: a JAX op here compiles for every tensor shape at each start)
        values, fmt = fj.quant.pack_int4(nibbles), "int4"
    else:
        if kind == "Q5_0":
            d, qh, qs = _split(blocks, 2, 4, 16)
        else:
            d, m, qh, qs = _split(blocks, 2, 2, 4, 16)
            minimums = f16(m)
        q = (_halves(qs) | (_high_bits(qh) << 4)).astype(np.int16)
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


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (its converter's ``permute``) on the rows
    of ``x`` ``[heads * head_dim, ...]``."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


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
    q = _quantized(kind, data)
    return q if keep_quantized else fj.dequantize(q, param_dtype)


def _rows(x, fn):
    """``fn`` applied to the rows of an array or of each of a QuantizedArray's arrays."""
    if isinstance(x, fj.QuantizedArray):
        return fj.quant.from_parts(
            fn(np.asarray(x.values)), fn(np.asarray(x.scales)),
            None if x.minimums is None else fn(np.asarray(x.minimums)), format=x.format,
            block=x.block)
    return jnp.asarray(fn(np.asarray(x)))


def _one_layout(parts: list[fj.QuantizedArray]) -> list[fj.QuantizedArray] | None:
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


def _fuse(parts: list, param_dtype):
    """Row-stacks the parts of a fused projection: quantized if they share a layout or fit
    one exactly (:func:`_one_layout`), else dequantized to ``param_dtype``."""
    q = [p for p in parts if isinstance(p, fj.QuantizedArray)]
    if len(q) == len(parts) and len({(p.format, p.block, p.minimums is None) for p in q}) > 1:
        q = _one_layout(q) or []
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


def from_gguf(path: str | os.PathLike, *, dtype, param_dtype) -> Llama:
    """Loads a llama-architecture GGUF file (see the module docstring); inside
    :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` the converted weights are
    read from (and kept in) the cache."""
    config = load_config(path)
    name = jnp.dtype(param_dtype).name
    weights = gguf_cache.load_weights(path, name)
    if weights is None:
        weights = _read_weights(path, open_gguf(path), config, param_dtype)
        gguf_cache.save_weights(path, name, weights)
    return _assemble(path, config, weights, dtype=dtype, param_dtype=param_dtype)


def _read_weights(path, reader, config: LlamaConfig, param_dtype) -> dict[str, Any]:
    """The file's tensors in the layout the model reads, by the model's names: q/k rows
    permuted back, q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``), a tied quantized
    output head (``lm_head.weight``) read from the embedding table as stored."""
    tensors = {hf_name(t.name): t for t in reader.tensors}

    def get(name, *, keep_quantized=False, heads=None):
        if name not in tensors:
            raise CheckpointError(f"{path} lacks the tensor {name!r} (llama.cpp's name for it: "
                                  f"see forge_jax.models.checkpoints.gguf)")
        x = read_tensor(tensors.pop(name), param_dtype, keep_quantized=keep_quantized)
        if heads is not None:
            x = _rows(x, lambda a: _unpermute(a, heads))
        return x

    c, out = config, {}
    embed = tensors.get("model.embed_tokens.weight")
    if c.tie_word_embeddings and embed is not None and embed.tensor_type.name in EXACT_TYPES:
        # A tied output head read from the quantized table as it is stored (the embedding
        # lookup reads the float table below): decode then reads the output head at the
        # file's bits a weight, as llama.cpp does, with the same values.
        out["lm_head.weight"] = read_tensor(embed, param_dtype, keep_quantized=True)
    out["model.embed_tokens.weight"] = get("model.embed_tokens.weight")
    out["model.norm.weight"] = get("model.norm.weight")
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = get(f"{p}.{norm}.weight")
        out[f"{p}.self_attn.qkv_proj.weight"] = _fuse(
            [get(f"{p}.self_attn.q_proj.weight", keep_quantized=True,
                 heads=c.num_attention_heads),
             get(f"{p}.self_attn.k_proj.weight", keep_quantized=True,
                 heads=c.num_key_value_heads),
             get(f"{p}.self_attn.v_proj.weight", keep_quantized=True)], param_dtype)
        out[f"{p}.self_attn.o_proj.weight"] = get(f"{p}.self_attn.o_proj.weight",
                                                  keep_quantized=True)
        out[f"{p}.mlp.gate_up_proj.weight"] = _fuse(
            [get(f"{p}.mlp.gate_proj.weight", keep_quantized=True),
             get(f"{p}.mlp.up_proj.weight", keep_quantized=True)], param_dtype)
        out[f"{p}.mlp.down_proj.weight"] = get(f"{p}.mlp.down_proj.weight",
                                               keep_quantized=True)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = get("lm_head.weight", keep_quantized=True)
    if tensors:
        raise CheckpointError(f"{path}: unexpected tensors {sorted(tensors)[:5]} for a Llama "
                              f"with this metadata")
    return out


def _assemble(path, config: LlamaConfig, weights: dict[str, Any], *, dtype,
              param_dtype) -> Llama:
    """The Llama holding ``weights`` (:func:`_read_weights`' names), each shape checked."""
    model = abstract_llama(config, dtype=dtype, param_dtype=param_dtype)

    def put(variable, name, label):
        if name not in weights:
            raise CheckpointError(f"{path} lacks the tensor {name!r}")
        x = weights[name]
        if tuple(x.shape) != tuple(variable.shape):
            raise CheckpointError(f"{path}: tensor {label!r} has shape {tuple(x.shape)}, "
                                  f"expected {tuple(variable.shape)} from its metadata")
        variable.set_value(x)

    c = config
    if model.lm_head is None and "lm_head.weight" in weights:
        head = nnx.eval_shape(lambda: Linear(c.hidden_size, c.vocab_size, use_bias=False,
                                             rngs=ShapeOnlyRngs(), dtype=dtype,
                                             param_dtype=param_dtype))
        put(head.kernel, "lm_head.weight", "token_embd")
        model.lm_head = nnx.data(head)
    put(model.embed_tokens, "model.embed_tokens.weight", "token_embd")
    model.norm.weight.set_value(weights["model.norm.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        layer.input_layernorm.weight.set_value(weights[f"{p}.input_layernorm.weight"])
        layer.post_attention_layernorm.weight.set_value(
            weights[f"{p}.post_attention_layernorm.weight"])
        attn, mlp = layer.self_attn, layer.mlp
        put(attn.qkv_proj.kernel, f"{p}.self_attn.qkv_proj.weight", f"{p}.qkv")
        put(attn.o_proj.kernel, f"{p}.self_attn.o_proj.weight", f"{p}.o_proj")
        put(mlp.gate_up_proj.kernel, f"{p}.mlp.gate_up_proj.weight", f"{p}.gate_up")
        put(mlp.down_proj.kernel, f"{p}.mlp.down_proj.weight", f"{p}.down_proj")
    if not c.tie_word_embeddings:
        put(model.lm_head.kernel, "lm_head.weight", "output")
    model.generation_config = GenerationConfig(eos_token_id=c.eos_token_ids)
    return model
