"""Qwen3-Next and Qwen3.5 text on a device mesh: which weight and which cache buffer splits
along which axis.

Tensor parallelism over the tensor axis ``tp`` of size ``T`` (Megatron-style, as the Llama
family's, :mod:`forge_jax.models.llama_sharding`):

* **Gated full attention** by head: the fused ``qkv_proj`` (each head's query and output-gate
  rows, then k and v) splits its output rows, stored group by group so that each device holds
  whole heads; ``o_proj`` its input columns (one all-reduce after it); the per-head q and k
  norms are replicated. ``num_attention_heads`` must divide by ``T``; KV heads split when
  they divide by ``T``, are stored ``T / num_key_value_heads`` times when ``T`` is a multiple
  of them (Qwen3-Next's 2 KV heads on 4 or 8 devices), and other counts are refused.
* **Gated delta-rule layers** by key head, when ``linear_num_key_heads`` divides by ``T``:
  ``in_proj_qkv``'s ``[q | k | v]`` rows (stored group by group), ``in_proj_z``'s rows and
  the per-value-head ``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias`` split with
  their value heads, which stay on their key head's device; the convolution's weight
  splits its channels as ``in_proj_qkv``'s rows; ``out_proj`` its input columns; the gated
  norm's weight (one per value dim) is replicated. :func:`forge_jax.causal_conv1d` and
  :func:`forge_jax.gated_delta_rule` then run per shard with no communication. When the key
  heads do not divide by ``T``, these layers are replicated: a device cannot hold part of
  a key head's state, and their value heads read their key head's q and k
  (:data:`LINEAR_REPLICATED`).
* **MLPs** split their intermediate dimension (gate and up by rows, down by columns;
  ``intermediate_size`` must divide by ``T`` where a layer has the dense MLP); the mixture of
  experts splits by expert (``num_experts`` must divide by ``T``), its router and shared
  expert gate replicated and its shared expert split as a dense MLP (its width must divide
  by ``T``), as the Llama family's Qwen2-MoE.
* The embedding and the output head split over the vocabulary when it divides by ``T``.

Data parallelism over ``dp`` replicates the weights; the batch, a contiguous K/V cache's
rows and the state pool's slots (``generate``'s rows, or the serving engine's sequences)
split across it (when they divide). The caches
(:func:`cache_shardings`): the attention layers' K/V by KV head over ``tp`` as the Llama
family's; the state pool's delta-rule states by value head and its conv states by channel,
over ``tp`` where the delta-rule layers split.

Quantized kernels (``from_pretrained(quantize=..., mesh=...)``) are split with their scales
(:func:`forge_jax.quant.place`); quantized experts split by expert with their scales, as the
Llama family's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh, NamedSharding

from forge_jax import sharding as fj_sharding
from forge_jax.kv_cache import HybridCache, RecurrentStatePool
from forge_jax.models import llama_caches
from forge_jax.models.llama_model import TensorLayout
from forge_jax.models.llama_moe import SparseMoe
from forge_jax.models.qwen3_next_config import Qwen3NextConfig

__all__ = ["LINEAR_REPLICATED", "Qwen3NextLayout", "Qwen3NextShardingPlan", "cache_shardings",
           "plan"]

LINEAR_REPLICATED = (
    "linear_num_key_heads does not divide by the tensor axis: a key head's delta-rule state "
    "cannot be split, and its value heads read its q and k, so the gated delta-rule layers "
    "are replicated on every device")


@dataclasses.dataclass(frozen=True)
class Qwen3NextLayout:
    """How the weights are laid out for tensor parallelism
    (:func:`plan` gives it for a mesh; :class:`~forge_jax.models.qwen3_next.Qwen3Next`
    takes it).

    Attributes:
      attention: the gated full-attention layers' and the MLPs' layout (fused rows stored
        group by group, KV heads copied ``kv_repeat`` times), as the Llama family's.
      linear_groups: the groups the delta-rule layers' ``[q | k | v]`` rows and
        convolution channels are stored in (1: not split, the layers replicated).
    """

    attention: TensorLayout = TensorLayout()
    linear_groups: int = 1


@dataclasses.dataclass(frozen=True)
class Qwen3NextShardingPlan:
    """A config placed on a mesh: its weight layout and where each array lives.

    Attributes:
      config, mesh: the model's config and the mesh.
      layout: the weights' :class:`~forge_jax.models.qwen3_next.Qwen3NextLayout`.
      linear_replicated: None when the delta-rule layers split over the tensor axis, else
        why they are replicated (:data:`LINEAR_REPLICATED`).
    """

    config: Qwen3NextConfig
    mesh: fj_sharding.MeshConfig
    layout: Qwen3NextLayout

    @property
    def linear_replicated(self) -> str | None:
        if self.mesh.tp == 1 or self.layout.linear_groups > 1:
            return None
        return f"linear_num_key_heads={self.config.linear.k_heads}, tp={self.mesh.tp}: " \
               f"{LINEAR_REPLICATED}"

    def param_shardings(self, model: Any) -> dict[int, NamedSharding]:
        """id(parameter) -> its sharding, for every parameter of ``model`` (a
        :class:`~forge_jax.models.qwen3_next.Qwen3Next` built with :attr:`layout`)."""
        m, tp = self.mesh, self.mesh.tp_name
        rows, cols, none = m.sharding(tp, None), m.sharding(None, tp), m.replicated()
        vocab = rows if self.config.vocab_size % m.tp == 0 else none
        out = {id(model.embed_tokens): vocab, id(model.norm.weight): none}
        if model.lm_head is not None:
            out[id(model.lm_head.kernel)] = vocab

        def mlp(module):
            out[id(module.gate_up_proj.kernel)] = rows
            out[id(module.down_proj.kernel)] = cols

        linear_tp = tp if self.layout.linear_groups > 1 else None
        by_head, by_channel = m.sharding(linear_tp), m.sharding(None, linear_tp)
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                out[id(norm.weight)] = none
            if layer.linear_attn is not None:
                gdn, split = layer.linear_attn, m.sharding(linear_tp, None)
                for lin in (gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a):
                    out[id(lin.kernel)] = split
                out[id(gdn.out_proj.kernel)] = by_channel
                out[id(gdn.conv_weight)] = by_channel
                out.update({id(gdn.A_log): by_head, id(gdn.dt_bias): by_head,
                            id(gdn.norm_weight): none})
            else:
                attn = layer.self_attn
                out.update({id(attn.qkv_proj.kernel): rows, id(attn.o_proj.kernel): cols,
                            id(attn.q_norm.weight): none, id(attn.k_norm.weight): none})
            if isinstance(layer.mlp, SparseMoe):  # whole experts per device
                moe, experts = layer.mlp, m.sharding(tp, None, None)
                out.update({id(moe.router): none, id(moe.shared_expert_gate): none,
                            id(moe.w_gate): experts, id(moe.w_up): experts,
                            id(moe.w_down): experts})
                mlp(moe.shared_expert)
            else:
                mlp(layer.mlp)
        return out

    def cache_shardings(self, cache: HybridCache) -> Any:
        """:func:`cache_shardings` for this plan's delta-rule layout."""
        return cache_shardings(cache, self.mesh, linear_split=self.layout.linear_groups > 1)


def plan(config: Qwen3NextConfig, mesh: Mesh | fj_sharding.MeshConfig, *,
         tp_axis: str = "tp", dp_axis: str = "dp") -> Qwen3NextShardingPlan:
    """The :class:`Qwen3NextShardingPlan` of ``config`` on ``mesh`` (axis roles as named).

    Raises:
      ValueError: sizes that do not split over the tensor axis (the module docstring's
        rules), naming them.
    """
    if isinstance(mesh, Mesh):
        mesh = fj_sharding.MeshConfig(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    elif not isinstance(mesh, fj_sharding.MeshConfig):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a forge_jax.sharding.MeshConfig, "
                        f"got {mesh!r:.80}")
    c, t = config, mesh.tp
    layers = range(c.num_hidden_layers)
    sizes = {}
    if "attention" in c.kinds:
        sizes["num_attention_heads"] = c.num_attention_heads
    if any(not c.is_moe(i) for i in layers):
        sizes["intermediate_size"] = c.intermediate_size
    if any(c.is_moe(i) for i in layers):
        sizes.update(num_experts=c.num_experts,
                     shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    bad = {k: v for k, v in sizes.items() if v % t}
    if bad:
        raise ValueError(f"{c.model_type} splits over a tensor axis of {t} devices only if "
                         f"these divide by {t}: {bad}")
    kv = c.num_key_value_heads
    if kv % t == 0:
        attention = TensorLayout(groups=t)
    elif "attention" not in c.kinds or t % kv == 0:
        attention = TensorLayout(groups=t, kv_repeat=max(t // kv, 1))
    else:
        raise ValueError(f"num_key_value_heads={kv} neither splits over a tensor axis of {t} "
                         f"devices nor divides it (KV heads are copied only a whole number of "
                         f"times per device)")
    linear_groups = t if c.linear.k_heads % t == 0 else 1
    return Qwen3NextShardingPlan(c, mesh, Qwen3NextLayout(attention, linear_groups))


def cache_shardings(cache: HybridCache, mesh: fj_sharding.MeshConfig, *,
                    linear_split: bool) -> Any:
    """The sharding of every buffer of a :class:`~forge_jax.kv_cache.HybridCache` (the same
    pytree, ``NamedSharding`` leaves): the attention layers' K/V cache as
    :func:`forge_jax.models.llama_caches.cache_shardings` splits it; the state pool's slots
    over the data axis (when they divide), its delta-rule states by value head and its
    conv states by channel over the tensor axis when ``linear_split`` (the delta-rule
    layers split, :attr:`Qwen3NextShardingPlan.linear_replicated`); slot maps and lengths
    replicated."""
    pool = cache.linear
    if not isinstance(pool, RecurrentStatePool):
        raise TypeError(f"not a recurrent-state pool: {type(pool).__name__}")
    tp = mesh.tp_name if linear_split else None
    slots = mesh.batch_axis(pool.num_slots)
    conv, state = mesh.sharding(slots, None, tp), mesh.sharding(slots, tp, None, None)
    linear = dataclasses.replace(
        pool, conv=tuple(conv for _ in pool.conv), state=tuple(state for _ in pool.state),
        slots=mesh.replicated(), lengths=mesh.replicated())
    return dataclasses.replace(cache, attention=llama_caches.cache_shardings(cache.attention,
                                                                             mesh),
                               linear=linear)
