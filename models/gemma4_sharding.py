"""Gemma 4 text on a device mesh: which weight and which cache buffer splits along which axis.

Tensor parallelism over the tensor axis ``tp`` of size ``T``, Megatron-style as for the
Llama family (:mod:`forge_jax.models.llama_sharding`):

* Attention by head: ``q_proj`` splits its output rows (whole query heads per device) and
  ``o_proj`` its input columns (one all-reduce after it), on the sliding and the full
  layers alike (their head widths differ, their head counts do not). ``k_proj`` and
  ``v_proj`` split their rows where the layer type's KV heads divide by ``T``, else they
  are replicated (every device computes the few KV heads and keeps the ones its query
  heads read). Shared-KV layers have no K/V projections; they read their source layer's
  cache slot, split like every other.
* The KV cache (one geometry for both layer types,
  :attr:`~forge_jax.models.gemma4_config.Gemma4Config.kv_cache_geometry`) splits by KV head
  over the tensor axis. With fewer cache heads than devices (``T`` a multiple of them),
  each head is stored ``T // heads`` times (``layout.kv_repeat``; a repeated head serves the
  same query heads, as the sliding layers' repeat into the full layers' count already does).
* The dense MLP (double-wide on the shared layers) splits its intermediate dimension (gate
  and up by rows, stored group by group so each device holds its gate and its up; down by
  columns). The mixture of experts splits by expert (expert parallelism:
  :func:`forge_jax.grouped_matmul`'s partition rule sums the partial products); the router,
  its scales and the per-expert scales are replicated.
* Per-layer inputs: the per-layer embedding table splits over its vocabulary (as the token
  embedding and the output head do, when the vocabulary divides by ``T``), the projection of
  the embeddings over its ``num_hidden_layers * hidden_size_per_layer_input`` outputs, and
  each layer's input gate (rows) and projection (columns) over
  ``hidden_size_per_layer_input`` when they divide; otherwise they are replicated.
* Norms and layer scalars are replicated.

``num_attention_heads``, the MLP widths and ``num_experts`` must divide by ``T``, and the
cache's KV heads must divide by ``T`` or divide it (refused naming the numbers). Data
parallelism over ``dp`` replicates the weights and splits the batch (the contiguous cache's
rows); the paged pool is split by KV head only.
"""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding

from forge_jax import quant as fj_quant
from forge_jax import sharding as fj_sharding
from forge_jax.models.gemma4 import Gemma4
from forge_jax.models.gemma4_config import Gemma4Config
from forge_jax.models.llama_model import Linear, TensorLayout

__all__ = ["layout_for", "mesh_config", "param_shardings", "shard"]


def mesh_config(mesh: Mesh | fj_sharding.MeshConfig, *, tp_axis: str = "tp",
                dp_axis: str = "dp") -> fj_sharding.MeshConfig:
    """``mesh`` as a :class:`forge_jax.sharding.MeshConfig` (axis roles as named)."""
    if isinstance(mesh, Mesh):
        return fj_sharding.MeshConfig(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    if not isinstance(mesh, fj_sharding.MeshConfig):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a forge_jax.sharding.MeshConfig, "
                        f"got {mesh!r:.80}")
    return mesh


def layout_for(config: Gemma4Config, tp: int) -> TensorLayout:
    """The weight layout for a tensor axis of ``tp`` devices (the rules above).

    Raises:
      ValueError: a size that does not split over ``tp``, naming it and its value.
    """
    sizes = {"num_attention_heads": config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    if config.num_experts:
        sizes["num_experts"] = config.num_experts
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(f"gemma4_text splits over a tensor axis of {tp} devices only if these "
                         f"divide by {tp}: {bad}")
    heads = config.kv_cache_geometry[1]
    if heads % tp == 0:
        return TensorLayout(groups=tp, kv_repeat=1)
    if tp % heads == 0:
        return TensorLayout(groups=tp, kv_repeat=tp // heads)
    raise ValueError(f"gemma4_text's KV cache holds {heads} KV heads (num_key_value_heads="
                     f"{config.num_key_value_heads}, num_global_key_value_heads="
                     f"{config.num_global_key_value_heads}), which neither split over a tensor "
                     f"axis of {tp} devices nor divide it")


def param_shardings(model: Gemma4, mesh: fj_sharding.MeshConfig) -> dict[int, NamedSharding]:
    """id(parameter) -> its ``NamedSharding``, for every parameter of ``model`` (abstract
    or not)."""
    c, m, tp = model.config, mesh, mesh.tp_name
    t = mesh.tp
    rows, cols, none = m.sharding(tp, None), m.sharding(None, tp), m.replicated()
    vocab = rows if c.vocab_size % t == 0 else none
    out = {id(model.embed_tokens): vocab, id(model.norm.weight): none}

    def linear(lin: Linear | None, split_rows: bool, split: bool = True):
        if lin is None:
            return
        out[id(lin.kernel)] = (rows if split_rows else cols) if split else none
        if lin.bias is not None:
            out[id(lin.bias)] = m.sharding(tp) if split and split_rows else none

    if model.lm_head is not None:
        out[id(model.lm_head.kernel)] = vocab
    p = c.hidden_size_per_layer_input
    if p:
        out[id(model.embed_tokens_per_layer)] = (
            rows if c.vocab_size_per_layer_input % t == 0 else none)
        linear(model.per_layer_model_projection, True, (c.num_hidden_layers * p) % t == 0)
        out[id(model.per_layer_projection_norm.weight)] = none
    for i, layer in enumerate(model.layers):
        for norm in layer.norms().values():
            out[id(norm.weight)] = none
        out[id(layer.layer_scalar)] = none
        attn = layer.self_attn
        linear(attn.q_proj, True)
        linear(attn.o_proj, False)
        kv_split = c.layer_kv_heads(i) % t == 0
        linear(attn.k_proj, True, kv_split)
        linear(attn.v_proj, True, kv_split)
        linear(layer.mlp.gate_up_proj, True)
        linear(layer.mlp.down_proj, False)
        linear(layer.per_layer_input_gate, True, bool(p) and p % t == 0)
        linear(layer.per_layer_projection, False, bool(p) and p % t == 0)
        if layer.moe is not None:  # whole experts per device; the router everywhere
            moe = layer.moe
            for w in (moe.router, moe.scale, moe.per_expert_scale):
                out[id(w)] = none
            for w in (moe.gate_up, moe.down):
                out[id(w)] = m.sharding(tp, None, None)
    return out


def shard(model: Gemma4, mesh: Mesh | fj_sharding.MeshConfig, *, tp_axis: str = "tp",
          dp_axis: str = "dp") -> Gemma4:
    """A copy of ``model`` sharded over ``mesh`` (``model`` itself is left as it is): the
    weights re-laid out for the tensor axis (:func:`layout_for`), each device receiving
    only its shard. The result computes what ``model`` computes."""
    from flax import nnx

    from forge_jax.models.checkpoints import hf_names
    from forge_jax.models.checkpoints.gemma4_names import expert_parameters

    if model.mesh is not None or model.layout != TensorLayout():
        raise ValueError(f"model is already laid out for a mesh ({model.layout}); shard the "
                         f"single-device model")
    if any(isinstance(p.get_value(), fj_quant.QuantizedArray)
           for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)):
        raise ValueError("model has quantized weights, which shard() does not re-lay out: load "
                         "it with llama.from_pretrained(path, quantize=..., mesh=...)")
    mesh = mesh_config(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    layout = layout_for(model.config, mesh.tp)
    hf = hf_names.hf_state_dict(model)  # the weights in HF's layout, on the host
    sharded = nnx.eval_shape(lambda: Gemma4(model.config, rngs=nnx.Rngs(0), dtype=model.dtype,
                                            param_dtype=model.param_dtype, layout=layout))
    shardings = param_shardings(sharded, mesh)
    experts = expert_parameters(sharded)
    for name, param in experts.items():  # HF [E, out, in] -> stored [E, in, out]
        value = hf[name].swapaxes(1, 2).astype(param.dtype)
        param.set_value(fj_sharding.put(value, shardings[id(param)]))
    hf_names.fill_parameters(sharded, lambda name, index: hf[name][index], shardings)
    sharded.mesh = mesh
    sharded.generation_config = model.generation_config
    return sharded
