"""Reading transformers-written Qwen3-Next and Qwen3.5 text checkpoints (safetensors) into a
:class:`~forge_jax.models.qwen3_next.Qwen3Next`, optionally quantizing its linear layers and
experts as they load (``quantize=``, as
:func:`forge_jax.models.checkpoints.hf.from_pretrained` does for the Llama families).

The tensors of a gated delta-rule layer go through
:func:`forge_jax.models.gated_deltanet.load_hf` (Qwen3-Next's fused, key-head-grouped
``in_proj_qkvz`` / ``in_proj_ba`` reordered there); the rest map name by name
(:func:`hf_parameters`). A multi-token-prediction head (``mtp.*``) is not read; any other
tensor the model has no parameter for is an error naming it, as is a missing one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors can read it)
import numpy as np
from flax import nnx

from forge_jax import sharding as fj_sharding
from forge_jax.models import gated_deltanet
from forge_jax.models.checkpoints.generation_config import CheckpointError, load_generation_config
from forge_jax.models.checkpoints.hub import expand_user, resolve_checkpoint
from forge_jax.models.llama_model import Linear
from forge_jax.models.llama_moe import SparseMoe
from forge_jax.models.qwen3_next import Qwen3Next
from forge_jax.models.qwen3_next_config import Qwen3NextConfig


def load_config(path: str | os.PathLike, *, revision: str | None = None,
                chunk_size: int = 64) -> Qwen3NextConfig:
    """``path/config.json`` (a directory or a Hub id) as a :class:`Qwen3NextConfig`; errors
    name the file."""
    path = resolve_checkpoint(expand_user(path), revision=revision)
    file = pathlib.Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return Qwen3NextConfig.from_hf(json.loads(file.read_text()), chunk_size=chunk_size)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def hf_parameters(model: Qwen3Next) -> dict[str, tuple[nnx.Param, tuple[int, ...], Callable]]:
    """HF tensor name -> (the parameter it fills, its HF shape, ``put(value, array)``: the
    parameter's array with the tensor written in), for every parameter outside the
    delta-rule layers (those: :func:`forge_jax.models.gated_deltanet.load_hf`)."""
    def whole(value, array):
        return value

    out: dict[str, tuple[nnx.Param, tuple[int, ...], Callable]] = {
        "model.embed_tokens.weight": (model.embed_tokens, model.embed_tokens.shape, whole),
        "model.norm.weight": (model.norm.weight, model.norm.weight.shape, whole)}

    def linear(prefix: str, name: str, lin: Linear):
        if not lin.parts:
            out[f"{prefix}.{name}.weight"] = (lin.kernel, lin.hf_shape(), whole)
            return
        for part, (name, stored, source) in zip(lin.parts, lin.hf_rows(), strict=True):
            def put(value, array, stored=stored, source=source):
                array[stored] = value[source]  # (KV heads copied on a wide tensor axis)
                return array
            out[f"{prefix}.{name}.weight"] = (lin.kernel, (part.rows, lin.in_features), put)

    def mlp(prefix: str, module):
        linear(prefix, "gate_up_proj", module.gate_up_proj)
        linear(prefix, "down_proj", module.down_proj)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(layer, norm).weight
            out[f"{p}.{norm}.weight"] = (w, w.shape, whole)
        if layer.self_attn is not None:
            attn = layer.self_attn
            linear(f"{p}.self_attn", "qkv_proj", attn.qkv_proj)
            linear(f"{p}.self_attn", "o_proj", attn.o_proj)
            for norm in ("q_norm", "k_norm"):
                w = getattr(attn, norm).weight
                out[f"{p}.self_attn.{norm}.weight"] = (w, w.shape, whole)
        if not isinstance(layer.mlp, SparseMoe):
            mlp(f"{p}.mlp", layer.mlp)
            continue
        moe = layer.mlp
        out[f"{p}.mlp.gate.weight"] = (moe.router, moe.router.shape, whole)
        gate = moe.shared_expert_gate
        out[f"{p}.mlp.shared_expert_gate.weight"] = (gate, gate.shape, whole)
        mlp(f"{p}.mlp.shared_expert", moe.shared_expert)
        for param, name in ((moe.w_gate, "gate_proj"), (moe.w_up, "up_proj"),
                            (moe.w_down, "down_proj")):
            for e in range(param.shape[0]):  # HF [out, in] -> entry e of [experts, in, out]
                def put(value, array, e=e):
                    array[e] = value.T
                    return array
                out[f"{p}.mlp.experts.{e}.{name}.weight"] = (
                    param, (param.shape[2], param.shape[1]), put)
    if model.lm_head is not None:
        linear("", "lm_head", model.lm_head)
        out["lm_head.weight"] = out.pop(".lm_head.weight")
    return out


def from_pretrained(path: str | os.PathLike, *, revision: str | None = None, dtype=None,
                    param_dtype=None, quantize: str | None = None,
                    group_size: int | None = None, chunk_size: int = 64, mesh=None,
                    tp_axis: str = "tp", dp_axis: str = "dp") -> Qwen3Next:
    """Loads a Qwen3-Next or Qwen3.5 text checkpoint directory (or Hub id).

    Args:
      path, revision: as :func:`forge_jax.models.checkpoints.hf.from_pretrained`.
      dtype: the compute dtype; None: float32 on CPU, bfloat16 on GPU and TPU.
      param_dtype: the weights' storage dtype; defaults to ``dtype``.
      quantize, group_size: ``"int8"``, ``"int4"`` or ``"fp8"``: the linear layers'
        kernels (attention, delta-rule projections, MLPs, shared experts, an untied
        ``lm_head``) and the stacked experts quantized as each layer loads; embeddings,
        norms, routers, gates, the convolution and the delta rule's parameters stay
        ``param_dtype``.
      chunk_size: the delta rule's prefill chunk.
      mesh, tp_axis, dp_axis: a ``jax.sharding.Mesh`` (axes named by ``tp_axis`` and
        ``dp_axis``) or a :class:`forge_jax.sharding.MeshConfig` to load the model sharded
        over, as :mod:`forge_jax.models.qwen3_next_sharding` says (sizes that do not split
        are refused before any tensor is read; each tensor is placed in its shards as its
        layer loads); ``model.mesh`` then holds it. None: one device.

    Raises:
      CheckpointError: an unreadable or unsupported config, a missing, mis-shaped or
        unexpected tensor (named).
    """
    from safetensors import safe_open

    from forge_jax.models import qwen3_next_sharding
    from forge_jax.models.checkpoints import hf
    from forge_jax.models.checkpoints import quantize as quantize_load

    quantize_load.check_quantize(quantize, group_size)
    dtype = hf.default_dtype() if dtype is None else jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    path = resolve_checkpoint(expand_user(path), revision=revision)
    config = load_config(path, chunk_size=chunk_size)
    plan = None if mesh is None else qwen3_next_sharding.plan(config, mesh, tp_axis=tp_axis,
                                                              dp_axis=dp_axis)
    model = nnx.eval_shape(lambda: Qwen3Next(
        config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
        **({} if plan is None else dict(layout=plan.layout))))
    shardings = None if plan is None else plan.param_shardings(model)
    if quantize is not None and shardings is not None:
        quantize_load.check_mesh(model, shardings, quantize, group_size)
    convert = {} if quantize is None else quantize_load.converters(model, quantize, group_size,
                                                                   shardings)
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file")
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in files:
            f = stack.enter_context(safe_open(file, framework="numpy"))
            handles.update(dict.fromkeys(f.keys(), f))
        used = _fill(model, handles, convert, path, shardings or {})
    unused = sorted(n for n in set(handles) - used if not n.startswith("mtp.")
                    and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unused:
        raise CheckpointError(f"unexpected tensor {unused[0]!r} in {path}: not a parameter of a "
                              f"{config.model_type} model with this config.json")
    model.generation_config = load_generation_config(path)
    model.mesh = None if plan is None else plan.mesh
    return model


def _fill(model: Qwen3Next, handles: dict, convert: dict, path, shardings: dict) -> set[str]:
    """Sets every parameter of ``model`` (abstract) from the open files ``handles`` (tensor
    name -> file), one layer at a time, quantizing a layer's kernels (``convert``: id ->
    function, which places them on a mesh) once it is read, and placing the others as
    ``shardings`` (id -> NamedSharding; empty: one device) says; returns the names read."""
    used: set[str] = set()

    def place(param: nnx.Param, value) -> None:
        if id(param) in convert:
            value = convert[id(param)](jnp.asarray(value, param.dtype))
        elif id(param) in shardings:
            value = fj_sharding.put(np.asarray(value, param.dtype), shardings[id(param)])
        else:
            value = jnp.asarray(value, param.dtype)
        param.set_value(value)

    def tensor(name: str, shape=None) -> np.ndarray:
        if name not in handles:
            raise CheckpointError(f"checkpoint {path} is missing tensor {name!r}")
        value = handles[name].get_tensor(name)
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(value.shape)}, expected "
                                  f"{tuple(shape)} from config.json")
        used.add(name)
        return value.astype(np.float32)

    groups: dict[int, dict] = {}  # layer (-1: outside the layers) -> its names
    for name, entry in hf_parameters(model).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        groups.setdefault(layer, {})[name] = entry
    for layer in sorted(groups):
        arrays: dict[int, tuple[nnx.Param, np.ndarray]] = {}  # id -> (parameter, its array)
        for name, (param, shape, put) in groups[layer].items():
            held = arrays.get(id(param), (param, np.zeros(param.shape, np.float32)))[1]
            arrays[id(param)] = (param, put(tensor(name, shape), held))
        for param, array in arrays.values():
            place(param, array)
        module = model.layers[layer].linear_attn if layer >= 0 else None
        if module is not None:
            prefix = f"model.layers.{layer}.linear_attn."
            names = [prefix + n for n in _GDN_TENSORS if prefix + n in handles]
            try:
                gated_deltanet.load_hf(module, {n: tensor(n) for n in names}, prefix)
            except KeyError as e:
                raise CheckpointError(f"checkpoint {path} is missing tensor {e}") from None
            except ValueError as e:
                raise CheckpointError(f"checkpoint {path}: {e}") from None
            for _, param in nnx.iter_graph(module):  # as load_hf set them: one device
                if isinstance(param, nnx.Param):
                    place(param, param.get_value())
    return used


# A delta-rule layer's tensors (Qwen3-Next's fused projections, or Qwen3.5's apart).
_GDN_TENSORS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "in_proj_qkv.weight",
                "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight",
                "conv1d.weight", "dt_bias", "A_log", "norm.weight")

