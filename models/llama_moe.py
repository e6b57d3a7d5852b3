"""The mixture-of-experts MLP of the decoder (Mixtral, Qwen2-MoE, Qwen3-MoE), built on
``fj.moe``: a router, experts as stacked weights multiplied with ``fj.grouped_matmul``,
and, where a family has one, a shared expert every token goes through.

:class:`~forge_jax.models.llama_model.LlamaDecoderLayer` puts one in place of the dense
MLP in the layers :meth:`~forge_jax.models.llama_config.LlamaConfig.is_moe` names; which
layers those are is decided when the model is built, so one compiled step serves the
dense and the sparse layers alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import forge_jax as fj
from forge_jax.models.llama_config import LlamaConfig


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


class SparseMoe(nnx.Module):
    """``out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t])`` (+ the shared expert).

    Weights (``E`` experts, hidden ``d``, expert width ``f``):

    * ``router`` ``[E, d]``: HF's ``gate.weight`` (the router's logits are ``x @ router.T``
      in the compute dtype, as transformers computes them);
    * ``w_gate``, ``w_up`` ``[E, d, f]`` and ``w_down`` ``[E, f, d]``: each expert's
      ``gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral's ``w1`` / ``w3`` / ``w2``),
      stacked and transposed from HF's ``[out, in]`` when the checkpoint loads, the layout
      ``fj.grouped_matmul`` multiplies; quantized at load (``from_pretrained(quantize=)``)
      they are :class:`forge_jax.QuantizedArray` s in HF's ``[E, out, in]`` layout with
      scales per expert (``fj.moe``'s ``trans_w``), dequantized one expert at a time
      inside the grouped products;
    * ``shared_expert`` (a dense MLP module, or None) and ``shared_expert_gate`` ``[1, d]``:
      Qwen2-MoE's shared expert, scaled by ``sigmoid(x @ shared_expert_gate.T)``.

    Routing is ``fj.moe_route``'s ``"softmax_topk"`` (a softmax over all experts, then the
    ``top_k`` largest), renormalised when ``config.norm_topk_prob``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, shared_expert: nnx.Module | None = None):
        c = config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.dtype = jnp.dtype(dtype)
        self.top_k = c.num_experts_per_tok
        self.renormalize = c.norm_topk_prob
        self.router = nnx.Param(_init(rngs, (e, d), param_dtype))
        self.w_gate = nnx.Param(_init(rngs, (e, d, f), param_dtype))
        self.w_up = nnx.Param(_init(rngs, (e, d, f), param_dtype))
        self.w_down = nnx.Param(_init(rngs, (e, f, d), param_dtype))
        self.shared_expert = shared_expert
        self.shared_expert_gate = (None if shared_expert is None
                                   else nnx.Param(_init(rngs, (1, d), param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` [..., hidden_size] -> [..., hidden_size] in the compute dtype."""
        with jax.named_scope("moe_mlp"):
            lead, d = x.shape[:-1], x.shape[-1]
            x2 = x.reshape(-1, d).astype(self.dtype)  # [tokens, d]
            logits = fj.matmul(x2, self.router[...].astype(self.dtype), trans_b=True)
            experts = [w.get_value() for w in (self.w_gate, self.w_up, self.w_down)]
            quantized = isinstance(experts[0], fj.QuantizedArray)
            if not quantized:
                experts = [w.astype(self.dtype) for w in experts]
            out = fj.moe(x2, logits, *experts, self.top_k, routing="softmax_topk",
                         renormalize=self.renormalize, trans_w=quantized)
            if self.shared_expert is not None:
                gate = fj.matmul(x2, self.shared_expert_gate[...].astype(self.dtype),
                                 trans_b=True, out_dtype=jnp.float32)  # [tokens, 1]
                shared = self.shared_expert(x2).astype(jnp.float32)
                out = out + (jax.nn.sigmoid(gate) * shared).astype(self.dtype)
            return out.reshape(*lead, d)
