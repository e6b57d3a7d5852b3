"""The decoder's config: :class:`LlamaConfig`, read from a Hugging Face ``config.json``
(:meth:`LlamaConfig.from_hf`) of any family :mod:`forge_jax.models.families` lists (Llama,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE): one model, the families' differences as fields of this config."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping
from typing import Any

import forge_jax as fj
from forge_jax.models import families
from forge_jax.models.families import FULL, SLIDING, SUPPORTED_ARCHITECTURES  # noqa: F401

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder, named as in a Hugging Face ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA) and ``head_dim``
    to ``hidden_size // num_attention_heads``. ``rope_scaling`` is a
    :class:`forge_jax.RopeScaling` (an HF-style dict is converted) or None.
    ``eos_token_id`` is an int, a tuple of ints (Llama 3 lists several) or None.

    The fields after ``model_type`` are the other families' differences (defaults: Llama):

    * ``qkv_bias``: bias on q, k and v but not on o (Qwen2); ``attention_bias`` puts one
      on all four.
    * ``qk_norm``: an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
    * ``norm_offset``: every RMSNorm scales by ``norm_offset + weight`` (Gemma: 1).
    * ``sandwich_norms``: norms after attention and after the MLP too, and one before the
      MLP named ``pre_feedforward_layernorm`` (Gemma 2 and 3).
    * ``scale_embeddings``: embeddings times ``sqrt(hidden_size)`` (Gemma).
    * ``hidden_act``: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU, Gemma).
    * ``query_pre_attn_scalar``: attention scale ``query_pre_attn_scalar ** -0.5``
      instead of ``head_dim ** -0.5`` (Gemma).
    * ``attn_logit_softcapping``, ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on
      the attention logits and on the output logits (Gemma 2).
    * ``sliding_window`` with ``layer_types`` (one ``"sliding_attention"`` or
      ``"full_attention"`` per layer; None: every layer slides): the window of each layer
      (Mistral, Gemma 2 and 3, Qwen with ``use_sliding_window``, Phi-3).
    * ``rope_local_theta``: the RoPE base of the sliding layers, which are never scaled
      (Gemma 3's ``rope_local_base_freq``); None: ``rope_theta`` for all.
    * ``partial_rotary_factor``: RoPE on the first ``head_dim * factor`` dims of each
      head (Phi-3).
    * ``fused_checkpoint``: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused
      (Phi-3) rather than q/k/v and gate/up apart.
    * ``num_experts`` > 0: a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE). Each MoE
      layer routes every token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts
      of width ``moe_intermediate_size`` (softmax over the router's logits, then top-k;
      ``norm_topk_prob``: the k weights divided by their sum, as Mixtral always does).
      A layer is an MoE layer unless it is in ``mlp_only_layers`` or ``(layer + 1)`` is
      not a multiple of ``decoder_sparse_step``; the others have the dense MLP of width
      ``intermediate_size`` (:meth:`is_moe`).
    * ``shared_expert_intermediate_size``: a dense SwiGLU expert every token goes through
      as well, scaled by ``sigmoid(x @ shared_expert_gate)`` (Qwen2-MoE); None: none.
    * ``nope_layers``: the layers whose queries and keys get no RoPE at all (SmolLM3's
      ``no_rope_layers`` zeros); :meth:`uses_rope`.

    All of them are static: one compiled step serves every layer kind, the per-layer
    window and RoPE base being Python values of the unrolled layer loop.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: fj.RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0
    fused_checkpoint: bool = False
    num_experts: int = 0
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int | None = None
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly")
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        _positive_int("num_key_value_heads", self.num_key_value_heads)
        _positive_int("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"RoPE needs an even rotated dimension, got head_dim={self.head_dim} "
                             f"and partial_rotary_factor={self.partial_rotary_factor} "
                             f"(rotary_dim={self.rotary_dim})")
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", fj.RopeScaling.from_hf(dict(self.rope_scaling)))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, fj.RopeScaling):
            raise TypeError(f"rope_scaling must be a forge_jax.RopeScaling, a dict or None, "
                            f"got {self.rope_scaling!r}")
        eos = self.eos_token_id
        ids = eos if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        if any(isinstance(e, bool) or not isinstance(e, numbers.Integral) or e < 0 for e in ids):
            raise ValueError(f"eos_token_id must be a token id (an int >= 0), a list of them "
                             f"or None, got eos_token_id={eos!r}")
        if isinstance(eos, list | tuple):
            set_("eos_token_id", tuple(int(e) for e in eos))
        elif eos is not None:
            set_("eos_token_id", int(eos))
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}: forge_jax implements "
                             f"{ACTIVATIONS}")
        if self.model_type not in families.FAMILIES:
            raise ValueError(f"unsupported model_type={self.model_type!r}: forge_jax reads "
                             f"{sorted(families.FAMILIES)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {name}={value!r}")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
            if (len(self.layer_types) != self.num_hidden_layers
                    or set(self.layer_types) - {SLIDING, FULL}):
                raise ValueError(f"layer_types={self.layer_types!r} must give num_hidden_layers="
                                 f"{self.num_hidden_layers} entries, each {SLIDING!r} or {FULL!r}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError(f"layer_types={self.layer_types!r} lists sliding layers but "
                                 f"sliding_window is None")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"partial_rotary_factor={self.partial_rotary_factor!r}")
        self._check_experts(set_)
        set_("nope_layers", tuple(self.nope_layers))
        bad = [i for i in self.nope_layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"nope_layers={list(self.nope_layers)!r} must list layers in "
                             f"[0, num_hidden_layers={self.num_hidden_layers}), got {bad}")
        if not (isinstance(self.rms_norm_eps, int | float) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    def _check_experts(self, set_):
        set_("mlp_only_layers", tuple(self.mlp_only_layers))
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or (
                self.num_experts < 0):
            raise ValueError(f"num_experts must be an int >= 0, got num_experts="
                             f"{self.num_experts!r}")
        if self.num_experts == 0:
            return
        _positive_int("num_experts_per_tok", self.num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        _positive_int("decoder_sparse_step", self.decoder_sparse_step)
        if self.shared_expert_intermediate_size is not None:
            _positive_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size)
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or isinstance(i, bool)
               or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)!r} must list layers "
                             f"in [0, num_hidden_layers={self.num_hidden_layers}), got {bad}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (else the dense MLP), as
        transformers' Qwen-MoE decoder layers decide it."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a (possibly empty) tuple."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float | None:
        """The attention logits' scale; None: the ops' default ``head_dim ** -0.5``."""
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within ``sliding_window`` (else to everything)."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None (global attention)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys (False: a NoPE layer)."""
        return layer not in self.nope_layers

    def layer_rope(self, layer: int) -> tuple[float, fj.RopeScaling | None]:
        """(RoPE base, scaling) of layer ``layer``: Gemma 3's sliding layers have their
        own unscaled base."""
        if self.rope_local_theta is not None and self.is_sliding(layer):
            return float(self.rope_local_theta), None
        return float(self.rope_theta), self.rope_scaling

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5 format).

        Reads the RoPE settings from the older top-level keys (``rope_theta``,
        ``rope_scaling``) or from the transformers-5 ``rope_parameters`` dict
        (``{"rope_type": ..., "rope_theta": ..., <scaling fields>}``). Keys that do not
        affect inference (``torch_dtype``, ``initializer_range``, ...) are ignored.

        Raises:
          ValueError: another architecture or ``model_type``, an unsupported rope type
            or activation, or a setting forge_jax does not implement.
        """
        return cls(**families.config_kwargs(config))


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
