"""gpt-oss's MXFP4 checkpoints, loaded as shipped: the experts' ``gate_up_proj`` and
``down_proj`` stored as ``*_blocks`` (uint8 ``[experts, out, in / 32, 16]``, two FP4 E2M1
values a byte) and ``*_scales`` (uint8 E8M0 exponents ``[experts, out, in / 32]``) become
``"mxfp4"`` :class:`forge_jax.QuantizedArray` s ``[experts, out, in]`` (the bytes as they
are), which the experts' grouped products dequantize one expert at a time; every other
tensor is a float one (``quantization_config.modules_to_not_convert``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.models.llama_moe import BiasedMoe

SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(raw: Any) -> bool:
    """Whether a ``config.json`` dict is an MXFP4 checkpoint's."""
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"


def check_config(raw: dict, file) -> dict:
    """The config dict without its ``quantization_config`` (read here, not by the
    families); ValueError for a family other than gpt-oss."""
    if raw.get("model_type") != "gpt_oss":
        raise ValueError(f"{file}: quantization_config.quant_method='mxfp4' is read for "
                         f"model_type 'gpt_oss' (its experts), not {raw.get('model_type')!r}")
    return {k: v for k, v in raw.items() if k != "quantization_config"}


def expert_parameters(model) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """HF name of each MXFP4 expert tensor (without the suffix) -> (the parameter, its
    logical ``[experts, out, in]`` shape)."""
    out = {}
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, BiasedMoe):
            continue
        for name, param in (("gate_up_proj", layer.mlp.gate_up), ("down_proj", layer.mlp.down)):
            e, k, n = param.shape  # stored float as [experts, in, out]
            out[f"model.layers.{i}.mlp.experts.{name}"] = (param, (e, n, k))
    return out


def load_experts(model, tensors: dict[str, np.ndarray], file_of: dict[str, str],
                 shardings=None) -> set[int]:
    """Sets each expert parameter from its ``_blocks`` and ``_scales`` (``tensors``: HF
    name -> array), on a mesh placed as ``shardings`` (id(parameter) -> NamedSharding)
    says, the scales with their values; returns the ids of the parameters set.
    CheckpointError-style ValueError naming a missing or mis-shaped tensor."""
    done = set()
    for name, (param, (e, n, k)) in expert_parameters(model).items():
        missing = [name + s for s in SUFFIXES if name + s not in tensors]
        if missing:
            raise ValueError(f"MXFP4 checkpoint lacks {missing}")
        blocks, scales = tensors[name + "_blocks"], tensors[name + "_scales"]
        if blocks.shape != (e, n, k // 32, 16) or scales.shape != (e, n, k // 32) or (
                blocks.dtype != np.uint8 or scales.dtype != np.uint8):
            raise ValueError(
                f"{name}_blocks {blocks.shape} {blocks.dtype} and _scales {scales.shape} "
                f"{scales.dtype} in {file_of.get(name + '_blocks')} must be uint8 "
                f"{(e, n, k // 32, 16)} and {(e, n, k // 32)} for this config.json")
        q = fj.quant.from_parts(jnp.asarray(blocks.reshape(e, n, k // 2)),
                                jnp.asarray(scales), format="mxfp4", block=(32,),
                                dtype=param.dtype)
        param.set_value(q if shardings is None else fj.quant.place(q, shardings[id(param)]))
        done.add(id(param))
    return done
