"""The config of the gated delta-rule hybrid decoders, Qwen3-Next (``model_type:
qwen3_next``) and Qwen3.5 text (``qwen3_5_text``): :class:`Qwen3NextConfig`, read from a
Hugging Face ``config.json`` by :meth:`Qwen3NextConfig.from_hf`.

As :mod:`forge_jax.models.families` does for the Llama-family decoders, each family's
``config.json`` keys fall in three groups: the keys read (:data:`HANDLED`), the keys that do
not change inference (:data:`IRRELEVANT`: training, initialisation, caching flags, the
multi-token-prediction head inference does not run) and the keys refused unless they hold a
harmless value (:data:`REFUSED`). Here any other key is refused too, naming it: a hybrid
model read with a setting forge_jax does not know would run a different model silently.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from forge_jax.models import families
from forge_jax.models.gated_deltanet import GatedDeltaNetConfig

LINEAR, FULL = "linear_attention", "full_attention"

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}

_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "tie_word_embeddings",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
    "model_type", "architectures", "attention_bias", "layer_types", "full_attention_interval",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "attn_output_gate"})
_MOE = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                  "mlp_only_layers"})

HANDLED = {"qwen3_next": _COMMON | _MOE, "qwen3_5_text": _COMMON}

IRRELEVANT = families.IRRELEVANT | {
    # The multi-token-prediction head (its "mtp.*" tensors are not read) and Qwen3.5's
    # vision-language wrapper's flags: text-only inference does not use them.
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "layer_scan",
    "base_config_key", "ignore_keys_at_rope_validation"}

# key -> the values that are harmless (anything else is refused, naming the key).
REFUSED: dict[str, tuple] = {
    "quantization_config": (None,),
    "use_sliding_window": (None, False),
    "sliding_window": (None,),
    "attention_dropout": (None, 0, 0.0),
    "attn_output_gate": (None, True),
    "hidden_act": (None, "silu"),
    "attention_bias": (None, False),
}

# Keys of rope_parameters: the plain RoPE's; Qwen3.5's multimodal RoPE sections, which for
# text (the same position on every section) rotate exactly as plain RoPE does.
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section",
              "mrope_interleaved"}


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    """Hyper-parameters of a Qwen3-Next or Qwen3.5 text decoder, named as in its
    ``config.json``.

    Layer ``i`` mixes its tokens with a gated delta-rule layer (``layer_types[i] ==
    "linear_attention"``: :class:`~forge_jax.models.gated_deltanet.GatedDeltaNet`, sized by
    ``linear``) or with gated full attention (``"full_attention"``: ``q_proj`` gives each
    head's query and an output gate, RMS-normed q and k, RoPE on the first ``rotary_dim``
    dims). Every RMSNorm but the delta-rule layer's gated one scales by ``1 + weight``.
    ``num_experts > 0`` (Qwen3-Next): the MLP of the layers :meth:`is_moe` names is a mixture
    of experts (softmax top-k routing, renormalised with ``norm_topk_prob``) plus a shared
    expert scaled by ``sigmoid(x @ shared_expert_gate)``; the others' a SwiGLU MLP of
    ``intermediate_size``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear: GatedDeltaNetConfig
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Read by the shared MLP modules (LlamaMLP, SparseMoe): SwiGLU without biases.
    hidden_act: str = "silu"
    mlp_bias: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type={self.model_type!r} is not one of "
                             f"{sorted(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        set_("layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {
                LINEAR, FULL}:
            raise ValueError(f"layer_types={list(self.layer_types)!r} must give "
                             f"num_hidden_layers={self.num_hidden_layers} entries, each "
                             f"{LINEAR!r} or {FULL!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor!r} of "
                             f"head_dim={self.head_dim} must rotate an even number of dims > 0")
        eos = self.eos_token_id
        if isinstance(eos, list | tuple):
            set_("eos_token_id", tuple(int(e) for e in eos))
        ids = self.eos_token_ids
        if any(isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 0 for e in ids):
            raise ValueError(f"eos_token_id must be a token id, a list of them or None, got "
                             f"eos_token_id={eos!r}")
        set_("mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size", "decoder_sparse_step"):
                _positive_int(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                 f"num_experts={self.num_experts}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)!r} must list "
                                 f"layers in [0, {self.num_hidden_layers})")

    @property
    def rotary_dim(self) -> int:
        """The dims of each attention head RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else eos if isinstance(eos, tuple) else (eos,)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Per layer, the :class:`~forge_jax.kv_cache.HybridCache` kind: ``"linear"`` or
        ``"attention"``."""
        return tuple("linear" if t == LINEAR else "attention" for t in self.layer_types)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts, as transformers decides."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def quantized_in_features(self) -> frozenset[int]:
        """The in features of the weights ``quantize=`` quantizes (attention and delta-rule
        projections, MLPs, experts, shared experts, an untied ``lm_head``): an int4 group
        must divide each."""
        n = self.num_hidden_layers
        ins = {self.hidden_size}
        if LINEAR in self.layer_types:
            ins.add(self.linear.value_dim)
        if FULL in self.layer_types:
            ins.add(self.num_attention_heads * self.head_dim)
        if any(not self.is_moe(i) for i in range(n)):
            ins.add(self.intermediate_size)
        if any(self.is_moe(i) for i in range(n)):
            ins |= {self.moe_intermediate_size, self.shared_expert_intermediate_size}
        return frozenset(ins)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, chunk_size: int = 64) -> Qwen3NextConfig:
        """From a Hugging Face ``config.json`` dict; ``chunk_size``: the delta rule's prefill
        chunk (:func:`forge_jax.gated_delta_rule`).

        Raises:
          ValueError: another model type or architecture, a missing key, a refused setting
            or an unknown key (named).
        """
        config = dict(config)
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[model_type]
        if any(a != arch for a in config.get("architectures") or [arch]):
            raise ValueError(f"architectures={config['architectures']!r} of model_type "
                             f"{model_type!r}: forge_jax reads {arch}")
        for key, allowed in REFUSED.items():
            if config.get(key) not in allowed:
                raise ValueError(f"unsupported config setting {key}={config[key]!r} for "
                                 f"model_type {model_type!r}")
        unknown = sorted(set(config) - HANDLED[model_type] - IRRELEVANT - set(REFUSED))
        if unknown:
            raise ValueError(f"unsupported config key {unknown[0]!r} (={config[unknown[0]]!r}) "
                             f"for model_type {model_type!r}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                               "linear_num_key_heads", "linear_num_value_heads",
                               "linear_key_head_dim", "linear_value_head_dim") if k not in config]
        if model_type == "qwen3_next":
            missing += [k for k in ("num_experts", "num_experts_per_tok",
                                    "moe_intermediate_size", "shared_expert_intermediate_size")
                        if k not in config]
        if missing:
            raise ValueError(f"config.json of model_type {model_type!r} lacks {missing[0]}")
        kw = {k: config[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers") if config.get(k) is not None}
        kw.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        layers = config["num_hidden_layers"]
        types = config.get("layer_types")
        if types is None:
            every = config.get("full_attention_interval", 4)
            _positive_int("full_attention_interval", every)
            types = [LINEAR if (i + 1) % every else FULL for i in range(layers)]
        theta, partial = _rope(config)
        linear = GatedDeltaNetConfig.from_hf(config, chunk_size=chunk_size)
        return cls(model_type=model_type, layer_types=tuple(types), linear=linear,
                   rope_theta=theta, partial_rotary_factor=partial, **kw)


def _rope(config: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from either transformers format; any RoPE
    scaling is refused (neither family's checkpoints use one)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    unknown = set(rope) - _ROPE_KEYS
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default") or unknown:
        raise ValueError(f"unsupported rope parameters {rope!r}: these families use the plain "
                         f"RoPE")
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor",
                             config.get("partial_rotary_factor", 0.25)) or 0.25)
    return theta, partial


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")

