"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package
(ggml's own reader; ``pip install gguf``), imported only when a ``.gguf`` file is opened.

* The ``llama`` and ``smollm3`` architectures' metadata fills a :class:`LlamaConfig`
  (``gpt-oss``: :mod:`forge_jax.models.checkpoints.gguf_gpt_oss`, MXFP4 experts);
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
  and the chat template come from the file's metadata (:func:`tokenizer_parts`).
* Inside :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` a file's metadata,
  tokenizer and converted weights are kept on disk and read back by a later process.

Anything else (another architecture, a tensor type not listed, a tensor name not
mapped, a file that is not GGUF or is cut short: the tensor cut is named) is one
:class:`CheckpointError` naming it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.models.checkpoints import gguf_cache
from forge_jax.models.checkpoints.abstract import ShapeOnlyRngs, abstract_llama
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.checkpoints.gguf_reader import field, open_gguf
from forge_jax.models.checkpoints.gguf_tensors import EXACT_TYPES, fuse, map_rows, read_tensor
from forge_jax.models.llama_model import Linear, Llama, LlamaConfig

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architecture -> forge_jax family (model_type); llama.cpp writes SmolLM3 without its
# NoPE layers, which it fixes at every 4th (SMOLLM3_NOPE_STEP).
ARCHITECTURES = {"llama": "llama", "smollm3": "smollm3", "gpt-oss": "gpt_oss"}
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


def load_config(path: str | os.PathLike, reader=None) -> LlamaConfig:
    """The :class:`LlamaConfig` a GGUF file's metadata describes (an architecture of
    :data:`ARCHITECTURES`); inside :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache`
    the metadata is read from (and kept in) the cache."""
    meta = None if reader is not None else gguf_cache.get(path, "metadata")
    if meta is None:
        reader = open_gguf(path) if reader is None else reader
        meta = _metadata(reader)
        gguf_cache.put(path, "metadata", meta)
    if meta.get("general.architecture") == "gpt-oss":  # its own reader: experts, sinks, YaRN
        from forge_jax.models.checkpoints import gguf_gpt_oss

        return gguf_gpt_oss.load_config(path, open_gguf(path) if reader is None else reader)
    return _config(path, meta)


def _metadata(reader) -> dict[str, Any]:
    """What a config is made from: the file's fields but its arrays (of those, the length,
    under ``"#" + key``) and, under ``"#tensors"``, its tensors' names."""
    import gguf

    meta: dict[str, Any] = {}
    for key, value in reader.fields.items():
        if value.types and value.types[0] == gguf.GGUFValueType.ARRAY:
            meta["#" + key] = len(value.data)
        else:
            meta[key] = value.contents()
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


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (its converter's ``permute``) on the rows
    of ``x`` ``[heads * head_dim, ...]``."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)



def from_gguf(path: str | os.PathLike, *, dtype, param_dtype) -> Llama:
    """Loads a llama-architecture GGUF file (see the module docstring); inside
    :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` the converted weights are
    read from (and kept in) the cache."""
    config = load_config(path)
    if config.model_type == ARCHITECTURES["gpt-oss"]:
        from forge_jax.models.checkpoints import gguf_gpt_oss

        return gguf_gpt_oss.from_gguf(path, open_gguf(path), dtype=dtype,
                                      param_dtype=param_dtype)
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
            x = map_rows(x, lambda a: _unpermute(a, heads))
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
        out[f"{p}.self_attn.qkv_proj.weight"] = fuse(
            [get(f"{p}.self_attn.q_proj.weight", keep_quantized=True,
                 heads=c.num_attention_heads),
             get(f"{p}.self_attn.k_proj.weight", keep_quantized=True,
                 heads=c.num_key_value_heads),
             get(f"{p}.self_attn.v_proj.weight", keep_quantized=True)], param_dtype)
        out[f"{p}.self_attn.o_proj.weight"] = get(f"{p}.self_attn.o_proj.weight",
                                                  keep_quantized=True)
        out[f"{p}.mlp.gate_up_proj.weight"] = fuse(
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


# --------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_parts(path: str | os.PathLike) -> dict[str, Any]:
    """The pieces of a GGUF file's tokenizer, for :func:`forge_jax.text.api.load_tokenizer`:
    ``backend`` (a ``tokenizers.Tokenizer``), ``special_tokens``, ``chat_template`` and
    ``generation_config`` (how: :func:`_convert_tokenizer`). Inside
    :func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` they are read from (and
    kept in) the cache, the tokenizer as ``tokenizer.json``."""
    parts = _kept_tokenizer(path)
    if parts is None:
        parts = _convert_tokenizer(path)
        gguf_cache.put(path, "tokenizer", {
            "special_tokens": parts["special_tokens"], "chat_template": parts["chat_template"],
            "eos_token_id": list(parts["generation_config"].eos_token_id)}, extra_files=[
            ("tokenizer.json", parts["backend"].to_str().encode())])
    return parts


def _kept_tokenizer(path) -> dict[str, Any] | None:
    info = gguf_cache.get(path, "tokenizer")
    data = None if not isinstance(info, dict) else gguf_cache.read_file(path, "tokenizer.json")
    if data is None:
        return None
    from tokenizers import Tokenizer

    try:
        return dict(backend=Tokenizer.from_str(data.decode()),
                    special_tokens=dict(info["special_tokens"]),
                    chat_template=info["chat_template"],
                    generation_config=GenerationConfig(
                        eos_token_id=tuple(int(i) for i in info["eos_token_id"])))
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own error types)
        gguf_cache.logger.warning("ignoring the kept GGUF tokenizer of %s: %s", path, e)
        return None


def _convert_tokenizer(path: str | os.PathLike) -> dict[str, Any]:
    """A GGUF file's tokenizer from its metadata.

    ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` and
    ``merges``, split first as ``tokenizer.ggml.pre`` says
    (:mod:`~forge_jax.models.checkpoints.gguf_pretokenizers`: o200k, Llama 3's), control
    tokens as special tokens, a BOS first when ``tokenizer.ggml.add_bos_token`` is set
    (Llama 3's). ``llama``: SentencePiece-style tokens with scores and types
    (:mod:`forge_jax.models.checkpoints.gguf_sentencepiece`). Another model is a
    CheckpointError naming it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from forge_jax.models.checkpoints import gguf_pretokenizers, gguf_sentencepiece

    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: its tokenizer model {kind!r} (tokenizer.ggml.model) is "
                              f"not supported; forge_jax builds 'gpt2' (byte-level BPE) and "
                              f"'llama' (SentencePiece) vocabularies from GGUF files")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        get = lambda name: field(reader, f"tokenizer.ggml.{name}")
        flag = lambda name, default: bool(default if get(name) is None else get(name))
        backend = gguf_sentencepiece.tokenizer(
            tokens, get("scores"), types, unk_id=get("unknown_token_id"),
            bos_id=get("bos_token_id"), eos_id=get("eos_token_id"),
            add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
            add_space_prefix=flag("add_space_prefix", True))
        return _parts(reader, tokens, backend)
    merges = field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=False))
    backend.pre_tokenizer = gguf_pretokenizers.pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=False) if kind in (3, 4)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # tokenizer.ggml.add_bos_token (off unless set, as llama.cpp reads a BPE vocabulary's):
    # the post-processor adds the BOS, so that every prompt is encoded as llama.cpp does.
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if field(reader, "tokenizer.ggml.add_bos_token") and bos is not None \
            and 0 <= bos < len(tokens):
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return _parts(reader, tokens, backend)


def _parts(reader, tokens: list[str], backend) -> dict[str, Any]:
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            special[{"unknown": "unk_token", "padding": "pad_token"}.get(
                name, f"{name}_token")] = tokens[i]
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return dict(backend=backend, special_tokens=special,
                chat_template=field(reader, "tokenizer.chat_template"),
                generation_config=GenerationConfig(eos_token_id=() if eos is None else (eos,)))
