"""DeepSeek-V3's config (``model_type: deepseek_v3``): the sizes and switches of its
``config.json``, as transformers names them; the model is :mod:`forge_jax.models.deepseek`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import forge_jax as fj
from forge_jax.ops.mla import yarn_softmax_scale


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The sizes and switches of a DeepSeek-V3 checkpoint's ``config.json`` (the names are
    transformers')."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    rope_scaling: fj.RopeScaling | None = None
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale: ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor,
        mscale_all_dim) ** 2`` with YaRN rope scaling (transformers' ``yarn_apply_mscale``);
        the RoPE tables carry YaRN's own attention factor."""
        s = self.rope_scaling
        if s is None or not s.mscale_all_dim:
            return yarn_softmax_scale(self.qk_head_dim)
        return yarn_softmax_scale(self.qk_head_dim, s.factor, s.mscale_all_dim)

    @property
    def quantized_in_features(self) -> frozenset[int]:
        """The in features of the weights ``quantize=`` quantizes (the projections, the
        dense MLPs, the routed and shared experts): an int4 group must divide each."""
        ins = {self.hidden_size, self.num_attention_heads * self.v_head_dim,
               self.moe_intermediate_size, self.moe_intermediate_size * self.n_shared_experts}
        if self.q_lora_rank is not None:
            ins.add(self.q_lora_rank)
        if self.first_k_dense_replace:
            ins.add(self.intermediate_size)
        return frozenset(ins)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DeepseekV3Config:
        """The config of a transformers ``config.json`` of ``model_type`` ``deepseek_v3``;
        raises ValueError naming what this module does not compute."""
        if config.get("model_type") != "deepseek_v3":
            raise ValueError(f"not a DeepSeek-V3 config: model_type={config.get('model_type')!r}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_type={kind!r}: DeepSeek-V3 checkpoints use the default "
                             "RoPE or YaRN")
        scaling = fj.RopeScaling.from_hf(
            {k: v for k, v in rope.items() if k != "rope_theta"},
            max_position_embeddings=config.get("max_position_embeddings"))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r}: DeepSeek-V3 uses silu")
        if config.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported (DeepSeek-V3 has none)")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        eos = config.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in np.atleast_1d(eos))
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in ("rope_theta", "rope_scaling", "eos_token_ids")]
        return cls(rope_theta=float(theta), rope_scaling=scaling, eos_token_ids=eos,
                   **{n: config[n] for n in names if n in config})
