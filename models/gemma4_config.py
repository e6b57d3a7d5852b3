"""Gemma 4 text's config (``model_type: "gemma4_text"``): :class:`Gemma4Config`, read from
a Hugging Face ``config.json`` by :meth:`Gemma4Config.from_hf`.

Every key transformers writes for the family is read (:data:`HANDLED`), known not to
change inference (:data:`IRRELEVANT`) or refused naming the key when set to a value
forge_jax does not implement (:data:`REFUSED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import forge_jax as fj
from forge_jax.models.families import FULL, SLIDING
from forge_jax.models.families import IRRELEVANT as _IRRELEVANT

MODEL_TYPE = "gemma4_text"
ARCHITECTURE = "Gemma4ForCausalLM"

HANDLED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
    "num_global_key_value_heads", "per_layer_config", "hidden_activation", "rms_norm_eps",
    "rope_parameters", "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "model_type", "architectures", "attention_bias",
    "sliding_window", "layer_types", "final_logit_softcapping", "vocab_size_per_layer_input",
    "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers",
    "enable_moe_block", "use_double_wide_mlp", "num_experts", "top_k_experts",
    "moe_intermediate_size", "use_bidirectional_attention"})
IRRELEVANT = _IRRELEVANT
# key -> the values served (anything else is refused naming the key)
REFUSED = {"use_bidirectional_attention": (None,), "quantization_config": (None,)}


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 text's hyper-parameters, named as in its ``config.json``.

    Its layers are of two types (``layer_types``): ``"sliding_attention"`` layers, of
    ``head_dim`` and ``num_key_value_heads``, attending within ``sliding_window``, and
    ``"full_attention"`` layers of ``global_head_dim`` and ``num_global_key_value_heads``
    (HF's ``per_layer_config``), each type with its RoPE (``rope_sliding``,
    ``rope_full``: ``(theta, RopeScaling or None)``; the full layers' ``proportional``
    RoPE rotates a fraction of each head). Attention is unscaled (``scale`` 1: q and k are
    RMS-normed per head, v too without a weight).

    The options, each as transformers reads it:

    * ``hidden_size_per_layer_input`` > 0: per-layer input embeddings (an embedding of
      ``vocab_size_per_layer_input`` rows and ``num_hidden_layers *
      hidden_size_per_layer_input`` columns, mixed with a projection of the embeddings,
      gating a residual branch at the end of every layer).
    * ``num_kv_shared_layers``: the last layers compute no keys and values; each attends
      to the cache of the last earlier layer of its type (:attr:`kv_source`).
    * ``attention_k_eq_v``: the full layers have no ``v_proj``; values are the key
      projection (before the key norm and RoPE).
    * ``use_double_wide_mlp``: the shared-KV layers' MLPs are twice ``intermediate_size``.
    * ``enable_moe_block``: every layer adds a mixture of ``num_experts`` GeGLU experts
      (top ``top_k_experts``, width ``moe_intermediate_size``) to its dense MLP.
    * ``final_logit_softcapping``: ``cap * tanh(logits / cap)``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_sliding: tuple[float, fj.RopeScaling | None] = (10000.0, None)
    rope_full: tuple[float, fj.RopeScaling | None] = (1_000_000.0, None)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    final_logit_softcapping: float | None = None
    vocab_size_per_layer_input: int = 0
    hidden_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    num_experts: int = 0
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    model_type: str = MODEL_TYPE

    # Read by the shared layers (LlamaMLP) and the memory estimate, as LlamaConfig's.
    hidden_act = "gelu_pytorch_tanh"
    mlp_bias = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "global_head_dim", "num_global_key_value_heads", "sliding_window",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {
                SLIDING, FULL}:
            raise ValueError(f"layer_types={list(self.layer_types)!r} must give "
                             f"num_hidden_layers={self.num_hidden_layers} entries, each "
                             f"{SLIDING!r} or {FULL!r}")
        for name in ("num_key_value_heads", "num_global_key_value_heads"):
            if self.num_attention_heads % getattr(self, name):
                raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a "
                                 f"multiple of {name}={getattr(self, name)}")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in "
                             f"[0, num_hidden_layers={self.num_hidden_layers})")
        first = self.num_hidden_layers - self.num_kv_shared_layers
        if set(self.layer_types[first:]) - set(self.layer_types[:first]):
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}: a shared "
                             f"layer's type has no earlier layer to take keys and values from "
                             f"(layer_types={list(self.layer_types)!r})")
        if self.num_experts and not (self.top_k_experts and self.moe_intermediate_size):
            raise ValueError(f"enable_moe_block needs top_k_experts and moe_intermediate_size, "
                             f"got top_k_experts={self.top_k_experts}, moe_intermediate_size="
                             f"{self.moe_intermediate_size}")
        eos = self.eos_token_id
        if isinstance(eos, list):
            object.__setattr__(self, "eos_token_id", tuple(eos))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a (possibly empty) tuple."""
        eos = self.eos_token_id
        return () if eos is None else eos if isinstance(eos, tuple) else (eos,)

    @property
    def num_experts_per_tok(self) -> int | None:
        """``top_k_experts`` under the Llama decoder's name for it."""
        return self.top_k_experts

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads if self.is_sliding(layer) else (
            self.num_global_key_value_heads)

    def layer_rope(self, layer: int) -> tuple[float, fj.RopeScaling | None]:
        return self.rope_sliding if self.is_sliding(layer) else self.rope_full

    def has_v_proj(self, layer: int) -> bool:
        return not (self.attention_k_eq_v and not self.is_sliding(layer))

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_shared(self, layer: int) -> bool:
        """Whether layer ``layer`` reuses an earlier layer's keys and values."""
        return layer >= self.first_shared_layer

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values layer ``layer`` attends to: itself, or for a
        shared layer the last non-shared layer of its type (as transformers)."""
        if not self.is_shared(layer):
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_shared_layer) if self.layer_types[i] == kind)

    @property
    def quantized_in_features(self) -> frozenset[int]:
        """The in features of the weights ``quantize=`` quantizes (every projection, MLP,
        expert and per-layer-input projection): an int4 group must divide each."""
        layers = range(self.num_hidden_layers)
        ins = {self.hidden_size, *(self.mlp_width(i) for i in layers),
               *(self.num_attention_heads * self.layer_head_dim(i) for i in layers)}
        ins |= {n for n in (self.moe_intermediate_size, self.hidden_size_per_layer_input) if n}
        return frozenset(ins)

    def mlp_width(self, layer: int) -> int:
        double = self.use_double_wide_mlp and self.is_shared(layer)
        return self.intermediate_size * (2 if double else 1)

    @property
    def kv_cache_geometry(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)`` of the KV cache: a slot per layer that computes
        keys and values (not the shared ones), each at the wider of the two layer types'
        widths; a sliding layer's heads are repeated and zero-padded into it (see
        :mod:`forge_jax.models.gemma4`)."""
        return (self.first_shared_layer,
                max(self.num_key_value_heads, self.num_global_key_value_heads),
                max(self.head_dim, self.global_head_dim))

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Gemma4Config:
        """From a ``gemma4_text`` ``config.json`` dict (or a multimodal ``gemma4`` one's
        ``text_config``); ValueError naming a key forge_jax does not implement (or an
        unknown one)."""
        raw = dict(config)
        if raw.get("model_type") == "gemma4":  # a multimodal checkpoint: its language model
            if not isinstance(raw.get("text_config"), Mapping):
                raise ValueError(f"a gemma4 config.json needs a text_config dict, got "
                                 f"text_config={raw.get('text_config')!r:.80}")
            raw = dict(raw["text_config"], model_type=MODEL_TYPE)
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not a {MODEL_TYPE} config: model_type={raw.get('model_type')!r}")
        unknown = sorted(set(raw) - HANDLED - IRRELEVANT - set(REFUSED))
        if unknown:
            raise ValueError(f"unsupported {MODEL_TYPE} config keys {unknown}")
        for key, allowed in REFUSED.items():
            if raw.get(key) not in allowed:
                raise ValueError(f"{MODEL_TYPE}: {key}={raw[key]!r} is not implemented "
                                 f"(served: {allowed})")
        act = raw.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{MODEL_TYPE}: hidden_activation={act!r} is not implemented "
                             f"(served: 'gelu_pytorch_tanh')")
        layers = raw.get("num_hidden_layers", 30)
        types = raw.get("layer_types") or [
            SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
        types = list(types)
        types[-1] = FULL  # as transformers forces it
        head_dim, kv_heads = raw.get("head_dim", 256), raw.get("num_key_value_heads", 4)
        global_dim = raw.get("global_head_dim")
        global_kv = raw.get("num_global_key_value_heads")
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        overrides = raw.get("per_layer_config")
        if overrides is not None:  # as transformers writes it: {"05": {"head_dim": 512}, ...}
            global_dim, global_kv = _per_layer(overrides, types)
        elif not k_eq_v:  # transformers overrides the full layers' KV heads only then
            global_kv = None
        global_dim = 512 if global_dim is None else global_dim
        global_kv = kv_heads if global_kv is None else global_kv
        rope = raw.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                   "rope_theta": 1_000_000.0}}
        max_pos = raw.get("max_position_embeddings", 131072)
        ropes = {}
        for kind in (SLIDING, FULL):
            params = rope.get(kind) if isinstance(rope, Mapping) else None
            if not isinstance(params, Mapping) or "rope_theta" not in params:
                raise ValueError(f"{MODEL_TYPE}: rope_parameters needs a {kind!r} entry with "
                                 f"rope_theta, got rope_parameters={rope!r}")
            extra = sorted(set(params) - {"rope_type", "rope_theta", "partial_rotary_factor",
                                          "factor"})
            if extra:
                raise ValueError(f"{MODEL_TYPE}: unsupported rope_parameters[{kind!r}] keys "
                                 f"{extra}")
            if params.get("rope_type", "default") == "default" and params.get(
                    "partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"{MODEL_TYPE}: partial_rotary_factor with default RoPE "
                                 f"in rope_parameters[{kind!r}] is not implemented")
            ropes[kind] = (float(params["rope_theta"]), fj.RopeScaling.from_hf(
                rope, layer_type=kind, max_position_embeddings=max_pos))
        experts = raw.get("num_experts") if raw.get("enable_moe_block") else None
        return cls(
            vocab_size=raw.get("vocab_size", 262144), hidden_size=raw.get("hidden_size", 2304),
            intermediate_size=raw.get("intermediate_size", 9216), num_hidden_layers=layers,
            num_attention_heads=raw.get("num_attention_heads", 8), num_key_value_heads=kv_heads,
            head_dim=head_dim, global_head_dim=global_dim, num_global_key_value_heads=global_kv,
            layer_types=tuple(types), sliding_window=raw.get("sliding_window", 512),
            rope_sliding=ropes[SLIDING], rope_full=ropes[FULL],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=max_pos, bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            vocab_size_per_layer_input=raw.get("vocab_size_per_layer_input") or 0,
            hidden_size_per_layer_input=raw.get("hidden_size_per_layer_input") or 0,
            attention_k_eq_v=k_eq_v, num_kv_shared_layers=raw.get("num_kv_shared_layers") or 0,
            use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
            num_experts=experts or 0, top_k_experts=raw.get("top_k_experts"),
            moe_intermediate_size=raw.get("moe_intermediate_size"))


def _per_layer(overrides: Mapping, types: list[str]) -> tuple[int | None, int | None]:
    """(global head_dim, global KV heads) from transformers' ``per_layer_config``: the
    same override on every full layer and none on a sliding one, else refused."""
    seen = set()
    for key, values in overrides.items():
        layer = int(key)
        extra = sorted(set(values) - {"head_dim", "num_key_value_heads"})
        if extra or not 0 <= layer < len(types) or types[layer] != FULL:
            raise ValueError(f"{MODEL_TYPE}: per_layer_config[{key!r}]={values!r} is not "
                             f"implemented (only head_dim and num_key_value_heads of the "
                             f"full-attention layers)")
        seen.add((values.get("head_dim"), values.get("num_key_value_heads")))
    if len(seen) > 1 or (seen and len(overrides) != types.count(FULL)):
        raise ValueError(f"{MODEL_TYPE}: per_layer_config={dict(overrides)!r} differs between "
                         f"full-attention layers; not implemented")
    return next(iter(seen), (None, None))
