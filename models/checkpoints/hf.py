"""Hugging Face Llama checkpoints: reading them into a :class:`Llama` (safetensors only, never
pickle) and writing a model's weights back under HF's names and layout."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors can read it)
import numpy as np

from forge_jax import memory as fj_memory
from forge_jax import targets as fj_targets
from forge_jax.models import families
from forge_jax.models.checkpoints import fp8 as fp8_checkpoint
from forge_jax.models.checkpoints import mxfp4 as mxfp4_checkpoint
from forge_jax.models.checkpoints.abstract import abstract_llama
from forge_jax.models.checkpoints.generation_config import (  # noqa: F401  (CheckpointError: API here too)
    CheckpointError,
    load_generation_config,
)
from forge_jax.models.checkpoints.hf_names import (  # noqa: F401  (hf_parameters, hf_state_dict: API here too)
    fill_parameters,
    hf_parameters,
    hf_state_dict,
)
from forge_jax.models.checkpoints.hub import expand_user, resolve_checkpoint
from forge_jax.models.llama_model import Llama, LlamaConfig, TensorLayout

# Buffers some older checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _float_dtype(name: str, dtype) -> np.dtype:
    """``dtype`` as a floating dtype, or a ValueError naming the argument."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name} must be a float dtype (float32, bfloat16, float16), got "
                         f"{name}={dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a float dtype (float32, bfloat16, float16), got "
                         f"{name}={dtype.name}")
    return dtype


def _check_finite(name: str, block: np.ndarray, file: str, param_dtype: np.dtype) -> None:
    """Raises CheckpointError if a block of tensor ``name`` read from ``file`` holds NaN
    or inf, or values beyond float16's range when it is loaded as float16: such a model
    runs without error and generates garbage (token 0 forever).

    One summation pass (a NaN or inf makes the sum non-finite); only a non-finite sum,
    which finite values of float32's range practically never reach, pays for a
    precise count."""
    wide = np.float64 if block.dtype == np.float64 else np.float32
    if not np.isfinite(block.sum(dtype=wide)):
        finite = np.isfinite(block)
        if not finite.all():
            nan = int(np.isnan(block).sum())
            raise CheckpointError(
                f"tensor {name!r} in {file} holds non-finite values ({nan} NaN, "
                f"{finite.size - int(finite.sum()) - nan} inf, of {block.size}): the "
                f"checkpoint is corrupt, or overflowed when it was saved")
    if param_dtype == np.float16 and block.dtype != np.float16:
        limit = float(np.finfo(np.float16).max)
        largest = float(np.abs(block).max(initial=0.0))
        if largest > limit:
            raise CheckpointError(
                f"tensor {name!r} in {file} holds values up to {largest:.4g}, beyond "
                f"float16's {limit:.0f}: they would load as inf. Load it with "
                f"param_dtype float32 or bfloat16")


def default_dtype(platform: str | None = None) -> np.dtype:
    """The compute dtype for ``platform`` (default: JAX's default backend): float32 on CPU
    (bfloat16 there measured as fast or faster on a CPU with native bfloat16 products,
    BENCHMARKS.md, and was not measured on others), bfloat16 on GPU and TPU (inside
    ``fj.targets.use``: the target's platform)."""
    platform = fj_targets.platform() if platform is None else platform
    return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)


def load_config(path: str | os.PathLike, *, revision: str | None = None) -> LlamaConfig:
    """Reads ``path/config.json`` into a :class:`LlamaConfig` (a ``gemma4_text`` one into a
    :class:`~forge_jax.models.gemma4_config.Gemma4Config`; errors name the file).
    ``path`` may be a Hub repository id (``ORG/NAME``, at ``revision``): see
    :func:`forge_jax.models.checkpoints.hub.resolve_checkpoint`."""
    from forge_jax.models.checkpoints import gguf as gguf_checkpoint

    path = expand_user(path)
    if gguf_checkpoint.is_gguf(path):
        return gguf_checkpoint.load_config(path)
    path = resolve_checkpoint(path, revision=revision)
    if path.is_file():
        raise CheckpointError(f"{str(path)!r} is a file; a checkpoint is the directory that "
                              f"holds config.json and the weights: {str(path.parent)!r}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if fp8_checkpoint.quantization(raw, file) is not None:  # read as stored: see the module
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    if mxfp4_checkpoint.is_mxfp4(raw):  # gpt-oss's experts, read as stored
        try:
            raw = mxfp4_checkpoint.check_config(raw, file)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if eos is not None and not (_is_int(eos) or (
            isinstance(eos, list) and all(_is_int(e) for e in eos))):
        raise CheckpointError(f"{file}: eos_token_id must be an int or a list of ints, got "
                              f"{eos!r}")
    try:
        if isinstance(raw, dict) and raw.get("model_type") in ("gemma4_text", "gemma4"):
            from forge_jax.models.gemma4_config import Gemma4Config
            return Gemma4Config.from_hf(raw)
        if isinstance(raw, dict) and raw.get("model_type") in ("qwen3_next", "qwen3_5_text"):
            from forge_jax.models.qwen3_next_config import Qwen3NextConfig  # its own model
            return Qwen3NextConfig.from_hf(raw)
        if isinstance(raw, dict) and raw.get("model_type") == "deepseek_v3":
            from forge_jax.models.deepseek_config import DeepseekV3Config  # its own model
            return DeepseekV3Config.from_hf(raw)
        return LlamaConfig.from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def from_pretrained(path: str | os.PathLike, *, revision: str | None = None, dtype=None,
                    param_dtype=None, mesh=None, tp_axis: str = "tp", dp_axis: str = "dp",
                    quantize: str | None = None, group_size: int | None = None) -> Llama:
    """Loads a Hugging Face Llama-family checkpoint directory.

    A path ending in ``.gguf`` is a llama.cpp GGUF file, read by
    :mod:`forge_jax.models.checkpoints.gguf` (quantized tensors stay quantized). A
    Hugging Face fine-grained FP8 checkpoint (``quantization_config.quant_method ==
    "fp8"``) loads its fp8 weights as they are stored, into fp8 kernels
    (:mod:`forge_jax.models.checkpoints.fp8`).

    Reads ``config.json`` and ``model.safetensors`` (or the shards named by
    ``model.safetensors.index.json``) with the safetensors library; pickle files are
    never opened. Tensors of any float dtype (bfloat16 included) are cast to
    ``param_dtype``. With ``tie_word_embeddings`` the output head reuses
    ``model.embed_tokens.weight`` (an ``lm_head.weight`` in the file is then ignored,
    as transformers does).

    Args:
      path: the checkpoint directory, or a Hugging Face Hub repository id (``ORG/NAME``,
        e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``) fetched into (or, with
        ``HF_HUB_OFFLINE=1``, read from) the ``huggingface_hub`` cache; an existing local
        directory always wins over a Hub name.
      revision: the Hub revision (branch, tag or commit; default main); Hub names only.
      dtype: compute dtype of the model; None: :func:`default_dtype` (float32 on CPU,
        bfloat16 on GPU and TPU).
      param_dtype: storage dtype of the weights; defaults to ``dtype``.
      mesh: a ``jax.sharding.Mesh`` (or a :class:`forge_jax.sharding.MeshConfig`) to
        load the model sharded over, tensor-parallel over ``tp_axis`` and data-parallel
        over ``dp_axis`` (the rules: :mod:`forge_jax.models.llama_sharding`). Each device
        receives only its shard, read from the files as a slice, so a model larger than
        one device loads and the host never holds a full copy per device. None: one
        device.
      tp_axis, dp_axis: the mesh axes' roles (ignored for a ``MeshConfig``).
      quantize: ``"int8"``, ``"int4"`` or ``"fp8"``: quantize the linear layers' kernels
        and a mixture of experts' stacked expert weights (scales per expert) as they load
        (:mod:`forge_jax.models.checkpoints.quantize`); the embedding, norms and routers keep
        ``param_dtype``. None: as stored. With ``mesh``, each kernel is quantized
        whole, then split as its float form would be, the scales with their values
        (int4 groups must not straddle devices: refused with the numbers); quantized
        experts split by expert, their scales with them.
      group_size: int4's values per scale along the in axis (default 32); int8 and fp8
        default to one scale per output channel.

    Returns:
      A :class:`Llama` holding the checkpoint's weights, with ``generation_config.json``
      (if present) in ``model.generation_config``; for a ``model_type`` with a model of its
      own (:data:`forge_jax.models.families.ELSEWHERE`: ``deepseek_v3``), that model, from
      its loader given the same ``dtype``, ``quantize``, ``group_size`` and ``mesh``.

    Raises:
      CheckpointError (a ValueError): unreadable or unsupported config, missing
        files, or a missing, mis-shaped or unexpected tensor, or one holding NaN or inf
        (or values beyond float16's range, loaded as float16) (named in the message).
      ValueError: a ``dtype`` or ``param_dtype`` that is not a float dtype; a mesh the
        model's head counts or sizes cannot be split over.
    """
    from safetensors import SafetensorError, safe_open

    from forge_jax.models import llama_sharding
    from forge_jax.models.checkpoints import quantize as quantize_load

    quantize_load.check_quantize(quantize, group_size)
    dtype = default_dtype() if dtype is None else _float_dtype("dtype", dtype)
    param_dtype = dtype if param_dtype is None else _float_dtype("param_dtype", param_dtype)
    from forge_jax.models.checkpoints import gguf as gguf_checkpoint

    path = expand_user(path)
    if gguf_checkpoint.is_gguf(path):
        if quantize is not None or mesh is not None:
            raise ValueError(f"a GGUF file loads as it is quantized, onto one device: "
                             f"quantize={quantize!r} and mesh= are not supported with {path}")
        return gguf_checkpoint.from_gguf(path, dtype=dtype, param_dtype=param_dtype)
    path = resolve_checkpoint(path, revision=revision)
    loader = _loader_elsewhere(path)
    if loader is not None:  # a family with a model of its own (DeepSeek-V3)
        if param_dtype != dtype:
            raise ValueError(f"{path} loads a model whose weights are stored in its compute "
                             f"dtype: param_dtype={param_dtype.name} must be dtype={dtype.name}")
        return loader(path, dtype=dtype, quantize=quantize, group_size=group_size, mesh=mesh,
                      tp_axis=tp_axis, dp_axis=dp_axis)
    from forge_jax.models.checkpoints import gemma4 as gemma4_checkpoint
    if gemma4_checkpoint.is_gemma4(path):  # Gemma 4 text: a model of its own
        return gemma4_checkpoint.from_pretrained(
            path, _safetensors_files(path), _check_finite, dtype=dtype,
            param_dtype=param_dtype, mesh=mesh, tp_axis=tp_axis, dp_axis=dp_axis,
            quantize=quantize, group_size=group_size)
    config = load_config(path)
    fp8 = fp8_checkpoint.quantization(json.loads((path / "config.json").read_text()),
                                      path / "config.json")
    if fp8 is not None and (quantize is not None or mesh is not None):
        raise ValueError(f"{path} is an fp8 checkpoint, loaded as it is quantized onto one "
                         f"device: quantize={quantize!r} and mesh= are not supported with it")
    if fp8 is not None:
        quantize = "fp8"  # for the memory estimate
    mxfp4 = mxfp4_checkpoint.is_mxfp4(json.loads((path / "config.json").read_text()))
    if mxfp4 and quantize is not None:
        raise ValueError(f"{path} is an MXFP4 checkpoint, loaded as it is quantized: "
                         f"quantize={quantize!r} is not supported with it")
    plan = None if mesh is None else llama_sharding.plan(config, mesh, tp_axis=tp_axis,
                                                         dp_axis=dp_axis)
    weights = fj_memory.estimate_inference_memory(config, batch=1, max_len=1,
                                                  param_dtype=param_dtype, quantize=quantize,
                                                  group_size=group_size).weights
    if plan is not None:  # each device holds about its share of the weights
        weights //= plan.mesh.tp
    fj_memory.check_fits(weights, what=f"the weights of {path} in {param_dtype.name}"
                         + ("" if plan is None else f" per device of {plan.mesh.describe()}"))
    layout = TensorLayout() if plan is None else plan.layout
    model = abstract_llama(config, dtype=dtype, param_dtype=param_dtype, layout=layout)
    shardings = None if plan is None else plan.param_shardings(model)
    if quantize is not None and shardings is not None and fp8 is None:
        quantize_load.check_mesh(model, shardings, quantize, group_size)
    expected = hf_parameters(model)
    packed = mxfp4_checkpoint.expert_parameters(model) if mxfp4 else {}
    for name in packed:  # read from their _blocks and _scales instead
        expected.pop(name, None)
    mx_tensors: dict[str, np.ndarray] = {}
    raw = fp8_checkpoint.RawTensors()  # an fp8 checkpoint's fp8 weights and their scales
    handles: dict[str, object] = {}  # tensor name -> the open file holding it
    files: dict[str, str] = {}  # tensor name -> that file's name, for errors
    with contextlib.ExitStack() as stack:
        for file, names in _safetensors_files(path).items():
            try:
                f = stack.enter_context(safe_open(file, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {file}: {e}") from None
            keys = set(f.keys())
            if names is not None and set(names) - keys:
                raise CheckpointError(f"{file.name} lacks tensors its index assigns to it: "
                                      f"{sorted(set(names) - keys)[:5]}")
            for name in sorted(keys):
                if name.endswith(_IGNORED_SUFFIXES) or (
                        name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if packed and name.endswith(mxfp4_checkpoint.SUFFIXES) and name.rsplit(
                        "_", 1)[0] in packed:
                    mx_tensors[name] = f.get_tensor(name)
                    files[name] = file.name
                    continue
                if fp8 is not None and name.endswith(fp8_checkpoint.SCALE_SUFFIX):
                    raw.add(file, name)
                    files[name] = file.name
                    continue
                if name not in expected:
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: not a parameter of a "
                        f"Llama with this config.json")
                hf_shape = expected[name][1]
                tensor = f.get_slice(name)
                shape = tuple(tensor.get_shape())
                if shape != tuple(hf_shape):
                    raise CheckpointError(f"tensor {name!r} in {file.name} has shape {shape}, "
                                          f"expected {tuple(hf_shape)} from config.json")
                kind = tensor.get_dtype()
                if fp8 is not None and kind == fp8_checkpoint.FP8:
                    raw.add(file, name)
                elif kind not in ("F16", "BF16", "F32", "F64"):
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has dtype {kind}, expected float")
                handles[name] = f
                files[name] = file.name
        missing = sorted(set(expected) - set(handles))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:5]}{more}")

        def read(name, index):
            block = np.asarray(handles[name].get_slice(name)[index])
            _check_finite(name, block, files[name], np.dtype(expected[name][0].dtype))
            return block

        skip = frozenset()
        if fp8 is not None:
            skip = frozenset(fp8_checkpoint.load_kernels(
                model, expected, raw, files, fp8, quantize_load.linear_kernels(model)))
            quantize = None
        if packed:
            try:
                skip = skip | mxfp4_checkpoint.load_experts(model, mx_tensors, files,
                                                            shardings)
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from None
        convert = None if quantize is None else quantize_load.converters(
            model, quantize, group_size, shardings)
        fill_parameters(model, read, shardings, convert, skip)
    if plan is not None:
        model.mesh = plan.mesh
    model.generation_config = load_generation_config(path)
    return model


def _loader_elsewhere(path: pathlib.Path):
    """The loader of a checkpoint whose ``model_type`` has a model of its own
    (:func:`forge_jax.models.families.loader_for`), else None (an unreadable config.json is
    :func:`load_config`'s to report)."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return families.loader_for(raw) if isinstance(raw, dict) else None
