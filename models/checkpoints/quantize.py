"""Quantizing a Llama's linear layers as its checkpoint loads (``from_pretrained(path,
quantize="int8" | "int4" | "fp8")``), tensor by tensor, and counting a model's bytes.

The projections (q/k/v, o, gate/up, down, a shared expert's, and an untied ``lm_head``)
become :class:`forge_jax.QuantizedArray` kernels, which
:class:`~forge_jax.models.llama_model.Linear` multiplies with ``fj.matmul`` (dequantized
inside the product); the embedding and the norms keep ``param_dtype``. Each kernel is
quantized as soon as it is read, so the host holds one float copy of one tensor beyond
the quantized model.

A mixture of experts' stacked expert weights (:class:`~forge_jax.models.llama_moe.SparseMoe`'s
``w_gate``, ``w_up``, ``w_down``) are quantized per expert in HF's ``[experts, out, in]``
layout (each expert its own per-output-channel scales or groups along its in axis), which
``fj.grouped_matmul`` dequantizes one expert at a time; a stacked parameter is read whole,
so the host briefly holds one projection's experts of one layer in float (twice: the read
and its transpose). The router and Qwen2-MoE's shared-expert gate stay in ``param_dtype``.

On a mesh each kernel is quantized whole (the same numbers as on one device), then its
values and scales are placed split as the float kernel would be
(:mod:`forge_jax.models.llama_sharding`): column-parallel kernels over their output
channels with their scales, row-parallel ones over their input channels, a
per-output-channel scale then on every device and int4's groups split with the values
(refused where a group would straddle two devices). Quantized experts split by expert as
their float form does, each expert's scales with it (``fj.grouped_matmul`` multiplies each
device's experts where they lie).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import forge_jax as fj
from forge_jax import quant as fj_quant
from forge_jax.models.llama_model import Linear, Llama
from forge_jax.models.llama_moe import BiasedMoe, GeluExpertsMoe, ScaledInputMoe, SparseMoe

# --quantize's choices: format and its default group size along the in axis.
FORMATS = {"int8": None, "int4": 32, "fp8": None}


def check_quantize(quantize: str | None, group_size: int | None) -> None:
    """Raises ValueError for a ``quantize`` or ``group_size`` from_pretrained cannot use."""
    if quantize is None:
        if group_size is not None:
            raise ValueError(f"group_size={group_size} needs quantize=")
        return
    if quantize not in FORMATS:
        raise ValueError(f"quantize={quantize!r} is not a format; choose one of "
                         f"{', '.join(FORMATS)}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(
            group_size, int) or group_size <= 0 or group_size % 2):
        raise ValueError(f"group_size must be a positive even int, got {group_size=!r}")


def quantizer(quantize: str, group_size: int | None, sharding: NamedSharding | None = None
              ) -> Callable[[jax.Array], fj.QuantizedArray]:
    """The function that quantizes one ``[out, in]`` kernel (whole, as on one device),
    then, with ``sharding``, places it on its mesh, the scales with their values
    (:func:`forge_jax.quant.place`)."""
    group = FORMATS[quantize] if group_size is None else group_size

    def convert(kernel: jax.Array) -> fj.QuantizedArray:
        size = group if group is not None and kernel.shape[-1] % group == 0 else None
        if group is not None and size is None:
            raise ValueError(f"group_size={group} does not divide a kernel's in features "
                             f"({kernel.shape[-1]}); choose another group_size")
        q = fj.quantize(kernel, quantize, group_size=size)
        return q if sharding is None else fj_quant.place(q, sharding)

    return convert


def check_mesh(model: Llama, shardings: dict[int, NamedSharding], quantize: str,
               group_size: int | None) -> None:
    """Raises ValueError, before anything is read, if a quantized kernel of ``model``
    (abstract) cannot split as ``shardings`` says: int4 groups cut by the split of a
    row-parallel kernel's in features (naming the kernel, the group size and each
    device's share). Experts split by expert, which cuts no block."""
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, Linear):
            continue
        kernel = module.kernel
        q = jax.eval_shape(quantizer(quantize, group_size),
                           jax.ShapeDtypeStruct(kernel.shape, kernel.dtype))
        sharding = shardings[id(kernel)]
        try:
            fj_quant.partition_specs(q, sharding.spec, sharding.mesh.shape)
        except ValueError as e:
            name = ".".join(str(p) for p in path)
            raise ValueError(f"quantize={quantize!r} on this mesh: {name}: {e}") from None


def expert_quantizer(quantize: str, group_size: int | None,
                     sharding: NamedSharding | None = None
                     ) -> Callable[[jax.Array], fj.QuantizedArray]:
    """The function that quantizes one stacked expert weight, given in the model's
    ``[experts, in, out]`` layout, into ``[experts, out, in]`` with scales per expert, then,
    with ``sharding`` (split by expert), places it on its mesh."""
    convert = quantizer(quantize, group_size, sharding)
    return lambda stacked: convert(jax.numpy.swapaxes(stacked, 1, 2))


def expert_kernels(model: Llama) -> list[nnx.Param]:
    """The stacked expert weights of the model's mixture-of-experts layers (not the
    routers)."""
    out = []
    for _, module in nnx.iter_graph(model):
        if isinstance(module, SparseMoe):
            out += [module.w_gate, module.w_up, module.w_down]
        elif isinstance(module, BiasedMoe | ScaledInputMoe | GeluExpertsMoe):
            out += [module.gate_up, module.down]  # gpt-oss, Llama 4, Gemma 4
    return out


def converters(model: Llama, quantize: str, group_size: int | None,
               shardings: dict[int, NamedSharding] | None = None) -> dict[int, Callable]:
    """id(parameter) -> the function quantizing it, for every kernel ``quantize=`` covers:
    the linear layers' and the experts' (each placed as ``shardings`` says, on a mesh)."""
    out = {id(k): quantizer(quantize, group_size,
                            None if shardings is None else shardings[id(k)])
           for k in linear_kernels(model)}
    out.update({id(k): expert_quantizer(quantize, group_size,
                                        None if shardings is None else shardings[id(k)])
                for k in expert_kernels(model)})
    return out


def linear_kernels(model: Llama) -> list[nnx.Param]:
    """The kernels of the model's linear layers (not the embedding, nor the norms)."""
    return [module.kernel for _, module in nnx.iter_graph(model) if isinstance(module, Linear)]


def parameter_bytes(model: Llama) -> int:
    """Bytes of the model's parameters as stored (a quantized kernel's values, scales and
    minimums), measured from the arrays."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves))
