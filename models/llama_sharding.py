"""The Llama model on a device mesh: which weight and which cache buffer splits along which axis.

Tensor parallelism (Megatron-style) over the tensor axis ``tp`` of size ``T``:

* ``qkv_proj`` and ``gate_up_proj`` split their output rows: each device computes its
  own query heads, KV heads and slice of the MLP's intermediate dimension. Their rows
  are stored group by group (:class:`~forge_jax.models.llama_model.Linear`), so an even
  split gives every device whole heads of q, k and v (and of gate and up).
* ``o_proj`` and ``down_proj`` split their input columns: each device multiplies its
  own heads (or intermediate slice) and XLA sums the partial products with one
  all-reduce. That is the only communication of a layer: one all-reduce after the
  attention's output projection and one after the MLP's down projection.
* The vocabulary (embedding table and output head) splits over the tensor axis when
  ``vocab_size`` divides by ``T``; otherwise both are replicated.
* Norm weights are replicated.

The head rule: ``num_attention_heads`` must divide by ``T``. KV heads split over the
axis when ``num_key_value_heads`` divides by ``T``; when there are fewer KV heads than
devices and ``T`` divides by ``num_key_value_heads``, each KV head is stored
``T // num_key_value_heads`` times (one copy per device that reads it: the KV cache holds
``T`` heads, one per device); other combinations are refused with the numbers.
``intermediate_size`` must divide by ``T`` (where a layer has the dense MLP).

A mixture of experts' layers split by expert over the tensor axis (expert parallelism:
each device holds ``num_experts / T`` whole experts, multiplies the tokens routed to
them, and the partial products are summed over the axis, ``fj.grouped_matmul``'s
partition rule); ``num_experts`` must divide by ``T``. So do gpt-oss's (with their
biases, and MXFP4 experts as loaded) and Llama 4's. The router is replicated; a shared
expert splits like the dense MLP (its width must divide by ``T``).

Data parallelism over the data axis ``dp``: weights are replicated across it; the batch
(tokens, lengths, the contiguous cache's rows) splits across it when the batch divides.
The paged pool is shared by every sequence, so it splits by KV head over the tensor axis
only; its block tables are replicated.

Quantized kernels (``from_pretrained(quantize=..., mesh=...)``) split the same way, each
quantized whole and then placed with its scales beside its values
(:func:`forge_jax.quant.place`): over output channels with their scales, or over input
channels with a per-output-channel scale on every device and int4's groups split with
their values (a split that would cut a group is refused).

The ops themselves run per shard (:mod:`forge_jax.sharding`); nothing here is needed by
model code beyond the layout of the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from forge_jax import quant as fj_quant
from forge_jax import sharding as fj_sharding
from forge_jax.models.checkpoints import hf_names as llama_hf
from forge_jax.models.llama_caches import cache_shardings, create_cache  # noqa: F401
from forge_jax.models.llama_model import Llama, LlamaConfig, TensorLayout
from forge_jax.models.llama_moe import BiasedMoe, ScaledInputMoe, SparseMoe

__all__ = ["ShardingPlan", "layout_for", "plan", "shard", "cache_shardings"]


def layout_for(config: LlamaConfig, tp: int) -> TensorLayout:
    """The weight layout for a tensor axis of ``tp`` devices (the head rule above).

    Raises:
      ValueError: head counts or the intermediate size that do not split over ``tp``,
        naming the numbers.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(f"num_attention_heads={heads} does not split over a tensor axis of "
                         f"{tp} devices (it must be a multiple of {tp})")
    dense = any(not config.is_moe(i) for i in range(config.num_hidden_layers))
    if dense and config.intermediate_size % tp:
        raise ValueError(f"intermediate_size={config.intermediate_size} does not split over a "
                         f"tensor axis of {tp} devices")
    if config.num_experts and config.num_experts % tp:
        raise ValueError(f"num_experts={config.num_experts} does not split over a tensor axis "
                         f"of {tp} devices (each device holds whole experts: it must be a "
                         f"multiple of {tp})")
    shared = config.shared_expert_intermediate_size
    if config.num_experts and shared is not None and shared % tp:
        raise ValueError(f"shared_expert_intermediate_size={shared} does not split over a "
                         f"tensor axis of {tp} devices")
    if kv_heads % tp == 0:
        return TensorLayout(groups=tp, kv_repeat=1)
    if tp % kv_heads == 0:
        return TensorLayout(groups=tp, kv_repeat=tp // kv_heads)
    raise ValueError(f"num_key_value_heads={kv_heads} neither splits over a tensor axis of {tp} "
                     f"devices nor divides it (KV heads are copied only a whole number of "
                     f"times per device)")


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A model config placed on a mesh: its weight layout and where each array lives."""

    config: LlamaConfig
    mesh: fj_sharding.MeshConfig
    layout: TensorLayout

    @property
    def vocab_split(self) -> bool:
        return self.mesh.tp > 1 and self.config.vocab_size % self.mesh.tp == 0

    def param_shardings(self, model: Llama) -> dict[int, NamedSharding]:
        """id(parameter) -> its sharding, for every parameter of ``model``."""
        m, tp = self.mesh, self.mesh.tp_name
        vocab = m.sharding(tp, None) if self.vocab_split else m.replicated()
        out = {id(model.embed_tokens): vocab, id(model.norm.weight): m.replicated()}

        def linear(lin, rows: bool):
            out[id(lin.kernel)] = m.sharding(tp, None) if rows else m.sharding(None, tp)
            if lin.bias is not None:
                out[id(lin.bias)] = m.sharding(tp) if rows else m.replicated()

        for layer in model.layers:
            for norm in layer.norms().values():
                out[id(norm.weight)] = m.replicated()
            linear(layer.self_attn.qkv_proj, rows=True)
            linear(layer.self_attn.o_proj, rows=False)
            if layer.self_attn.sinks is not None:  # one per query head: split with them
                out[id(layer.self_attn.sinks)] = m.sharding(tp)
            mlp = layer.mlp
            if isinstance(mlp, BiasedMoe | ScaledInputMoe):
                # gpt-oss's and Llama 4's experts as SparseMoe's: whole experts per device
                # (their biases with them), the router everywhere
                out[id(mlp.router)] = m.replicated()
                out[id(mlp.gate_up)] = out[id(mlp.down)] = m.sharding(tp, None, None)
                if isinstance(mlp, BiasedMoe):
                    out[id(mlp.router_bias)] = m.replicated()
                    out[id(mlp.gate_up_bias)] = out[id(mlp.down_bias)] = m.sharding(tp, None)
                    continue
                mlp = mlp.shared_expert
            if isinstance(mlp, SparseMoe):  # whole experts per device; the router everywhere
                out[id(mlp.router)] = m.replicated()
                for w in (mlp.w_gate, mlp.w_up, mlp.w_down):
                    out[id(w)] = m.sharding(tp, None, None)
                if mlp.shared_expert is None:
                    continue
                out[id(mlp.shared_expert_gate)] = m.replicated()
                mlp = mlp.shared_expert
            linear(mlp.gate_up_proj, rows=True)
            linear(mlp.down_proj, rows=False)
        if model.lm_head is not None:
            out[id(model.lm_head.kernel)] = vocab
        return out


def plan(config: LlamaConfig, mesh: Mesh | fj_sharding.MeshConfig, *, tp_axis: str = "tp",
         dp_axis: str = "dp") -> ShardingPlan:
    """The :class:`ShardingPlan` of ``config`` on ``mesh`` (axis roles as named)."""
    if isinstance(mesh, Mesh):
        mesh = fj_sharding.MeshConfig(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    elif not isinstance(mesh, fj_sharding.MeshConfig):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a forge_jax.sharding.MeshConfig, "
                        f"got {mesh!r:.80}")
    return ShardingPlan(config, mesh, layout_for(config, mesh.tp))


def shard(model: Llama, mesh: Mesh | fj_sharding.MeshConfig, *, tp_axis: str = "tp",
          dp_axis: str = "dp") -> Llama:
    """A copy of ``model`` sharded over ``mesh`` (``model`` itself is left as it is).

    The weights are re-laid out for the tensor axis (:func:`layout_for`) and each device
    receives only its shard. The result computes what ``model`` computes.
    """
    if model.mesh is not None or model.layout != TensorLayout():
        raise ValueError(f"model is already laid out for a mesh ({model.layout}); shard the "
                         f"single-device model")
    if any(isinstance(p.get_value(), fj_quant.QuantizedArray)
           for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)):
        raise ValueError("model has quantized weights, which shard() does not re-lay out: load "
                         "it with llama.from_pretrained(path, quantize=..., mesh=...)")
    p = plan(model.config, mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    hf = llama_hf.hf_state_dict(model)  # the weights in HF's layout, on the host
    sharded = nnx.eval_shape(lambda: Llama(model.config, rngs=nnx.Rngs(0), dtype=model.dtype,
                                           param_dtype=model.param_dtype, layout=p.layout))
    llama_hf.fill_parameters(sharded, lambda name, index: hf[name][index],
                             p.param_shardings(sharded))
    sharded.mesh = p.mesh
    sharded.generation_config = model.generation_config
    return sharded


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of the arrays in ``tree`` (for tests and the CLI)."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for s in leaf.addressable_shards:
                out[s.device] = out.get(s.device, 0) + int(np.prod(s.data.shape)) * \
                    leaf.dtype.itemsize
    return out
