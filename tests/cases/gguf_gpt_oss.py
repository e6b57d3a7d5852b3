"""gpt-oss GGUF files written the way llama.cpp's converter (``convert_hf_to_gguf.py``'s
``GptOssModel``) writes them from a Hugging Face MXFP4 checkpoint, and that checkpoint,
made from a transformers-written float one with the experts quantized by ggml's own MXFP4
quantizer (``gguf.quants``, a port of ``quantize_row_mxfp4_ref``), so no forge_jax code
writes the bytes that forge_jax reads.

The converter's steps, in NumPy: the experts' ``*_blocks`` / ``*_scales`` are repacked
into GGML MXFP4 blocks (``transform_nibble_layout``: the scale byte, then the nibbles in
GGML's order), ``gate_up_proj`` is split into gate (rows ``::2``) and up (rows ``1::2``),
biases alike, ``sinks`` becomes ``attn_sinks.weight``; no q/k permutation; 1-D tensors are
F32, 2-D ones the type asked for."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias",
          "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
              "o_proj": "attn_output"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
EXPERTS = ("gate_up_proj", "down_proj")


def hf_from_ggml(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML MXFP4 rows ``[..., K / 32 * 17]`` -> gpt-oss's ``_blocks`` ``[..., K / 32,
    16]`` (values ``2j``, ``2j + 1`` in byte ``j``'s low and high nibble) and ``_scales``
    ``[..., K / 32]``."""
    b = blocks.reshape(*blocks.shape[:-1], -1, 17)
    qs = b[..., 1:]
    values = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., K / 32, 32] in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8), b[..., 0].copy()


def transform_nibble_layout(tensor: np.ndarray) -> np.ndarray:
    """llama.cpp's ``GptOssModel.transform_nibble_layout``, step by step in NumPy:
    gpt-oss's 16 bytes of a block -> GGML's."""
    assert tensor.dtype == np.uint8 and tensor.shape[-1] == 16
    tensor = ((tensor & 0x0F) << 4) | ((tensor & 0xF0) >> 4)  # swap nibbles
    blk_a, blk_b = tensor[..., :8], tensor[..., 8:]
    a = np.stack([blk_a & 0xF0, (blk_a << 4).astype(np.uint8)], axis=-1).reshape(tensor.shape)
    b = np.stack([blk_b >> 4, blk_b & 0x0F], axis=-1).reshape(tensor.shape)
    out = a | b
    return ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """llama.cpp's ``repack_mxfp4``: ``[E, rows, K / 32, 16]`` and ``[E, rows, K / 32]``
    -> GGML MXFP4 bytes ``[E, rows, K / 32 * 17]``."""
    data = np.concatenate([scales[..., None], transform_nibble_layout(blocks)], axis=-1)
    return data.reshape(*data.shape[:2], -1)


def mxfp4_checkpoint(source: pathlib.Path, target: pathlib.Path) -> dict[str, np.ndarray]:
    """``source`` (a float gpt-oss checkpoint) copied to ``target`` with its experts in
    MXFP4 as gpt-oss ships them; returns the target's tensors."""
    import gguf
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(tuple(f"experts.{e}" for e in EXPERTS))]:
        w = np.ascontiguousarray(np.swapaxes(tensors.pop(name), 1, 2))  # [E, out, in]
        ggml = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
        tensors[name + "_blocks"], tensors[name + "_scales"] = hf_from_ggml(ggml)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (target / "config.json").write_text(json.dumps(config))
    return tensors


def write(path: pathlib.Path, checkpoint: pathlib.Path, types: dict[str, str] | None = None,
          *, fuse_gate_up: bool = False) -> dict[str, np.ndarray]:
    """Converts the checkpoint directory ``checkpoint`` (MXFP4 experts, or float ones as
    the converter writes a dequantized gpt-oss) into the GGUF file ``path``; ``types``: the
    GGUF type of the float weights by llama.cpp role (``"attn_q"``, ``"ffn_gate_exps"``,
    ...; default F32); ``fuse_gate_up``: the converter's ``--fuse-gate-up-exps`` (MXFP4
    experts). Returns the float tensors (HF names) as the file stores them, in float32."""
    import gguf
    from safetensors.numpy import load_file

    T = gguf.GGMLQuantizationType
    types = types or {}
    c = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    vocab = c["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    for key in ("bos", "eos", "pad"):
        if c.get(f"{key}_token_id") is not None:
            getattr(w, f"add_{key}_token_id")(c[f"{key}_token_id"])
    stored = {}

    def add(gname, hname, x):
        x = np.ascontiguousarray(x)
        role = gname.split(".")[-2]
        kind = types.get(role, "F32") if x.ndim >= 2 and not gname.endswith(".bias") else "F32"
        data = gguf.quants.quantize(x.astype(np.float32), T[kind])
        w.add_tensor(gname, data, raw_dtype=T[kind])
        back = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float32).reshape(x.shape)
        if hname is not None:
            stored[hname] = back
        return back

    for name, x in tensors.items():
        if name in _TOP:
            add(_TOP[name], name, x)
            continue
        _, _, n, rest = name.split(".", 3)
        p = f"blk.{n}"
        if rest in _LAYER:
            add(f"{p}.{_LAYER[rest]}", name, x)
        elif rest.startswith("self_attn."):
            proj, kind = rest.split(".")[1:]
            add(f"{p}.{_ATTENTION[proj]}.{kind}", name, x)
        elif rest == "mlp.experts.gate_up_proj_bias":
            if fuse_gate_up:
                add(f"{p}.ffn_gate_up_exps.bias", None, np.concatenate([x[..., ::2], x[..., 1::2]],
                                                                       axis=-1))
            else:
                add(f"{p}.ffn_gate_exps.bias", None, x[..., ::2])
                add(f"{p}.ffn_up_exps.bias", None, x[..., 1::2])
        elif rest == "mlp.experts.gate_up_proj":  # float experts [E, in, out]: the rows split
            rows = np.swapaxes(x, 1, 2)
            gate = add(f"{p}.ffn_gate_exps.weight", None, rows[:, ::2])
            up = add(f"{p}.ffn_up_exps.weight", None, rows[:, 1::2])
            both = np.stack([gate, up], axis=2).reshape(rows.shape)
            stored[name] = np.ascontiguousarray(np.swapaxes(both, 1, 2))
        elif rest == "mlp.experts.down_proj":
            down = add(f"{p}.ffn_down_exps.weight", None, np.swapaxes(x, 1, 2))
            stored[name] = np.ascontiguousarray(np.swapaxes(down, 1, 2))
        elif rest == "mlp.experts.down_proj_scales":
            w.add_tensor(f"{p}.ffn_down_exps.weight",
                         repack_mxfp4(tensors[name.replace("_scales", "_blocks")], x),
                         raw_dtype=T.MXFP4)
        elif rest == "mlp.experts.gate_up_proj_scales":
            blocks = tensors[name.replace("_scales", "_blocks")]
            gate = repack_mxfp4(blocks[:, ::2], x[:, ::2])
            up = repack_mxfp4(blocks[:, 1::2], x[:, 1::2])
            if fuse_gate_up:
                w.add_tensor(f"{p}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1),
                             raw_dtype=T.MXFP4)
            else:
                w.add_tensor(f"{p}.ffn_gate_exps.weight", gate, raw_dtype=T.MXFP4)
                w.add_tensor(f"{p}.ffn_up_exps.weight", up, raw_dtype=T.MXFP4)
        elif not rest.endswith("_blocks"):
            raise AssertionError(f"no GGUF name for {name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
