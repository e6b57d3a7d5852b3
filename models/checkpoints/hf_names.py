"""The Hugging Face layout of a Llama's weights: which HF tensor fills which parameter
(and which rows of a fused projection), reading a model's parameters from HF tensors
block by block (a device's shard at a time), and writing them back in HF's layout.

Used by checkpoint loading (:mod:`forge_jax.models.checkpoints.hf`) and by sharding a
loaded model (:mod:`forge_jax.models.llama_sharding`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.models.llama_model import Linear, Llama
from forge_jax.models.llama_moe import BiasedMoe, ScaledInputMoe, SparseMoe


@dataclasses.dataclass(frozen=True)
class Expert:
    """An HF expert tensor ``[out, in]`` filling entry ``index`` of a stacked
    ``[experts, in, out]`` parameter, transposed."""

    index: int


# How one HF tensor fills a parameter: None (the whole parameter, as is), for a part of a
# fused projection (stored rows, the HF rows they hold) along axis 0, or an Expert.
Rows = tuple[np.ndarray, np.ndarray] | Expert | None

# The names of a mixture of experts' tensors under a layer: the block, and each expert's
# gate, up and down projections.
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_QWEN_EXPERT_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))


def hf_parameters(
    model: Llama,
) -> dict[str, tuple[nnx.Param, tuple[int, ...], Callable, Rows]]:
    """HF tensor name -> (the parameter, the tensor's HF shape, HF array -> stored array,
    the rows of the parameter it fills: None for all of it, (stored, source) row indices
    for a fused part, see :meth:`Linear.hf_rows`).

    A fused projection's parameter appears once per HF tensor it holds. Works on an
    abstract model (``nnx.eval_shape``) too: nothing is read."""
    if getattr(model.config, "model_type", None) == "gemma4_text":  # a model of its own
        from forge_jax.models.checkpoints.gemma4_names import gemma4_parameters
        return gemma4_parameters(model)
    same = lambda w: w
    out = {"model.embed_tokens.weight": (model.embed_tokens, model.embed_tokens.shape, same,
                                         None),
           "model.norm.weight": (model.norm.weight, model.norm.weight.shape, same, None)}

    def linear(name, lin: Linear, fused: bool = False):
        if not lin.parts:
            out[f"{name}.weight"] = (lin.kernel, lin.hf_shape(), lin.kernel_from_hf, None)
            if lin.bias is not None:
                out[f"{name}.bias"] = (lin.bias, lin.bias.shape, same, None)
            return
        if fused:  # the checkpoint holds the parts as one tensor (Phi-3): offset rows
            stored, source, offset = [], [], 0
            for _, part_stored, part_source in lin.hf_rows():
                stored.append(part_stored)
                source.append(part_source + offset)
                offset += int(part_source.max()) + 1
            rows = (np.concatenate(stored), np.concatenate(source))
            out[f"{name}.weight"] = (lin.kernel, (offset, lin.in_features),
                                     lin.kernel_from_hf, rows)
            if lin.bias is not None:
                out[f"{name}.bias"] = (lin.bias, (offset,), same, rows)
            return
        prefix = name.rsplit(".", 1)[0]
        for part, stored, source in lin.hf_rows():
            size = int(source.max()) + 1
            out[f"{prefix}.{part}.weight"] = (lin.kernel, (size, lin.in_features),
                                              lin.kernel_from_hf, (stored, source))
            if lin.bias is not None:
                out[f"{prefix}.{part}.bias"] = (lin.bias, (size,), same, (stored, source))

    fused = model.config.fused_checkpoint
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for norm, module in layer.norms().items():
            out[f"{p}.{norm}.weight"] = (module.weight, module.weight.shape, same, None)
        for proj in ("qkv_proj", "o_proj"):
            linear(f"{p}.self_attn.{proj}", getattr(layer.self_attn, proj), fused)
        if layer.self_attn.sinks is not None:
            sinks = layer.self_attn.sinks
            out[f"{p}.self_attn.sinks"] = (sinks, sinks.shape, same, None)
        if isinstance(layer.mlp, BiasedMoe):  # gpt-oss: stacked tensors, HF's layout
            for name, param in (("router.weight", layer.mlp.router),
                                ("router.bias", layer.mlp.router_bias),
                                ("experts.gate_up_proj", layer.mlp.gate_up),
                                ("experts.gate_up_proj_bias", layer.mlp.gate_up_bias),
                                ("experts.down_proj", layer.mlp.down),
                                ("experts.down_proj_bias", layer.mlp.down_bias)):
                out[f"{p}.mlp.{name}"] = (param, param.shape, same, None)
            continue
        if isinstance(layer.mlp, SparseMoe):
            _experts(out, p, layer.mlp, model.config.model_type, linear)
            continue
        mlp = "feed_forward" if model.config.model_type == "llama4_text" else "mlp"
        if isinstance(layer.mlp, ScaledInputMoe):  # Llama 4: stacked tensors, HF's layout
            for name, param in (("router.weight", layer.mlp.router),
                                ("experts.gate_up_proj", layer.mlp.gate_up),
                                ("experts.down_proj", layer.mlp.down)):
                out[f"{p}.{mlp}.{name}"] = (param, param.shape, same, None)
            for proj in ("gate_up_proj", "down_proj"):
                linear(f"{p}.{mlp}.shared_expert.{proj}", getattr(layer.mlp.shared_expert, proj))
            continue
        for proj in ("gate_up_proj", "down_proj"):
            linear(f"{p}.{mlp}.{proj}", getattr(layer.mlp, proj), fused)
    if model.lm_head is not None:
        linear("lm_head", model.lm_head)
    return out


def _experts(out: dict, p: str, moe: SparseMoe, model_type: str, linear: Callable) -> None:
    """The HF tensors of layer ``p``'s mixture of experts into ``out``."""
    block, names = _EXPERT_NAMES.get(model_type, _QWEN_EXPERT_NAMES)
    same = lambda w: w
    out[f"{p}.{block}.gate.weight"] = (moe.router, moe.router.shape, same, None)
    for param, name in zip((moe.w_gate, moe.w_up, moe.w_down), names, strict=True):
        hf_shape = (param.shape[2], param.shape[1])
        for e in range(param.shape[0]):
            out[f"{p}.{block}.experts.{e}.{name}.weight"] = (param, hf_shape, np.transpose,
                                                              Expert(e))
    if moe.shared_expert is not None:
        for proj in ("gate_up_proj", "down_proj"):
            linear(f"{p}.{block}.shared_expert.{proj}", getattr(moe.shared_expert, proj))
        gate = moe.shared_expert_gate
        out[f"{p}.{block}.shared_expert_gate.weight"] = (gate, gate.shape, same, None)


# reader(name, index) -> the HF tensor's block at index (a tuple of slices or int arrays).
Reader = Callable[[str, tuple], np.ndarray]


def _sources(model: Llama) -> dict[int, tuple[nnx.Param, list[tuple[str, Callable, Rows]]]]:
    """id(parameter) -> (the parameter, [(HF name, convert, rows)] of the tensors filling it)."""
    out: dict[int, tuple[nnx.Param, list]] = {}
    for name, (param, _, convert, rows) in hf_parameters(model).items():
        out.setdefault(id(param), (param, []))[1].append((name, convert, rows))
    return out


def _block(shape: tuple[int, ...], index: tuple, dtype, sources, read: Reader) -> np.ndarray:
    """The block ``index`` (a tuple of slices, one device's shard) of a parameter of
    ``shape``, read from its HF tensors: only the rows and columns the block holds."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
    out = np.empty([hi - lo for lo, hi in bounds], dtype)
    rest = tuple(slice(lo, hi) for lo, hi in bounds[1:])
    for name, convert, rows in sources:
        if rows is None:
            out[...] = convert(read(name, (slice(*bounds[0]),) + rest))  # cast as written
            continue
        if isinstance(rows, Expert):  # HF [out, in] -> entry index of [experts, in, out]
            if bounds[0][0] <= rows.index < bounds[0][1]:
                out[rows.index - bounds[0][0]] = convert(read(name, rest[::-1]))
            continue
        stored, source = rows
        mine = (stored >= bounds[0][0]) & (stored < bounds[0][1])
        if not mine.any():
            continue
        lo, hi = int(source[mine].min()), int(source[mine].max()) + 1
        hf = read(name, (slice(lo, hi),) + rest)  # only the HF rows this block needs
        out[stored[mine] - bounds[0][0]] = convert(hf[source[mine] - lo])
    return out


def fill_parameters(model: Llama, read: Reader, shardings=None, convert=None,
                    skip: frozenset[int] = frozenset()) -> None:
    """Sets every parameter of ``model`` (abstract or not) from HF tensors, each block
    read with ``read(name, index)`` (:data:`Reader`).

    ``shardings``: id(parameter) -> a ``jax.sharding.Sharding``; each device then gets
    its block through ``jax.make_array_from_callback`` and nothing reads more than the
    devices of this process hold. None: whole arrays on the default device.
    ``convert``: id(parameter) -> a function of the parameter's whole array (e.g. one
    that quantizes it and, on a mesh, places it in its shards), applied as each
    parameter is read; it takes the place of ``shardings`` for that parameter.
    ``skip``: ids of parameters the caller has set (e.g. fp8 kernels read as they are).
    """
    for key, (param, sources) in _sources(model).items():
        if key in skip:
            continue
        dtype = np.dtype(param.dtype)
        shape = tuple(param.shape)
        if convert is not None and key in convert:
            param.set_value(convert[key](jnp.asarray(_block(shape, (), dtype, sources, read))))
        elif shardings is None:
            param.set_value(jnp.asarray(_block(shape, (), dtype, sources, read)))
        else:
            param.set_value(jax.make_array_from_callback(
                shape, shardings[key],
                lambda index, shape=shape, dtype=dtype, sources=sources:
                    _block(shape, index, dtype, sources, read)))


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and in HF's layout, as float32 NumPy
    arrays (the inverse of :func:`from_pretrained`, e.g. to ``save_file`` them)."""
    out = {}
    host: dict[int, np.ndarray] = {}  # id(parameter) -> it on the host, read once
    for name, (param, hf_shape, convert, rows) in hf_parameters(model).items():
        if id(param) not in host:
            host[id(param)] = np.asarray(param[...], np.float32)
        stored = host[id(param)]
        if isinstance(rows, Expert):  # one expert of a stacked [experts, in, out] parameter
            out[name] = np.ascontiguousarray(stored[rows.index].T)
            continue
        if rows is not None:  # a fused part: its HF rows (a copied row is read once)
            hf = np.empty((hf_shape[0],) + stored.shape[1:], np.float32)
            hf[rows[1]] = stored[rows[0]]
            stored = hf
        # convert maps HF's layout to ours (the identity today); check that it still is.
        if stored.shape != tuple(hf_shape) or not np.array_equal(convert(stored), stored):
            raise ValueError(f"cannot convert {name} of shape {stored.shape} to HF's {hf_shape}")
        out[name] = stored
    if getattr(model.config, "model_type", None) == "gemma4_text":  # its experts, transposed
        from forge_jax.models.checkpoints.gemma4_names import expert_parameters
        for name, param in expert_parameters(model).items():
            out[name] = np.ascontiguousarray(np.swapaxes(np.asarray(param[...], np.float32), 1, 2))
    return out
