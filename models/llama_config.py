"""The Llama-family decoder's config: :class:`LlamaConfig`, read from a Hugging Face
``config.json`` (:meth:`LlamaConfig.from_hf`), with the keys forge_jax refuses."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import forge_jax as fj

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# Config keys that change the computation and that forge_jax does not implement: refused
# when present with a value other than the harmless one.
_HARMLESS = {
    "pretraining_tp": (None, 1),  # tensor-parallel slicing in training; same maths.
    "attention_dropout": (None, 0.0, 0),
    "mlp_dropout": (None, 0.0, 0),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder, named as in a Hugging Face ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA) and ``head_dim``
    to ``hidden_size // num_attention_heads``. ``rope_scaling`` is a
    :class:`forge_jax.RopeScaling` (an HF-style dict is converted) or None.
    ``eos_token_id`` is an int, a tuple of ints (Llama 3 lists several) or None.
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
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got head_dim={self.head_dim}")
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", fj.RopeScaling.from_hf(dict(self.rope_scaling)))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, fj.RopeScaling):
            raise TypeError(f"rope_scaling must be a forge_jax.RopeScaling, a dict or None, "
                            f"got {self.rope_scaling!r}")
        if isinstance(self.eos_token_id, list | tuple):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}: Llama uses 'silu'")
        if self.model_type != "llama":
            raise ValueError(f"unsupported model_type={self.model_type!r}: this is the Llama model")
        if not (isinstance(self.rms_norm_eps, int | float) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a (possibly empty) tuple."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

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
        config = dict(config)
        model_type = config.get("model_type", "llama")
        architectures = config.get("architectures") or list(SUPPORTED_ARCHITECTURES)
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if model_type != "llama" or unsupported:
            raise ValueError(
                f"unsupported checkpoint: model_type={model_type!r}, "
                f"architectures={architectures!r}; forge_jax's Llama model reads "
                f"model_type 'llama' with architectures {list(SUPPORTED_ARCHITECTURES)}")
        for key, allowed in _HARMLESS.items():
            if config.get(key) not in allowed:
                raise ValueError(f"unsupported config setting {key}={config[key]!r}")
        theta, scaling = _rope_from_hf(config)
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "rope_scaling"}
        kwargs = {k: config[k] for k in fields if k in config and config[k] is not None}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in kwargs]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        return cls(**kwargs, rope_theta=theta, rope_scaling=scaling)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings"}


def _rope_from_hf(config: dict) -> tuple[float, fj.RopeScaling | None]:
    """(rope_theta, scaling) from either HF config format."""
    params = config.get("rope_parameters")
    if params is None:
        theta = config.get("rope_theta", 10000.0)
        rope = config.get("rope_scaling")
    else:
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(f"unsupported rope_parameters {params!r}: expected one flat dict "
                             f"(per-layer-type RoPE is not part of the Llama architecture)")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope = params
    if rope:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in (None, "default") and "factor" in rope:
            raise ValueError(f"rope parameters {rope!r} give a factor but no rope_type")
        unknown = set(rope) - _ROPE_KEYS
        if unknown and kind in ("linear", "llama3", "default", None):
            # e.g. "attention_factor" or "partial_rotary_factor": not part of these types in
            # transformers, and forge_jax will not guess what they mean.
            raise ValueError(f"unsupported rope parameters {sorted(unknown)} in {rope!r}")
    return float(theta), fj.RopeScaling.from_hf(dict(rope) if rope else None)


# --------------------------------------------------------------------------------------
# Modules
