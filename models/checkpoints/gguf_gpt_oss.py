"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture), as llama.cpp's converter
(``convert_hf_to_gguf.py``'s ``GptOssModel``) writes them and its loader reads them.

* Metadata -> the ``gpt_oss`` family's config: ``expert_count`` / ``expert_used_count``
  (experts, top-k), ``expert_feed_forward_length`` (the experts' width),
  ``attention.sliding_window`` (on the even layers: llama.cpp's swa pattern 2, as
  gpt-oss's ``layer_types``), ``attention.key_length`` (head_dim) and YaRN
  (``rope.scaling.type`` ``yarn``, ``factor``, ``original_context_length``,
  ``yarn_beta_fast`` / ``yarn_beta_slow``, default 32 and 1 as llama.cpp's). The file
  carries neither the SwiGLU clamp nor YaRN's ``truncate``: the clamp is gpt-oss's
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7, the constants llama.cpp compiles in), the
  correction range is not rounded (gpt-oss's ``truncate: false``; llama.cpp's RoPE
  rounds it to whole dimensions, a small departure of llama.cpp's from the model). A YaRN
  key whose meaning differs between llama.cpp and transformers (``yarn_attn_factor``,
  ``yarn_ext_factor``, ``yarn_log_multiplier``) is refused naming it, unless neutral.
* Tensors: q/k are not permuted (gpt-oss's RoPE is the half-split one, llama.cpp's
  NeoX mode); the attention projections have biases, ``attn_sinks.weight`` holds the sinks,
  ``post_attention_norm`` is the norm before the experts, ``ffn_gate_inp`` (weight and
  bias) the router. The converter splits gpt-oss's interleaved ``gate_up_proj`` (rows
  ``::2`` gate, ``1::2`` up) into ``ffn_gate_exps`` and ``ffn_up_exps`` (or, fused,
  ``ffn_gate_up_exps``: the gate rows, then the up rows), biases alike; the loader
  interleaves them again (the layout of :class:`~forge_jax.models.llama_moe.BiasedMoe`).
* Experts stored MXFP4 (GGML type 39: per 32 values one E8M0 byte, then 16 bytes holding
  value ``j`` in byte ``j``'s low nibble and value ``j + 16`` in its high one; the codes and
  the scale ``2**(e - 127)`` are OCP E2M1 / E8M0, as ``dequantize_row_mxfp4`` decodes them)
  load as ``"mxfp4"`` :class:`forge_jax.QuantizedArray` s ``[experts, out, in]``, the
  nibbles reordered (bytes as gpt-oss ships them), no float copy. Experts in another exact
  GGUF type stay quantized in that type's layout; float ones load as floats.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.models.checkpoints.abstract import abstract_llama
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.checkpoints.gguf_reader import field
from forge_jax.models.checkpoints.gguf_tensors import (
    EXACT_TYPES,
    FLOAT_TYPES,
    fuse,
    halves,
    map_rows,
    one_layout,
    quantized,
    read_tensor,
)
from forge_jax.models.llama_model import Llama, LlamaConfig

ARCH = "gpt-oss"
# llama.cpp's swiglu_oai constants for gpt-oss (llm_graph_context::build_moe_ffn).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
MXFP4_BLOCK = (17, 32)  # bytes a block, values a block
# YaRN keys llama.cpp reads with a meaning of its own: refused unless they hold the value
# that changes nothing.
_NEUTRAL_YARN = {"yarn_attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0}

_ATTENTION = {"attn_q": "q", "attn_k": "k", "attn_v": "v"}


def load_config(path: str | os.PathLike, reader) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``gpt-oss`` GGUF file's metadata."""
    get = lambda key, default=None: field(reader, f"{ARCH}.{key}", default)
    tokens = field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    raw = dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"],
        vocab_size=get("vocab_size", len(tokens) if tokens else None), hidden_size=hidden,
        intermediate_size=get("expert_feed_forward_length", get("feed_forward_length")),
        num_hidden_layers=get("block_count"), num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length"),
        rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
        num_local_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
        sliding_window=get("attention.sliding_window"), attention_bias=True,
        max_position_embeddings=get("context_length"), swiglu_alpha=SWIGLU_ALPHA,
        swiglu_limit=SWIGLU_LIMIT, tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
        rope_parameters=_rope(path, get))
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "num_local_experts", "num_experts_per_tok", "intermediate_size",
                           "rms_norm_eps") if raw[k] is None]
    if missing:
        raise CheckpointError(f"{path}: its {ARCH} metadata lacks the keys for {missing}")
    raw = {k: v for k, v in raw.items() if v is not None}
    try:
        return LlamaConfig.from_hf(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its {ARCH} metadata does not make a config: {e}") from None


def _decimal(value):
    """A float32 metadata value as the shortest decimal that is that float32 (the value the
    converter was given: 1e-05, not 9.999999747378752e-06); None stays None."""
    return None if value is None else float(str(np.float32(value)))


def _rope(path, get) -> dict:
    """The ``rope_parameters`` dict of the file's RoPE keys."""
    rope = {"rope_theta": float(get("rope.freq_base", 150000.0))}
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return dict(rope, rope_type="default")
    if kind != "yarn":
        raise CheckpointError(f"{path}: {ARCH}.rope.scaling.type={kind!r} is not supported for "
                              f"{ARCH} (it reads 'yarn' and 'none')")
    for key, neutral in _NEUTRAL_YARN.items():
        value = get(f"rope.scaling.{key}")
        if value is not None and float(value) != neutral:
            raise CheckpointError(f"{path}: {ARCH}.rope.scaling.{key}={value!r} is not "
                                  f"supported (only {neutral})")
    if get("rope.scaling.original_context_length") is None or get("rope.scaling.factor") is None:
        raise CheckpointError(f"{path}: yarn RoPE scaling needs {ARCH}.rope.scaling.factor and "
                              f"{ARCH}.rope.scaling.original_context_length")
    return dict(rope, rope_type="yarn", factor=float(get("rope.scaling.factor")),
                original_max_position_embeddings=int(
                    get("rope.scaling.original_context_length")),
                beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)


# --------------------------------------------------------------------------------------
# Tensors


def mxfp4(data: np.ndarray) -> fj.QuantizedArray:
    """GGML MXFP4 blocks ``[..., rows, row bytes]`` (uint8) -> an ``"mxfp4"``
    QuantizedArray ``[..., rows, K]``: each 17-byte block's E8M0 byte is the scale, its
    nibbles reordered from GGML's halves (value ``j`` and ``j + 16`` in byte ``j``) to
    consecutive pairs (values ``2j`` and ``2j + 1`` in byte ``j``); the codes themselves
    are the same E2M1 codes."""
    size, per_block = MXFP4_BLOCK
    blocks = data.reshape(*data.shape[:-1], -1, size)  # [..., K / 32, 17]
    scales, qs = blocks[..., 0], blocks[..., 1:]
    values = fj.quant.pack_int4(halves(qs)).reshape(*data.shape[:-1], -1)
    return fj.quant.from_parts(values, np.ascontiguousarray(scales), format="mxfp4",
                               block=(per_block,))


def read_experts(tensor, param_dtype):
    """A stacked expert tensor ``[experts, out, in]`` as GGUF stores it: MXFP4 or an exact
    type as a QuantizedArray ``[experts, out, in]``, a float type as floats in
    ``param_dtype``."""
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))  # [experts, out, in]
    if len(shape) != 3:
        raise CheckpointError(f"GGUF tensor {tensor.name!r} has shape {shape}, not the "
                              f"[experts, out, in] of stacked experts")
    data = np.asarray(tensor.data)
    if kind == "MXFP4":
        if data.shape != (*shape[:2], shape[2] // 32 * MXFP4_BLOCK[0]) or shape[2] % 32:
            raise CheckpointError(f"GGUF tensor {tensor.name!r} (MXFP4, shape {shape}) holds "
                                  f"bytes of shape {data.shape}, not rows of whole 17-byte "
                                  f"blocks of 32 values")
        return mxfp4(data)
    if kind in FLOAT_TYPES:
        return read_tensor(tensor, param_dtype, keep_quantized=False)
    if kind not in EXACT_TYPES:
        known = ", ".join(("MXFP4",) + FLOAT_TYPES + EXACT_TYPES)
        raise CheckpointError(f"GGUF tensor {tensor.name!r} has type {kind}, which forge_jax "
                              f"does not read for experts (it reads {known})")
    q = quantized(kind, data.reshape(shape[0] * shape[1], -1))
    return map_rows(q, lambda a: a.reshape(*shape[:2], -1))


def interleave(gate, up):
    """Gate and up rows ``[experts, f, ...]`` each -> ``[experts, 2f, ...]`` with row ``2i``
    gate ``i`` and ``2i + 1`` up ``i`` (gpt-oss's ``gate_up_proj``), arrays or
    QuantizedArrays of one layout (rows are independent in every GGUF type)."""
    pair = lambda g, u: np.stack([np.asarray(g), np.asarray(u)], axis=2).reshape(
        g.shape[0], 2 * g.shape[1], *g.shape[2:])
    layout = lambda q: (q.format, q.block, q.minimums is None)
    both = isinstance(gate, fj.QuantizedArray) + isinstance(up, fj.QuantizedArray)
    if both == 2 and layout(gate) != layout(up):  # e.g. Q4_K beside Q6_K: one exact layout
        gate, up = one_layout([gate, up]) or (gate, up)
    if both == 1 or (both == 2 and layout(gate) != layout(up)):
        kind = lambda x: (f"{x.format} in blocks of {x.block}"
                          if isinstance(x, fj.QuantizedArray) else "floats")
        raise CheckpointError(f"the experts' gate ({kind(gate)}) and up ({kind(up)}) have no "
                              f"common exact layout; forge_jax loads them as one interleaved "
                              f"tensor")
    if isinstance(gate, fj.QuantizedArray):
        return fj.quant.from_parts(
            pair(gate.values, up.values), pair(gate.scales, up.scales),
            None if gate.minimums is None else pair(gate.minimums, up.minimums),
            format=gate.format, block=gate.block)
    return jnp.asarray(pair(gate, up))


def from_gguf(path: str | os.PathLike, reader, *, dtype, param_dtype) -> Llama:
    """Loads a ``gpt-oss`` GGUF file (see the module docstring)."""
    config = load_config(path, reader)
    tensors = {t.name: t for t in reader.tensors}
    model = abstract_llama(config, dtype=dtype, param_dtype=param_dtype)

    def take(name):
        if name not in tensors:
            raise CheckpointError(f"{path} lacks the tensor {name!r} (llama.cpp's {ARCH} "
                                  f"layout: see forge_jax.models.checkpoints.gguf_gpt_oss)")
        return tensors.pop(name)

    def get(name, *, keep_quantized=False):
        return read_tensor(take(name), param_dtype, keep_quantized=keep_quantized)

    def put(param, name, x):
        want = tuple(param.shape)
        if isinstance(x, fj.QuantizedArray) and len(want) == 3:  # experts: [E, out, in]
            want = (want[0], want[2], want[1])
        if tuple(x.shape) != want:
            raise CheckpointError(f"{path}: tensor {name!r} gives shape {tuple(x.shape)}, "
                                  f"expected {want} from its metadata")
        param.set_value(x if isinstance(x, fj.QuantizedArray) else x.astype(param_dtype))

    c = config
    put(model.embed_tokens, "token_embd.weight", get("token_embd.weight"))
    put(model.norm.weight, "output_norm.weight", get("output_norm.weight"))
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}"
        put(layer.input_layernorm.weight, f"{p}.attn_norm", get(f"{p}.attn_norm.weight"))
        put(layer.post_attention_layernorm.weight, f"{p}.post_attention_norm",
            get(f"{p}.post_attention_norm.weight"))
        attn, moe = layer.self_attn, layer.mlp
        qkv = [get(f"{p}.{n}.weight", keep_quantized=True) for n in _ATTENTION]
        put(attn.qkv_proj.kernel, f"{p}.attn_qkv", fuse(qkv, param_dtype))
        put(attn.qkv_proj.bias, f"{p}.attn_qkv.bias",
            jnp.concatenate([get(f"{p}.{n}.bias") for n in _ATTENTION]))
        put(attn.o_proj.kernel, f"{p}.attn_output", get(f"{p}.attn_output.weight",
                                                        keep_quantized=True))
        put(attn.o_proj.bias, f"{p}.attn_output.bias", get(f"{p}.attn_output.bias"))
        put(attn.sinks, f"{p}.attn_sinks", get(f"{p}.attn_sinks.weight"))
        put(moe.router, f"{p}.ffn_gate_inp", get(f"{p}.ffn_gate_inp.weight"))
        put(moe.router_bias, f"{p}.ffn_gate_inp.bias", get(f"{p}.ffn_gate_inp.bias"))
        gate, up, gate_b, up_b = _gate_up(p, tensors, take, param_dtype, c.moe_intermediate_size)
        gate_up = interleave(gate, up)
        down = read_experts(take(f"{p}.ffn_down_exps.weight"), param_dtype)
        if not isinstance(gate_up, fj.QuantizedArray):  # floats: the [experts, in, out] layout
            gate_up, down = jnp.swapaxes(gate_up, 1, 2), jnp.swapaxes(down, 1, 2)
        elif not isinstance(down, fj.QuantizedArray):
            raise CheckpointError(f"{path}: {p}'s expert gate/up are quantized and down is not; "
                                  f"forge_jax loads both one way")
        put(moe.gate_up, f"{p}.ffn_gate_up_exps", _with_dtype(gate_up, param_dtype))
        put(moe.down, f"{p}.ffn_down_exps", _with_dtype(down, param_dtype))
        put(moe.gate_up_bias, f"{p}.ffn_gate_up_exps.bias", interleave(gate_b, up_b))
        put(moe.down_bias, f"{p}.ffn_down_exps.bias", get(f"{p}.ffn_down_exps.bias"))
    if not c.tie_word_embeddings:
        put(model.lm_head.kernel, "output.weight", get("output.weight", keep_quantized=True))
    if tensors:
        raise CheckpointError(f"{path}: unexpected tensors {sorted(tensors)[:5]} for a {ARCH} "
                              f"model with this metadata")
    model.generation_config = GenerationConfig(eos_token_id=c.eos_token_ids)
    return model


def _gate_up(p, tensors, take, param_dtype, width):
    """(gate, up, gate bias, up bias) of layer ``p``'s experts, from the split tensors or
    the fused ``ffn_gate_up_exps`` (gate rows first)."""
    fused = f"{p}.ffn_gate_up_exps.weight"
    if fused not in tensors:
        gate = read_experts(take(f"{p}.ffn_gate_exps.weight"), param_dtype)
        up = read_experts(take(f"{p}.ffn_up_exps.weight"), param_dtype)
        read = lambda n: read_tensor(take(n), param_dtype, keep_quantized=False)
        return (gate, up, read(f"{p}.ffn_gate_exps.bias"), read(f"{p}.ffn_up_exps.bias"))
    both = read_experts(take(fused), param_dtype)
    bias = read_tensor(take(f"{p}.ffn_gate_up_exps.bias"), param_dtype,
                            keep_quantized=False)
    half = lambda x, s: map_rows(x, lambda a: a[:, s])
    return (half(both, slice(0, width)), half(both, slice(width, None)),
            bias[:, :width], bias[:, width:])


def _with_dtype(x, param_dtype):
    """A QuantizedArray stands for ``param_dtype`` values; floats cast to it."""
    if isinstance(x, fj.QuantizedArray):
        return fj.quant.from_parts(x.values, x.scales, x.minimums, format=x.format,
                                   block=x.block, dtype=param_dtype)
    return x.astype(param_dtype)
