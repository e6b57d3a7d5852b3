"""Gemma 4 text checkpoints (``model_type: "gemma4_text"``, safetensors):
loading one into a :class:`~forge_jax.models.gemma4.Gemma4` (the names:
:mod:`~forge_jax.models.checkpoints.gemma4_names`).
:func:`forge_jax.models.checkpoints.hf.from_pretrained` hands such a directory here."""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.models.checkpoints.gemma4_names import expert_parameters, gemma4_parameters
from forge_jax.models.checkpoints.generation_config import (
    CheckpointError,
    load_generation_config,
)
from forge_jax.models.checkpoints.hf_names import fill_parameters
from forge_jax.models.gemma4 import Gemma4
from forge_jax.models.gemma4_config import Gemma4Config
from forge_jax.models.llama_model import TensorLayout


def is_gemma4(path: pathlib.Path) -> bool:
    """Whether checkpoint directory ``path`` holds a Gemma 4 ``config.json``, text
    (``gemma4_text``) or multimodal (``gemma4``, whose language model loads; an unreadable
    one is left to the Llama loader's errors)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in ("gemma4_text", "gemma4")


# A multimodal checkpoint's language model, under the names of the text model's.
_LANGUAGE_MODEL = "model.language_model."


def _text_name(stored: str, multimodal: bool) -> str | None:
    """The text model's name of tensor ``stored``; None for the vision and audio towers
    and their projections of a multimodal (``gemma4``) checkpoint, which are not read."""
    if not multimodal or stored == "lm_head.weight":
        return stored
    return "model." + stored[len(_LANGUAGE_MODEL):] if stored.startswith(_LANGUAGE_MODEL) else None


def from_pretrained(path: pathlib.Path, files: dict, check_finite: Callable, *, dtype,
                    param_dtype, mesh=None, tp_axis: str = "tp", dp_axis: str = "dp",
                    quantize: str | None = None, group_size: int | None = None) -> Gemma4:
    """Loads a Gemma 4 text checkpoint directory (already resolved) into a :class:`Gemma4`,
    as :func:`forge_jax.models.checkpoints.hf.from_pretrained` loads a Llama, which calls
    this with the directory's safetensors ``files`` (path -> tensor names or None) and
    its ``check_finite(name, block, file, param_dtype)``. With ``mesh`` (axes named by
    ``tp_axis`` and ``dp_axis``) each device receives its shard
    (:mod:`forge_jax.models.gemma4_sharding`); sizes that do not split are refused before
    anything is read."""
    from safetensors import SafetensorError, safe_open

    from forge_jax import sharding as fj_sharding
    from forge_jax.models import gemma4_sharding
    from forge_jax.models.checkpoints import quantize as quantize_load

    file = path / "config.json"
    raw = json.loads(file.read_text())
    multimodal = raw.get("model_type") == "gemma4"
    try:
        config = Gemma4Config.from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None
    layout, shardings = TensorLayout(), None
    if mesh is not None:
        mesh = gemma4_sharding.mesh_config(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
        layout = gemma4_sharding.layout_for(config, mesh.tp)
    model = nnx.eval_shape(lambda: Gemma4(config, rngs=nnx.Rngs(0), dtype=dtype,
                                          param_dtype=param_dtype, layout=layout))
    if mesh is not None:
        shardings = gemma4_sharding.param_shardings(model, mesh)
        if quantize is not None:
            quantize_load.check_mesh(model, shardings, quantize, group_size)
    expected = gemma4_parameters(model)
    experts = expert_parameters(model)
    handles, file_of = {}, {}  # text name -> (its open file, stored name), its file's name
    with contextlib.ExitStack() as stack:
        for f_path in files:
            try:
                f = stack.enter_context(safe_open(f_path, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {f_path}: {e}") from None
            for stored in sorted(f.keys()):
                name = _text_name(stored, multimodal)
                if name is None or name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name in experts:
                    want = experts[name].shape
                    want = (want[0], want[2], want[1])
                elif name in expected:
                    want = tuple(expected[name][1])
                else:
                    raise CheckpointError(f"unexpected tensor {stored!r} in {f_path.name}: not a "
                                          f"parameter of a gemma4_text with this config.json")
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != tuple(want):
                    raise CheckpointError(f"tensor {stored!r} in {f_path.name} has shape {shape}, "
                                          f"expected {tuple(want)} from config.json")
                if f.get_slice(stored).get_dtype() not in ("F16", "BF16", "F32", "F64"):
                    raise CheckpointError(f"tensor {stored!r} in {f_path.name} has dtype "
                                          f"{f.get_slice(stored).get_dtype()}, expected float")
                handles[name], file_of[name] = (f, stored), f_path.name
        missing = sorted((set(expected) | set(experts)) - set(handles))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:5]}{more}")

        def read(name, index):
            f, stored = handles[name]
            block = np.asarray(f.get_slice(stored)[index])
            check_finite(name, block, file_of[name], np.dtype(param_dtype))
            return block

        convert = None if quantize is None else quantize_load.converters(
            model, quantize, group_size, shardings)
        for name, p in experts.items():  # HF [E, out, in] -> stored [E, in, out]
            value = np.swapaxes(read(name, ()), 1, 2).astype(param_dtype)
            if convert is not None:
                p.set_value(convert[id(p)](jnp.asarray(value)))
            elif shardings is not None:
                p.set_value(fj_sharding.put(value, shardings[id(p)]))
            else:
                p.set_value(jnp.asarray(value))
        fill_parameters(model, read, shardings, convert,
                        frozenset(id(p) for p in experts.values()))
    model.mesh = mesh
    model.generation_config = load_generation_config(path)
    return model
