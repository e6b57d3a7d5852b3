"""The Hugging Face name of each parameter of a Gemma 4 text model
(:class:`~forge_jax.models.gemma4.Gemma4`), as :mod:`forge_jax.models.checkpoints.hf_names`
gives a Llama's."""

from __future__ import annotations

from flax import nnx

from forge_jax.models.gemma4 import Gemma4
from forge_jax.models.llama_model import Linear


def gemma4_parameters(model: Gemma4) -> dict:
    """HF tensor name -> (parameter, HF shape, HF array -> stored array, None), as
    :func:`forge_jax.models.checkpoints.hf_names.hf_parameters` gives them; the experts'
    stacked tensors (stored transposed) are :func:`expert_parameters`'."""
    same = lambda w: w
    out = {}

    def param(name, p):
        if p is not None:
            out[name] = (p, p.shape, same, None)

    def linear(name, lin: Linear | None):
        if lin is not None:
            out[f"{name}.weight"] = (lin.kernel, lin.hf_shape(), lin.kernel_from_hf, None)
            if lin.bias is not None:
                param(f"{name}.bias", lin.bias)

    param("model.embed_tokens.weight", model.embed_tokens)
    param("model.norm.weight", model.norm.weight)
    param("model.embed_tokens_per_layer.weight", model.embed_tokens_per_layer)
    linear("model.per_layer_model_projection", model.per_layer_model_projection)
    if model.per_layer_projection_norm is not None:
        param("model.per_layer_projection_norm.weight", model.per_layer_projection_norm.weight)
    linear("lm_head", model.lm_head)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for norm, module in layer.norms().items():
            param(f"{p}.{norm}.weight", module.weight)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{p}.self_attn.{proj}", getattr(layer.self_attn, proj))
        mlp = layer.mlp
        for part, stored, source in mlp.gate_up_proj.hf_rows():
            out[f"{p}.mlp.{part}.weight"] = (mlp.gate_up_proj.kernel,
                                             (int(source.max()) + 1, mlp.gate_up_proj.in_features),
                                             mlp.gate_up_proj.kernel_from_hf, (stored, source))
        linear(f"{p}.mlp.down_proj", mlp.down_proj)
        linear(f"{p}.per_layer_input_gate", layer.per_layer_input_gate)
        linear(f"{p}.per_layer_projection", layer.per_layer_projection)
        param(f"{p}.layer_scalar", layer.layer_scalar)
        if layer.moe is not None:
            param(f"{p}.router.proj.weight", layer.moe.router)
            param(f"{p}.router.scale", layer.moe.scale)
            param(f"{p}.router.per_expert_scale", layer.moe.per_expert_scale)
    return out


def expert_parameters(model: Gemma4) -> dict[str, nnx.Param]:
    """HF name -> the stacked expert parameter it fills, transposed (HF ``[E, out, in]``,
    stored ``[E, in, out]``)."""
    out = {}
    for i, layer in enumerate(model.layers):
        if layer.moe is not None:
            out[f"model.layers.{i}.experts.gate_up_proj"] = layer.moe.gate_up
            out[f"model.layers.{i}.experts.down_proj"] = layer.moe.down
    return out
