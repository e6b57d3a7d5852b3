"""Hugging Face Llama checkpoints: reading them into a :class:`Llama` (safetensors only, never
pickle) and writing a model's weights back under HF's names and layout."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors can read it)
import numpy as np
from flax import nnx

from forge_jax import memory as fj_memory
from forge_jax.models.llama_model import Linear, Llama, LlamaConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message names the file or tensor."""


# Buffers some older checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _hf_parameters(
    model: Llama,
) -> dict[str, tuple[nnx.Param, tuple[int, ...], Callable, slice | None]]:
    """HF tensor name -> (the parameter, the tensor's HF shape, HF array -> stored array,
    the rows of the parameter it fills: None for all of it, a slice for a fused part)."""
    same = lambda w: w
    out = {"model.embed_tokens.weight": (model.embed_tokens, model.embed_tokens.shape, same,
                                         None),
           "model.norm.weight": (model.norm.weight, model.norm.weight.shape, same, None)}

    def linear(name, lin: Linear):
        if not lin.parts:
            out[f"{name}.weight"] = (lin.kernel, lin.hf_shape(), lin.kernel_from_hf, None)
            if lin.bias is not None:
                out[f"{name}.bias"] = (lin.bias, lin.bias.shape, same, None)
            return
        prefix = name.rsplit(".", 1)[0]
        for part, rows in lin.hf_parts():
            size = rows.stop - rows.start
            out[f"{prefix}.{part}.weight"] = (lin.kernel, (size, lin.in_features),
                                              lin.kernel_from_hf, rows)
            if lin.bias is not None:
                out[f"{prefix}.{part}.bias"] = (lin.bias, (size,), same, rows)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weight = getattr(layer, norm).weight
            out[f"{p}.{norm}.weight"] = (weight, weight.shape, same, None)
        for proj in ("qkv_proj", "o_proj"):
            linear(f"{p}.self_attn.{proj}", getattr(layer.self_attn, proj))
        for proj in ("gate_up_proj", "down_proj"):
            linear(f"{p}.mlp.{proj}", getattr(layer.mlp, proj))
    if model.lm_head is not None:
        linear("lm_head", model.lm_head)
    return out


def _safetensors_files(path: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
    """The checkpoint's files, each with the tensor names the index assigns it (or None)."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files: dict[pathlib.Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names the shard {file.name}, which is missing")
        return files
    if single.is_file():
        return {single: None}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise CheckpointError(
            f"{path} holds only pickle checkpoints (*.bin/*.pt); forge_jax reads safetensors "
            f"only (never pickle). Convert with transformers' save_pretrained(..., "
            f"safe_serialization=True).")
    raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_config(path: str | os.PathLike) -> LlamaConfig:
    """Reads ``path/config.json`` into a :class:`LlamaConfig` (errors name the file)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    try:
        return LlamaConfig.from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None) -> Llama:
    """Loads a Hugging Face Llama-family checkpoint directory.

    Reads ``config.json`` and ``model.safetensors`` (or the shards named by
    ``model.safetensors.index.json``) with the safetensors library; pickle files are
    never opened. Tensors of any float dtype (bfloat16 included) are cast to
    ``param_dtype``. With ``tie_word_embeddings`` the output head reuses
    ``model.embed_tokens.weight`` (an ``lm_head.weight`` in the file is then ignored,
    as transformers does).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype of the model.
      param_dtype: storage dtype of the weights; defaults to ``dtype``.

    Returns:
      A :class:`Llama` holding the checkpoint's weights.

    Raises:
      CheckpointError (a ValueError): unreadable or unsupported config, missing
        files, or a missing, mis-shaped or unexpected tensor (named in the message).
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    config = load_config(path)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    weights = fj_memory.estimate_inference_memory(config, batch=1, max_len=1,
                                                  param_dtype=param_dtype).weights
    fj_memory.check_fits(weights, what=f"the weights of {path} in {param_dtype.name}")
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype,
                                         param_dtype=param_dtype))
    expected = _hf_parameters(model)
    loaded: set[str] = set()
    fused: dict[int, tuple[nnx.Param, np.ndarray]] = {}
    for file, names in _safetensors_files(path).items():
        try:
            handle = safe_open(file, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle as f:
            keys = set(f.keys())
            if names is not None and set(names) - keys:
                raise CheckpointError(f"{file.name} lacks tensors its index assigns to it: "
                                      f"{sorted(set(names) - keys)[:5]}")
            for name in sorted(keys):
                if name.endswith(_IGNORED_SUFFIXES) or (
                        name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name not in expected:
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: not a parameter of a "
                        f"Llama with this config.json")
                param, hf_shape, convert, rows = expected[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(hf_shape):
                    raise CheckpointError(f"tensor {name!r} in {file.name} has shape {shape}, "
                                          f"expected {tuple(hf_shape)} from config.json")
                array = f.get_tensor(name)
                if not np.issubdtype(array.dtype, np.floating) and array.dtype != jnp.bfloat16:
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has dtype {array.dtype}, expected float")
                value = convert(array).astype(param_dtype)
                if rows is None:
                    param.set_value(jnp.asarray(value))
                else:  # A part of a fused parameter: assembled on the host, set below.
                    fused.setdefault(id(param), (param, np.empty(param.shape, param_dtype)))
                    fused[id(param)][1][rows] = value
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:5]}{more}")
    for param, value in fused.values():
        param.set_value(jnp.asarray(value))
    return model


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and in HF's layout, as float32 NumPy
    arrays (the inverse of :func:`from_pretrained`, e.g. to ``save_file`` them)."""
    out = {}
    for name, (param, hf_shape, convert, rows) in _hf_parameters(model).items():
        stored = np.asarray(param[...], np.float32)
        if rows is not None:
            stored = stored[rows]
        # convert maps HF's layout to ours (the identity today); check that it still is.
        if stored.shape != tuple(hf_shape) or not np.array_equal(convert(stored), stored):
            raise ValueError(f"cannot convert {name} of shape {stored.shape} to HF's {hf_shape}")
        out[name] = stored
    return out
