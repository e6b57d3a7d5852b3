"""``config.quantized_in_features`` (what ``forge-jax generate --group-size`` is checked
against before a model of its own family loads) equals the in features of the kernels
``quantize=`` converts in that family's model: every linear layer's and every expert's, read
from the abstract model (no weights)."""

from __future__ import annotations

import pytest
from flax import nnx

from forge_jax.models.checkpoints import quantize as quantize_load


def _model_in_features(model) -> set[int]:
    linear = {k.shape[-1] for k in quantize_load.linear_kernels(model)}  # [out, in]
    experts = {k.shape[1] for k in quantize_load.expert_kernels(model)}  # [experts, in, out]
    return linear | experts


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
def test_qwen3_next(hf, name):
    from cases import qwen3_next

    from forge_jax.models.qwen3_next import Qwen3Next
    from forge_jax.models.qwen3_next_config import Qwen3NextConfig

    _, transformers = hf
    config_cls, _, extra = qwen3_next.CASES[name]
    raw = getattr(transformers, config_cls)(**dict(qwen3_next.BASE, **extra)).to_dict()
    config = Qwen3NextConfig.from_hf(raw)
    model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    assert set(config.quantized_in_features) == _model_in_features(model)
    assert config.linear.value_dim in config.quantized_in_features  # (out_proj's, 32)


def test_gemma4_with_every_option(hf):
    from forge_jax.models.gemma4 import Gemma4
    from forge_jax.models.gemma4_config import Gemma4Config

    _, transformers = hf
    s, f = "sliding_attention", "full_attention"
    raw = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6,
        num_hidden_layers=5, layer_types=[s, f, s, s, f], num_global_key_value_heads=1,
        attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16).to_dict()
    config = Gemma4Config.from_hf(raw)
    model = nnx.eval_shape(lambda: Gemma4(config, rngs=nnx.Rngs(0)))
    # (the double-wide MLP's 96 and the full layers' 4 x 32 among them)
    assert set(config.quantized_in_features) == _model_in_features(model) >= {96, 128}
