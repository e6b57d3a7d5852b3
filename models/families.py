"""The decoder families forge_jax reads, as data: how each family's Hugging Face
``config.json`` maps onto the one model's config
(:class:`~forge_jax.models.llama_config.LlamaConfig`).

Every family runs through the same layers (:mod:`forge_jax.models.llama_model`); what
differs is a handful of config fields (bias on q/k/v, QK-norm, sliding windows per layer,
soft caps, sandwich norms, GeGLU, scaled embeddings, partial rotary, the checkpoint's
fused tensors, and for the mixtures of experts the expert count, top-k, routing
normalisation and which layers are sparse). :func:`config_kwargs` reads a ``config.json``
dict into those fields.

Each family lists its ``config.json`` keys in three groups: the keys it reads
(``HANDLED``), the keys that do not change inference (``IRRELEVANT``: dropout in
training, initialisation, caching flags) and the keys it refuses unless they hold a
harmless value (``REFUSED``: a feature forge_jax does not implement is an error naming the
key, never a silently different model). ``tests/test_families.py`` checks that every field
of each family's transformers config is in one of them. Other keys are ignored, as
transformers' model classes ignore them (a ``quantization_config`` is refused in every
family: its tensors are not plain weights; fine-grained FP8's is read before this, by
:mod:`forge_jax.models.checkpoints.fp8`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import forge_jax as fj

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family.

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architecture: its ``architectures`` entry (the causal-LM class).
      fixed: config fields the family fixes (not read from the file), e.g. Qwen2's
        ``qkv_bias=True``.
      handled: ``config.json`` keys read into the config.
      refused: keys refused unless their value is one of the listed harmless ones.
      layer_pattern: the default ``layer_types`` rule when the file has none:
        ``"all"`` (every layer slides when ``sliding_window`` is set), ``"every_2"`` /
        ``"every_6"`` (every 2nd / 6th layer is global), ``"qwen"`` (layers from
        ``max_window_layers`` on slide when ``use_sliding_window``), ``"nope"`` (the
        layers without RoPE slide, when ``use_sliding_window``: SmolLM3).
    """

    model_type: str
    architecture: str
    fixed: Mapping[str, Any]
    handled: frozenset[str]
    refused: Mapping[str, tuple]
    layer_pattern: str = "all"


# Keys of every family that the model reads.
_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "model_type",
    "architectures"})

# Keys that do not change inference, in any family.
IRRELEVANT = frozenset({
    "initializer_range", "use_cache", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions",
    "chunk_size_feed_forward", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "id2label", "label2id", "problem_type", "tokenizer_class",
    "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task",
    "auto_map", "_attn_implementation_autoset", "_commit_hash",
    "attention_dropout", "mlp_dropout", "resid_pdrop", "embd_pdrop", "is_decoder",
    "pruned_heads", "torchscript", "use_return_dict", "output_scores", "return_dict_in_generate",
    "base_model_tp_plan",
    "base_model_pp_plan", "keys_to_ignore_at_inference", "num_labels",
    # Training-only tensor-parallel slicing; the same maths.
    "pretraining_tp",
    # A yarn / longrope parameter (Phi-3 writes it at the top level: read there); without
    # such a scaling it changes nothing.
    "original_max_position_embeddings",
    # Which KV cache class transformers' generate uses (Gemma's "hybrid"); ours is chosen
    # per layer from layer_types.
    "cache_implementation",
})

# Keys of the mixture-of-experts families that the model reads (the expert count is
# "num_experts" in Qwen's files, "num_local_experts" in Mixtral's and in transformers 5's).
_MOE = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok"})
_QWEN_MOE = _MOE | {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                    "mlp_only_layers"}
# Training only: the router's auxiliary loss, and Mixtral's router noise (applied only in
# training mode).
IRRELEVANT = IRRELEVANT | {"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}

# Keys refused in every family unless absent or None.
_REFUSED_EVERYWHERE = ("quantization_config",)

_DROPOUT = (None, 0.0, 0)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", {}, _COMMON | {"attention_bias", "mlp_bias"},
           {"pretraining_tp": (None, 1), "attention_dropout": _DROPOUT,
            "mlp_dropout": _DROPOUT}),
    Family("mistral", "MistralForCausalLM", {}, _COMMON | {"sliding_window"},
           {"layer_types": (None,)}),
    Family("qwen2", "Qwen2ForCausalLM", {"qkv_bias": True},
           _COMMON | {"sliding_window", "use_sliding_window", "max_window_layers",
                      "layer_types"}, {}, "qwen"),
    Family("qwen3", "Qwen3ForCausalLM", {"qk_norm": True},
           _COMMON | {"attention_bias", "sliding_window", "use_sliding_window",
                      "max_window_layers", "layer_types"}, {}, "qwen"),
    Family("gemma2", "Gemma2ForCausalLM",
           {"norm_offset": 1.0, "sandwich_norms": True, "scale_embeddings": True},
           _COMMON | {"hidden_activation", "attention_bias", "query_pre_attn_scalar",
                      "sliding_window", "layer_types", "final_logit_softcapping",
                      "attn_logit_softcapping"},
           {"use_bidirectional_attention": (None, False)}, "every_2"),
    Family("gemma3_text", "Gemma3ForCausalLM",
           {"norm_offset": 1.0, "sandwich_norms": True, "scale_embeddings": True,
            "qk_norm": True},
           _COMMON | {"hidden_activation", "attention_bias", "query_pre_attn_scalar",
                      "sliding_window", "layer_types", "final_logit_softcapping",
                      "attn_logit_softcapping", "rope_local_base_freq",
                      "sliding_window_pattern", "_sliding_window_pattern"},
           {"use_bidirectional_attention": (None, False)}, "every_6"),
    Family("phi3", "Phi3ForCausalLM", {"fused_checkpoint": True},
           _COMMON | {"sliding_window", "partial_rotary_factor",
                      "original_max_position_embeddings"}, {}),
    # Mixtral: Mistral's attention; experts as wide as intermediate_size; the top-k weights
    # always renormalised.
    Family("mixtral", "MixtralForCausalLM", {"norm_topk_prob": True},
           _COMMON | _MOE | {"sliding_window"}, {"layer_types": (None,)}),
    # Qwen2-MoE: Qwen2's attention (q/k/v bias), a shared expert beside the routed ones.
    # Its sliding-window layer pattern (every other layer below max_window_layers) is not
    # implemented: use_sliding_window is refused.
    Family("qwen2_moe", "Qwen2MoeForCausalLM", {"qkv_bias": True},
           _COMMON | _QWEN_MOE | {"qkv_bias", "shared_expert_intermediate_size",
                                  "sliding_window", "use_sliding_window", "max_window_layers",
                                  "layer_types"},
           {"use_sliding_window": (None, False)}),
    # Qwen3-MoE: Qwen3's attention (QK-norm); with use_sliding_window every layer slides.
    Family("qwen3_moe", "Qwen3MoeForCausalLM", {"qk_norm": True},
           _COMMON | _QWEN_MOE | {"attention_bias", "sliding_window", "use_sliding_window"},
           {"layer_types": (None,)}),
    # SmolLM3: Llama with RoPE left out of some layers (no_rope_layers: 1 = RoPE, 0 = NoPE;
    # by default every no_rope_layer_interval-th layer is NoPE), which slide when
    # use_sliding_window.
    Family("smollm3", "SmolLM3ForCausalLM", {},
           _COMMON | {"attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval",
                      "sliding_window", "use_sliding_window", "layer_types"}, {}, "nope"),
    # gpt-oss: attention sinks, biases on q/k/v/o, sliding and full layers alternating,
    # YaRN; every layer a mixture of experts with gpt-oss's biased experts and clamped
    # SwiGLU (LlamaConfig.expert_bias).
    Family("gpt_oss", "GptOssForCausalLM",
           {"attention_sinks": True, "expert_bias": True},
           _COMMON | _MOE | {"attention_bias", "sliding_window", "layer_types", "swiglu_alpha",
                             "swiglu_limit"}, {}, "every_2_first"),
    # Llama 4 (text): NoPE every no_rope_layer_interval-th layer (no_rope_layers), the RoPE
    # layers chunked (attention_chunk_size) with an L2 QK-norm, attention temperature
    # tuning on the NoPE layers, interleaved RoPE; MoE layers (moe_layers or every
    # interleave_moe_layer_step-th) with a sigmoid top-k router scaling the experts'
    # input and a shared expert; dense layers of width intermediate_size_mlp.
    Family("llama4_text", "Llama4ForCausalLM",
           {"rope_interleaved": True, "sigmoid_router": True},
           _COMMON | _MOE | {"attention_bias", "intermediate_size_mlp", "moe_layers",
                             "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
                             "no_rope_layer_interval", "attention_chunk_size", "layer_types",
                             "attn_temperature_tuning", "floor_scale", "attn_scale"}, {},
           "llama4"),
)}

SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


# Checkpoints forge_jax reads with a model of their own, not the Llama-family decoder: the
# model_type -> its loader, ``loader(path, *, dtype, quantize, group_size, mesh, tp_axis,
# dp_axis)`` returning a forge_jax.models.protocol.CausalLM. The common entry point
# (forge_jax.models.llama.from_pretrained) hands such a checkpoint to it (loader_for).
ELSEWHERE = {"deepseek_v3": "forge_jax.models.deepseek.from_pretrained"}
# The gated delta-rule hybrids (forge_jax.models.qwen3_next).
ELSEWHERE.update(dict.fromkeys(("qwen3_next", "qwen3_5_text"),
                               "forge_jax.models.qwen3_next_checkpoint.from_pretrained"))


def loader_for(config: Mapping[str, Any]):
    """The loader of a ``config.json`` dict whose ``model_type`` has a model of its own
    (:data:`ELSEWHERE`), imported; None for the Llama-family decoder's."""
    import importlib

    name = ELSEWHERE.get(config.get("model_type"))
    if name is None:
        return None
    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), function)


def family(config: Mapping[str, Any]) -> Family:
    """The :class:`Family` of a ``config.json`` dict, from ``model_type`` and
    ``architectures`` (which must agree); ValueError naming both otherwise."""
    model_type = config.get("model_type", "llama")
    fam = FAMILIES.get(model_type)
    architectures = config.get("architectures") or ([fam.architecture] if fam else [])
    if model_type in ELSEWHERE:
        raise ValueError(f"model_type={model_type!r} is not a Llama-family decoder: "
                         f"load it with {ELSEWHERE[model_type]}")
    if fam is None or any(a != fam.architecture for a in architectures):
        supported = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())
        raise ValueError(
            f"unsupported checkpoint: model_type={model_type!r}, architectures={architectures!r}; "
            f"forge_jax reads {supported}")
    return fam


def config_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json`` dict -> the keyword arguments of ``LlamaConfig``.

    Raises:
      ValueError: another family, a refused key with a value other than its harmless
        one (naming the key), an unsupported rope type or activation.
    """
    config = dict(config)
    fam = family(config)
    for key in _REFUSED_EVERYWHERE:
        if config.get(key) is not None:
            raise ValueError(f"unsupported config setting {key}={config[key]!r}: forge_jax "
                             f"reads float checkpoints, and fine-grained fp8 ones "
                             f"(quant_method 'fp8')")
    for key, allowed in fam.refused.items():
        if config.get(key) not in allowed:
            raise ValueError(f"unsupported config setting {key}={config[key]!r} for "
                             f"model_type {fam.model_type!r}")
    out: dict[str, Any] = dict(fam.fixed, model_type=fam.model_type)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias",
                "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                "qkv_bias", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "shared_expert_intermediate_size", "swiglu_alpha",
                "swiglu_limit"):
        if key in fam.handled and config.get(key) is not None:
            out[key] = config[key]
    if fam.handled >= _MOE:
        out.update(_experts(config, fam))
    if fam.model_type.startswith("gemma"):
        # Gemma names its activation hidden_activation (hidden_act is an older alias).
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        out["hidden_act"] = act
        # HF's Gemma configs always tie the output head to the embeddings unless told not to.
        out.setdefault("tie_word_embeddings", True)
    elif config.get("hidden_act") is not None:
        out["hidden_act"] = config["hidden_act"]
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in out]
    if missing:
        raise ValueError(f"config.json lacks required keys {missing}")
    out.update(_rope(config, fam))
    out.update(_nope(config, fam, out["num_hidden_layers"]))
    if fam.model_type == "llama4_text":
        out.update(_llama4(config, out))
        return out
    out.update(_windows(config, fam, out["num_hidden_layers"]))
    return out


def _llama4(config: dict, out: dict) -> dict[str, Any]:
    """Llama 4's MoE layers, widths, chunks and attention settings."""
    layers = out["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step", 1)
    moe = config.get("moe_layers")
    moe = list(range(step - 1, layers, step)) if moe is None else list(moe)
    chunk = config.get("attention_chunk_size")
    chunked = "chunked_attention"
    want = [chunked if i not in out["nope_layers"] and chunk is not None else FULL
            for i in range(layers)]
    types = config.get("layer_types")
    if types is not None and list(types) != want:
        raise ValueError(f"unsupported layer_types={list(types)!r}: forge_jax chunks the RoPE "
                         f"layers ({want!r})")
    if config.get("intermediate_size_mlp") is None:
        raise ValueError("config.json of model_type 'llama4_text' lacks intermediate_size_mlp")
    return {"intermediate_size": config["intermediate_size_mlp"],
            "moe_intermediate_size": config["intermediate_size"],
            "shared_expert_intermediate_size": config["intermediate_size"],
            "mlp_only_layers": tuple(i for i in range(layers) if i not in moe),
            "qk_l2_norm": bool(config.get("use_qk_norm", True)),
            "attention_chunk_size": chunk,
            "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
            "floor_scale": float(config.get("floor_scale", 8192)),
            "attn_scale": float(config.get("attn_scale", 0.1))}


def _nope(config: dict, fam: Family, layers: int) -> dict[str, Any]:
    """nope_layers (the layers without RoPE) from SmolLM3's ``no_rope_layers`` mask
    (1: RoPE, 0: none) or its ``no_rope_layer_interval``."""
    if "no_rope_layers" not in fam.handled:
        return {}
    mask = config.get("no_rope_layers") or None  # Llama 4 writes [] for the default
    if mask is None:
        every = config.get("no_rope_layer_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"no_rope_layer_interval must be a positive int, got "
                             f"no_rope_layer_interval={every!r}")
        mask = [int((i + 1) % every != 0) for i in range(layers)]
    if len(mask) != layers or set(mask) - {0, 1}:
        raise ValueError(f"no_rope_layers={list(mask)!r} must give {layers} layers, each 0 "
                         f"(no RoPE) or 1 (RoPE)")
    return {"nope_layers": tuple(i for i, m in enumerate(mask) if not m)}


def _experts(config: dict, fam: Family) -> dict[str, Any]:
    """num_experts (under either name), mlp_only_layers as a tuple, and Mixtral's expert
    width (its ``intermediate_size``)."""
    names = [k for k in ("num_experts", "num_local_experts") if config.get(k) is not None]
    if len({config[k] for k in names}) > 1:
        raise ValueError(f"config.json gives two expert counts: num_experts="
                         f"{config['num_experts']!r}, num_local_experts="
                         f"{config['num_local_experts']!r}")
    missing = [k for k in ("num_experts_per_tok",) if config.get(k) is None]
    if not names or missing:
        raise ValueError(f"config.json of model_type {fam.model_type!r} lacks "
                         f"{'num_experts' if not names else missing[0]}")
    out: dict[str, Any] = {"num_experts": config[names[0]]}
    if "mlp_only_layers" in fam.handled:
        out["mlp_only_layers"] = tuple(config.get("mlp_only_layers") or ())
        if "moe_intermediate_size" not in config:
            raise ValueError(f"config.json of model_type {fam.model_type!r} lacks "
                             f"moe_intermediate_size")
    else:
        out["moe_intermediate_size"] = config.get("intermediate_size")
    if ("shared_expert_intermediate_size" in fam.handled
            and config.get("shared_expert_intermediate_size") is None):
        raise ValueError(f"config.json of model_type {fam.model_type!r} lacks "
                         f"shared_expert_intermediate_size")
    return out


# --------------------------------------------------------------------------------------
# RoPE

_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "partial_rotary_factor"}


def _rope(config: dict, fam: Family) -> dict[str, Any]:
    """rope_theta, rope_scaling, and where the family has them rope_local_theta and
    partial_rotary_factor, from either HF config format (transformers 4's top-level
    keys, transformers 5's ``rope_parameters``, per layer type for Gemma 3)."""
    params = config.get("rope_parameters")
    out: dict[str, Any] = {}
    if fam.model_type == "gemma3_text" and isinstance(params, Mapping) and any(
            isinstance(v, Mapping) for v in params.values()):
        unknown = set(params) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"unsupported rope_parameters layer types {sorted(unknown)}")
        theta, scaling, partial = _flat_rope(params.get(FULL) or {}, 1_000_000.0)
        local, local_scaling, local_partial = _flat_rope(params.get(SLIDING) or {}, 10_000.0)
        if local_scaling is not None or local_partial != 1.0:
            raise ValueError(f"unsupported rope_parameters[{SLIDING!r}]={params[SLIDING]!r}: "
                             f"scaled or partial RoPE on the sliding layers")
        out["rope_local_theta"] = local
    else:
        if params is not None and (not isinstance(params, Mapping) or any(
                isinstance(v, Mapping) for v in params.values())):
            raise ValueError(f"unsupported rope_parameters {params!r}: expected one flat dict "
                             f"(per-layer-type RoPE is not part of model_type "
                             f"{fam.model_type!r})")
        default = 1_000_000.0 if fam.model_type == "gemma3_text" else 10_000.0
        if params is None:
            rope = dict(config.get("rope_scaling") or {})
            rope.setdefault("rope_theta", config.get("rope_theta", default))
        else:
            rope = dict(params)
            rope.setdefault("rope_theta", config.get("rope_theta", default))
        if "partial_rotary_factor" in config:
            rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
        theta, scaling, partial = _flat_rope(rope, default, _context(config, fam))
        if fam.model_type == "gemma3_text":
            out["rope_local_theta"] = float(config.get("rope_local_base_freq", 10_000.0))
    if partial != 1.0:
        if fam.model_type != "phi3":
            raise ValueError(f"unsupported partial_rotary_factor={partial!r} for model_type "
                             f"{fam.model_type!r}")
        out["partial_rotary_factor"] = partial
    out.update(rope_theta=theta, rope_scaling=scaling)
    return out


def _context(config: dict, fam: Family) -> dict[str, Any]:
    """The top-level context lengths that yarn, longrope and dynamic NTK scaling read
    (``max_position_embeddings``; Phi-3's ``original_max_position_embeddings``)."""
    out = {"max_position_embeddings": config.get("max_position_embeddings")}
    if fam.model_type == "phi3":
        out["original_max_position_embeddings"] = config.get("original_max_position_embeddings")
    return out


def _flat_rope(rope: Mapping, default_theta: float,
               context: Mapping[str, Any] | None = None) -> tuple[float, Any, float]:
    """(theta, RopeScaling or None, partial_rotary_factor) of one flat rope dict;
    ``context``: the keyword arguments of ``RopeScaling.from_hf`` for yarn, longrope
    and dynamic NTK (the config's top-level context lengths)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default") and "factor" in rope:
        raise ValueError(f"rope parameters {dict(rope)!r} give a factor but no rope_type")
    unknown = set(rope) - _ROPE_KEYS
    if unknown and kind in ("linear", "llama3", "default", None):
        # e.g. "attention_factor": not part of these types in transformers, and forge_jax
        # will not guess what it means.
        raise ValueError(f"unsupported rope parameters {sorted(unknown)} in {dict(rope)!r}")
    scaling_keys = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    partial = float(rope.get("partial_rotary_factor", 1.0) or 1.0)
    theta = float(rope.get("rope_theta", default_theta))
    return theta, fj.RopeScaling.from_hf(scaling_keys or None, **(context or {})), partial


# --------------------------------------------------------------------------------------
# Sliding windows per layer

def _windows(config: dict, fam: Family, layers: int) -> dict[str, Any]:
    """sliding_window and layer_types (a tuple of ``"sliding_attention"`` /
    ``"full_attention"``, one per layer), as transformers resolves them."""
    window = config.get("sliding_window")
    if (fam.model_type.startswith("qwen") or fam.model_type == "smollm3") and not config.get(
            "use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    if "sliding_window" not in fam.handled or window is None:
        types = config.get("layer_types")
        if types and SLIDING in types and window is None:
            raise ValueError(f"layer_types lists sliding layers but sliding_window={window!r}")
        return {}
    types = config.get("layer_types")
    if types is None:
        if fam.layer_pattern == "all":
            types = [SLIDING] * layers
        elif fam.layer_pattern == "qwen":
            first = config.get("max_window_layers", 28)
            types = [SLIDING if i >= first else FULL for i in range(layers)]
        elif fam.layer_pattern == "every_2_first":  # gpt-oss: even layers slide
            types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
        elif fam.layer_pattern == "nope":  # SmolLM3: the NoPE layers slide
            nope = _nope(config, fam, layers)["nope_layers"]
            types = [SLIDING if i in nope else FULL for i in range(layers)]
        else:
            every = 2 if fam.layer_pattern == "every_2" else int(config.get(
                "sliding_window_pattern", config.get("_sliding_window_pattern", 6)))
            types = [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={list(types)!r} must give {layers} layers, each "
                         f"{SLIDING!r} or {FULL!r}")
    return {"sliding_window": window, "layer_types": types}
