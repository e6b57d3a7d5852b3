"""Small GGUF files written by the tests with the ``gguf`` package (ggml's own writer), and
the Hugging Face weights each one stands for.

A random Llama in Hugging Face's layout is written as llama.cpp's converter writes it: its
names (``blk.0.attn_q.weight``), the q/k rows permuted for llama.cpp's RoPE layout
(``convert_hf_to_gguf.py``'s ``LlamaModel.permute``), each linear weight quantized with
``gguf.quants``. The reference weights are those values in Hugging Face's order: the
quantization works row by row, so ``dequantize(quantize(w))`` needs no permutation."""

from __future__ import annotations

import json
import pathlib

import numpy as np

CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              model_type="llama", architectures=["LlamaForCausalLM"], bos_token_id=1,
              eos_token_id=2)

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# K-quant block layouts for random blocks (any bytes are a valid block once its float16
# scales are finite): bytes a block, the offsets of its float16 ``d`` and ``dmin`` (None:
# symmetric), and the mean of its unsigned values, so that ``dmin = mean * d`` centres the
# weights on average (sub-block scales and minimums are random bytes of the same range).
# Q2_K is one forge_jax does not read (the unknown-type test).
K_QUANTS = {"Q4_K": (144, 0, 2, 7.5), "Q5_K": (176, 0, 2, 15.5), "Q6_K": (210, 208, None, 0),
            "Q2_K": (84, 80, 82, 1.5)}


def random_llama(seed: int, config: dict = CONFIG) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face's names."""
    gen = np.random.default_rng(seed)
    c = config
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c[
        "num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        shapes.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (c["num_attention_heads"] * hd, h),
            f"{p}.self_attn.k_proj.weight": (c["num_key_value_heads"] * hd, h),
            f"{p}.self_attn.v_proj.weight": (c["num_key_value_heads"] * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, c["num_attention_heads"] * hd),
            f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h),
            f"{p}.mlp.down_proj.weight": (h, i)})
    return {name: (gen.uniform(0.5, 1.5, s) if len(s) == 1 else gen.normal(0, 0.2, s)
                   ).astype(np.float32) for name, s in shapes.items()}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, n, rest = name.split(".", 3)
    return f"blk.{n}.{_LAYER[rest.rsplit('.', 1)[0]]}.weight"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: HF's q/k rows -> its RoPE layout."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute`: llama.cpp's RoPE layout -> HF's q/k rows."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write(path: pathlib.Path, weights: dict[str, np.ndarray], types: dict[str, str], *,
          config: dict = CONFIG, arch: str = "llama", seed: int = 0,
          tokenizer: dict | None = None) -> dict[str, np.ndarray]:
    """Writes a GGUF file of ``weights`` (HF names) with each linear weight of the type
    ``types`` gives by its llama.cpp role (``"attn_q"``, ``"ffn_down"``, ...; default
    F32); returns the float32 HF weights the file stands for."""
    import gguf

    T = gguf.GGMLQuantizationType
    gen = np.random.default_rng(seed)
    c = config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])
    if tokenizer:  # gpt2 (tokens, merges, types) or llama (tokens, scores, types), ...
        writer.add_tokenizer_model(tokenizer.get("model", "gpt2"))
        writer.add_token_list(tokenizer["tokens"])
        if "merges" in tokenizer:
            writer.add_token_merges(tokenizer["merges"])
        if tokenizer.get("pre"):
            writer.add_tokenizer_pre(tokenizer["pre"])
        if "scores" in tokenizer:
            writer.add_token_scores(tokenizer["scores"])
        writer.add_token_types(tokenizer["types"])
        if "unk_token_id" in tokenizer:
            writer.add_unk_token_id(tokenizer["unk_token_id"])
        for flag in ("add_bos_token", "add_eos_token", "add_space_prefix"):
            if flag in tokenizer:
                getattr(writer, f"add_{flag}")(tokenizer[flag])
        if tokenizer.get("chat_template"):
            writer.add_chat_template(tokenizer["chat_template"])
    reference = {}
    for name, w in weights.items():
        gname = gguf_name(name)
        role = gname.split(".")[-2]
        kind = types.get(role, "F32") if w.ndim == 2 else "F32"
        heads = {"attn_q": c["num_attention_heads"], "attn_k": c["num_key_value_heads"]}.get(
            role)
        stored = permute(w, heads) if heads else w
        if kind in K_QUANTS:  # gguf cannot quantize these: random blocks with finite scales
            size, d_at, dmin_at, mean = K_QUANTS[kind]
            data = gen.integers(0, 256, (w.shape[0], w.shape[1] // 256, size), dtype=np.uint8)
            d = gen.uniform(1e-4, 1e-3, data.shape[:2] + (1,))
            data[..., d_at:d_at + 2] = d.astype(np.float16).view(np.uint8)
            if dmin_at is not None:
                data[..., dmin_at:dmin_at + 2] = (mean * d).astype(np.float16).view(np.uint8)
            data = data.reshape(w.shape[0], -1)
            ref = gguf.quants.dequantize(data, T[kind])  # the rows as stored
            if heads:
                ref = unpermute(ref, heads)
        elif kind in ("F32", "F16", "BF16"):
            data = gguf.quants.quantize(stored, T[kind]) if kind != "BF16" else (
                gguf.quants.BF16.quantize(stored))
            ref = gguf.quants.dequantize(gguf.quants.quantize(w, T[kind]) if kind != "BF16"
                                         else gguf.quants.BF16.quantize(w), T[kind])
        else:
            data = gguf.quants.quantize(stored, T[kind])
            ref = gguf.quants.dequantize(gguf.quants.quantize(w, T[kind]), T[kind])
        writer.add_tensor(gname, data, raw_dtype=T[kind])
        reference[name] = np.asarray(ref, np.float32).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def write_hf(directory: pathlib.Path, weights: dict[str, np.ndarray], config: dict = CONFIG
             ) -> pathlib.Path:
    """The same weights as a Hugging Face checkpoint directory (the reference model)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(weights, str(directory / "model.safetensors"))
    return directory
