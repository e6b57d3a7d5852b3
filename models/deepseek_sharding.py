"""DeepSeek-V3 on a device mesh: which weight splits along which axis.

Tensor parallelism over the tensor axis ``tp`` of size ``T``, Megatron-style as for the
Llama family (:mod:`forge_jax.models.llama_sharding`):

* Attention by head: ``q_proj`` / ``q_b_proj`` split their output rows (whole heads per
  device: each head's ``nope + rope`` rows are contiguous), the heads' latent
  up-projections ``w_uk`` and ``w_uv`` their head axis, and ``o_proj`` its input columns (one
  all-reduce after it). The query bottleneck ``q_a_proj``, ``kv_a_proj_with_mqa`` and their
  norms are replicated: the latent is shared by every head, so every device computes it and
  holds the whole latent cache (the pool, like a K/V cache with fewer KV heads than devices,
  is replicated; :func:`forge_jax.mla_paged_attention` splits the heads).
* The dense layers' and the shared experts' SwiGLU MLPs split their intermediate dimension
  (gate and up by rows, down by columns); the routed experts split by expert (expert
  parallelism: :func:`forge_jax.grouped_matmul`'s partition rule sums the partial products);
  the router and its correction bias are replicated.
* The embedding and the output head split over the vocabulary when it divides by ``T``.

``num_attention_heads``, ``n_routed_experts`` and the MLPs' widths must divide by ``T``
(refused with the numbers otherwise). Data parallelism over ``dp`` replicates the weights; a
contiguous latent cache splits its rows over it. Quantized weights (``quantize=``, an fp8
checkpoint) are split with their scales (:func:`forge_jax.quant.place`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

import forge_jax as fj
from forge_jax import sharding as fj_sharding
from forge_jax.models.deepseek_config import DeepseekV3Config


def mesh_config(mesh: Mesh | fj_sharding.MeshConfig, *, tp_axis: str = "tp",
                dp_axis: str = "dp") -> fj_sharding.MeshConfig:
    if isinstance(mesh, Mesh):
        return fj_sharding.MeshConfig(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
    if not isinstance(mesh, fj_sharding.MeshConfig):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a forge_jax.sharding.MeshConfig, "
                        f"got {mesh!r:.80}")
    return mesh


def check(config: DeepseekV3Config, mesh: fj_sharding.MeshConfig) -> None:
    """ValueError naming the sizes that do not split over the tensor axis."""
    t = mesh.tp
    sizes = dict(num_attention_heads=config.num_attention_heads,
                 n_routed_experts=config.n_routed_experts,
                 moe_intermediate_size=config.moe_intermediate_size)
    if config.first_k_dense_replace:
        sizes["intermediate_size"] = config.intermediate_size
    bad = {k: v for k, v in sizes.items() if v % t}
    if bad:
        raise ValueError(f"DeepSeek-V3 splits over a tensor axis of {t} devices only if these "
                         f"divide by {t}: {bad}")


def weight_shardings(config: DeepseekV3Config, weights: dict[str, Any],
                     mesh: fj_sharding.MeshConfig) -> dict[str, Any]:
    """A ``NamedSharding`` per weight of :func:`forge_jax.models.deepseek.load`'s pytree (a
    quantized weight's is its logical array's)."""
    check(config, mesh)
    t = mesh.tp_name
    rows, cols, none = mesh.sharding(t, None), mesh.sharding(None, t), mesh.replicated()
    vocab = mesh.sharding(t if config.vocab_size % mesh.tp == 0 else None, None)
    mlp = dict(gate_proj=rows, up_proj=rows, down_proj=cols)
    heads = mesh.sharding(None, t, None)
    layers = []
    for layer in weights["layers"]:
        attn = {k: none for k in layer["attn"]}
        attn.update(w_uk=heads, w_uv=heads, o_proj=cols)
        attn["q_proj" if "q_proj" in attn else "q_b_proj"] = rows
        out = dict(attn=attn, input_norm=none, post_norm=none)
        if "mlp" in layer:
            out["mlp"] = dict(mlp)
        else:
            experts = mesh.sharding(t, None, None)
            out["moe"] = dict(router=none, bias=none, gate_proj=experts, up_proj=experts,
                              down_proj=experts, shared=dict(mlp))
        layers.append(out)
    return dict(embed=vocab, layers=layers, norm=none, lm_head=vocab)


def place(weights: dict[str, Any], shardings: dict[str, Any]) -> dict[str, Any]:
    """``weights`` put on the mesh as ``shardings`` says (quantized ones with their scales)."""
    is_q = lambda x: isinstance(x, fj.QuantizedArray)  # noqa: E731

    def put(w, s):
        return fj.quant.place(w, s) if is_q(w) else fj_sharding.put(w, s)

    return jax.tree.map(put, weights, shardings, is_leaf=is_q)
