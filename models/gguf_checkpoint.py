"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package
(ggml's own reader; ``pip install gguf``), imported only when a ``.gguf`` file is opened.

* The ``llama`` architecture's metadata fills a :class:`LlamaConfig`; llama.cpp's tensor
  names map onto Hugging Face's (``blk.0.attn_q.weight`` is
  ``model.layers.0.self_attn.q_proj.weight``), and the rows of ``attn_q`` and ``attn_k``,
  which llama.cpp's converter permutes for its RoPE layout, are permuted back.
* Quantized linear weights stay quantized, losslessly, as :class:`forge_jax.QuantizedArray`:
  Q8_0 -> int8 (blocks of 32, float16 scales), Q4_0 -> symmetric int4, Q4_1 -> int4 with
  minimums (nibbles reordered to the packed int4 layout), Q5_0 and Q5_1 -> int8 holding the
  5-bit values (with minimums for Q5_1; a byte a value, against GGUF's 5.5 and 6 bits).
  The K-quants Q4_K, Q5_K and Q6_K are dequantized to ``param_dtype`` at load (exact
  values, float storage). F32, F16 and BF16 tensors load as they are (cast to
  ``param_dtype``). The token embedding (and the norms) are always dequantized: the
  embedding lookup reads a float table.
* A fused projection (q/k/v, gate/up) whose parts have different types is dequantized.
* The tokenizer (``gpt2`` byte-level BPE and SentencePiece-style ``llama`` vocabularies)
  and the chat template come from the file's metadata (:func:`tokenizer_parts`).

Anything else (another architecture, a tensor type not listed, a tensor name not
mapped, a file that is not GGUF or is cut short) is one :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.models.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.llama_model import Llama, LlamaConfig

EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
DEQUANTIZED_TYPES = ("Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` of ``path``; CheckpointError for a missing, foreign or
    truncated file."""
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
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a short file
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} (truncated or "
                              f"corrupt?)") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_config(path: str | os.PathLike, reader=None) -> LlamaConfig:
    """The :class:`LlamaConfig` a GGUF file's metadata describes (architecture ``llama``)."""
    reader = open_gguf(path) if reader is None else reader
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; forge_jax "
                              f"reads 'llama'")
    get = lambda key, default=None: _field(reader, f"llama.{key}", default)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: its rope_freqs tensor (Llama 3's RoPE scaling) is not "
                              f"supported in GGUF files yet")
    tokens = _field(reader, "tokenizer.ggml.tokens")
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
            vocab_size=int(get("vocab_size", len(tokens) if tokens else 0)),
            hidden_size=int(hidden), intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")), num_attention_heads=int(heads),
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(get("context_length", 2048)),
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
            pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its llama metadata does not make a config: {e}") from None


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


def _quantized(kind: str, data: np.ndarray) -> fj.QuantizedArray:
    """GGUF blocks ``[rows, row bytes]`` of type ``kind`` -> a QuantizedArray ``[rows, K]``."""
    rows = data.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[kind]
    blocks = data.reshape(rows, -1, size)  # [rows, K / 32, bytes]
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
        values, fmt = np.asarray(fj.quant.pack_int4(jnp.asarray(nibbles))), "int4"
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
    if kind not in EXACT_TYPES + DEQUANTIZED_TYPES:
        known = ", ".join(FLOAT_TYPES + EXACT_TYPES + DEQUANTIZED_TYPES)
        raise CheckpointError(f"GGUF tensor {tensor.name!r} has type {kind}, which forge_jax "
                              f"does not read (it reads {known})")
    data = np.asarray(tensor.data)
    if kind in EXACT_TYPES:
        q = _quantized(kind, data)
        return q if keep_quantized else fj.dequantize(q, param_dtype)
    return jnp.asarray(gguf.quants.dequantize(data, tensor.tensor_type), param_dtype)


def _rows(x, fn):
    """``fn`` applied to the rows of an array or of each of a QuantizedArray's arrays."""
    if isinstance(x, fj.QuantizedArray):
        return fj.quant.from_parts(
            fn(np.asarray(x.values)), fn(np.asarray(x.scales)),
            None if x.minimums is None else fn(np.asarray(x.minimums)), format=x.format,
            block=x.block)
    return jnp.asarray(fn(np.asarray(x)))


def _fuse(parts: list, param_dtype):
    """Row-stacks the parts of a fused projection (quantized if they all share a layout)."""
    q = [p for p in parts if isinstance(p, fj.QuantizedArray)]
    if len(q) == len(parts) and len({(p.format, p.block, p.minimums is None,
                                      p.scales.dtype) for p in q}) == 1:
        cat = lambda xs: jnp.concatenate(xs, axis=0)
        return fj.quant.from_parts(
            cat([p.values for p in q]), cat([p.scales for p in q]),
            None if q[0].minimums is None else cat([p.minimums for p in q]),
            format=q[0].format, block=q[0].block)
    return jnp.concatenate([fj.dequantize(p, param_dtype) if isinstance(p, fj.QuantizedArray)
                            else p.astype(param_dtype) for p in parts], axis=0)


def from_gguf(path: str | os.PathLike, *, dtype, param_dtype) -> Llama:
    """Loads a llama-architecture GGUF file (see the module docstring)."""
    reader = open_gguf(path)
    config = load_config(path, reader)
    tensors = {}
    for t in reader.tensors:
        tensors[hf_name(t.name)] = t
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype,
                                         param_dtype=param_dtype))

    def get(name, *, keep_quantized=False, heads=None):
        if name not in tensors:
            raise CheckpointError(f"{path} lacks the tensor {name!r} (llama.cpp's name for it: "
                                  f"see forge_jax.models.gguf_checkpoint)")
        x = read_tensor(tensors.pop(name), param_dtype, keep_quantized=keep_quantized)
        if heads is not None:
            x = _rows(x, lambda a: _unpermute(a, heads))
        return x

    def check(name, x, shape):
        if tuple(x.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(x.shape)}, "
                                  f"expected {tuple(shape)} from its metadata")
        return x

    c = config
    model.embed_tokens.set_value(check("token_embd", get("model.embed_tokens.weight"),
                                       model.embed_tokens.shape))
    model.norm.weight.set_value(get("model.norm.weight"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        layer.input_layernorm.weight.set_value(get(f"{p}.input_layernorm.weight"))
        layer.post_attention_layernorm.weight.set_value(
            get(f"{p}.post_attention_layernorm.weight"))
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [get(f"{p}.self_attn.q_proj.weight", keep_quantized=True,
                   heads=c.num_attention_heads),
               get(f"{p}.self_attn.k_proj.weight", keep_quantized=True,
                   heads=c.num_key_value_heads),
               get(f"{p}.self_attn.v_proj.weight", keep_quantized=True)]
        attn.qkv_proj.kernel.set_value(check(f"{p}.qkv", _fuse(qkv, param_dtype),
                                             attn.qkv_proj.kernel.shape))
        attn.o_proj.kernel.set_value(check(f"{p}.o_proj", get(
            f"{p}.self_attn.o_proj.weight", keep_quantized=True), attn.o_proj.kernel.shape))
        gate_up = [get(f"{p}.mlp.gate_proj.weight", keep_quantized=True),
                   get(f"{p}.mlp.up_proj.weight", keep_quantized=True)]
        mlp.gate_up_proj.kernel.set_value(check(f"{p}.gate_up", _fuse(gate_up, param_dtype),
                                                mlp.gate_up_proj.kernel.shape))
        mlp.down_proj.kernel.set_value(check(f"{p}.down_proj", get(
            f"{p}.mlp.down_proj.weight", keep_quantized=True), mlp.down_proj.kernel.shape))
    if model.lm_head is not None:
        model.lm_head.kernel.set_value(check("output", get("lm_head.weight", keep_quantized=True),
                                             model.lm_head.kernel.shape))
    if tensors:
        raise CheckpointError(f"{path}: unexpected tensors {sorted(tensors)[:5]} for a Llama "
                              f"with this metadata")
    model.generation_config = GenerationConfig(eos_token_id=c.eos_token_ids)
    return model


# --------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_parts(path: str | os.PathLike) -> dict[str, Any]:
    """The pieces of a GGUF file's tokenizer, for :func:`forge_jax.models.text.load_tokenizer`:
    ``backend`` (a ``tokenizers.Tokenizer``), ``special_tokens``, ``chat_template`` and
    ``generation_config``.

    ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` and
    ``merges``, control tokens as special tokens. ``llama``: SentencePiece-style tokens with
    scores and types (:mod:`forge_jax.models.gguf_sentencepiece`). Another model is a
    CheckpointError naming it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from forge_jax.models import gguf_sentencepiece

    reader = open_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: its tokenizer model {kind!r} (tokenizer.ggml.model) is "
                              f"not supported; forge_jax builds 'gpt2' (byte-level BPE) and "
                              f"'llama' (SentencePiece) vocabularies from GGUF files")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        get = lambda name: _field(reader, f"tokenizer.ggml.{name}")
        flag = lambda name, default: bool(default if get(name) is None else get(name))
        backend = gguf_sentencepiece.tokenizer(
            tokens, get("scores"), types, unk_id=get("unknown_token_id"),
            bos_id=get("bos_token_id"), eos_id=get("eos_token_id"),
            add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
            add_space_prefix=flag("add_space_prefix", True))
        return _parts(reader, tokens, backend)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=False) if kind in (3, 4)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return _parts(reader, tokens, backend)


def _parts(reader, tokens: list[str], backend) -> dict[str, Any]:
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            special[{"unknown": "unk_token", "padding": "pad_token"}.get(
                name, f"{name}_token")] = tokens[i]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return dict(backend=backend, special_tokens=special,
                chat_template=_field(reader, "tokenizer.chat_template"),
                generation_config=GenerationConfig(eos_token_id=() if eos is None else (eos,)))
