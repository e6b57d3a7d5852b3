"""Tiny random-weight Qwen3-Next and Qwen3.5 text checkpoints written by transformers
(``tests/test_qwen3_next*.py``): three gated delta-rule layers, then a gated full-attention
layer; Qwen3-Next's mixture of experts with its gated shared expert and a dense layer among
the sparse ones (``mlp_only_layers``)."""

from __future__ import annotations

import pathlib

from cases.hf_families import save_checkpoint

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
            rms_norm_eps=1e-6)
# model_type -> (transformers config class, causal LM class, config kwargs over BASE)
CASES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
}


def write(name: str, directory: pathlib.Path, *, tokenizer: pathlib.Path | None = None):
    """Family ``name``'s checkpoint with random weights (norms around 0: these families
    scale by ``1 + weight``) in ``directory``; returns transformers' model read back."""
    config_cls, model_cls, extra = CASES[name]
    return save_checkpoint(directory, config_cls, model_cls, dict(BASE, **extra), seed=0,
                           gemma_norms=True, tokenizer=tokenizer)
