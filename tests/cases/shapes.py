"""Shapes of released models, for the case tables: kernels are tested at the sizes they
serve (head counts that make odd groups, head dims that are not powers of two, hidden
sizes that are not multiples of a block)."""

from __future__ import annotations

import forge_jax as fj

# Attention heads: (q_heads, kv_heads, head_dim).
LLAMA3_8B_HEADS = (32, 8, 128)  # Llama 3 / 3.1 8B: groups of 4
SMOLLM2_135M_HEADS = (9, 3, 64)  # SmolLM / SmolLM2 135M: groups of 3, odd head count
GEMMA2_2B_HEADS = (8, 4, 256)  # Gemma 2 2B: groups of 2, head_dim 256 (window, soft cap)
# Gemma 4 (transformers' default config): the full layers' head_dim 512, which is also the
# width of its KV cache (the sliding layers' 256 zero-padded into it), unscaled attention.
GEMMA4_HEADS = (8, 4, 512)

# Head dims besides 64 and 128.
PHI2_HEAD_DIM = 80

# Hidden sizes (rms_norm rows).
SMOLLM_HIDDEN = 576  # not a multiple of 128 lanes
LLAMA32_1B_HIDDEN = 2048
GPT_OSS_HIDDEN = 2880
LLAMA2_13B_HIDDEN = 5120

# MLP widths (silu_mul).
SMOLLM_MLP = 1536
LLAMA32_1B_MLP = 8192
LLAMA3_8B_MLP = 14336

# RoPE: Llama 3.1's theta and scaling, SmolLM's theta, a linear scaling.
LLAMA31_THETA = 5e5
LLAMA31_SCALING = fj.RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192)
SMOLLM_THETA = 1e5
LINEAR_SCALING = fj.RopeScaling("linear", factor=4.0)
