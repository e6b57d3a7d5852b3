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


class BiasedMoe(nnx.Module):
    """gpt-oss's mixture of experts: ``out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t])``.

    Weights (``E`` experts, hidden ``d``, expert width ``f``), in Hugging Face's layout:

    * ``router`` ``[E, d]`` and ``router_bias`` ``[E]``: the router's logits are
      ``x @ router.T + router_bias``; each token goes to the ``top_k`` largest, weighted by
      a softmax over those ``top_k`` logits (``fj.moe_route``'s ``"topk_softmax"``);
    * ``gate_up`` ``[E, d, 2f]`` and ``gate_up_bias`` ``[E, 2f]``: gate and up fused,
      *interleaved* (column ``2i`` is gate ``i``, ``2i + 1`` up ``i``);
    * ``down`` ``[E, f, d]`` and ``down_bias`` ``[E, d]``.

    Each expert computes ``h = x @ gate_up + gate_up_bias``, ``g = min(h[::2], limit)``,
    ``u = clip(h[1::2], -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g) @ down +
    down_bias``, with the tokens sorted by expert and ``fj.grouped_matmul`` products (each
    sorted row's bias gathered by its expert).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        c = config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.dtype = jnp.dtype(dtype)
        self.top_k = c.num_experts_per_tok
        self.alpha, self.limit = float(c.swiglu_alpha), float(c.swiglu_limit)
        self.router = nnx.Param(_init(rngs, (e, d), param_dtype))
        self.router_bias = nnx.Param(jnp.zeros((e,), param_dtype))
        self.gate_up = nnx.Param(_init(rngs, (e, d, 2 * f), param_dtype))
        self.gate_up_bias = nnx.Param(jnp.zeros((e, 2 * f), param_dtype))
        self.down = nnx.Param(_init(rngs, (e, f, d), param_dtype))
        self.down_bias = nnx.Param(jnp.zeros((e, d), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` [..., hidden_size] -> [..., hidden_size] in the compute dtype."""
        with jax.named_scope("moe_mlp"):
            lead, d = x.shape[:-1], x.shape[-1]
            x2 = x.reshape(-1, d).astype(self.dtype)  # [tokens, d]
            experts = self.router.shape[0]
            logits = fj.matmul(x2, self.router[...].astype(self.dtype), trans_b=True, beta=1.0,
                               c=self.router_bias[...].astype(self.dtype))
            weights, ids = fj.moe_route(logits, self.top_k, routing="topk_softmax")
            xs, sizes, order = fj.moe_permute(x2, ids, experts)  # [tokens * k, d]
            # each sorted row's expert (rows past sum(sizes): none; clipped, then unused)
            expert = jnp.minimum(ids.reshape(-1)[order], experts - 1)
            w_gu, w_down = self.gate_up.get_value(), self.down.get_value()
            quantized = isinstance(w_gu, fj.QuantizedArray)
            if not quantized:
                w_gu, w_down = w_gu.astype(self.dtype), w_down.astype(self.dtype)
            h = fj.grouped_matmul(xs, w_gu, sizes, trans_w=quantized).astype(jnp.float32)
            h = h + self.gate_up_bias[...].astype(jnp.float32)[expert]  # [tokens * k, 2f]
            gate = jnp.minimum(h[:, ::2], self.limit)
            up = jnp.clip(h[:, 1::2], -self.limit, self.limit)
            act = ((up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)).astype(self.dtype)
            y = fj.grouped_matmul(act, w_down, sizes, trans_w=quantized).astype(jnp.float32)
            y = y + self.down_bias[...].astype(jnp.float32)[expert]  # [tokens * k, d]
            out = fj.moe_unpermute(y, order, weights)
            return out.astype(self.dtype).reshape(*lead, d)


class ScaledInputMoe(nnx.Module):
    """Llama 4's mixture of experts: ``out[t] = shared(x[t]) + sum_j expert_{e[t, j]}(
    sigmoid(l[t, j]) * x[t])``, ``l[t, j]`` the ``top_k`` largest router logits ``x @
    router.T`` (the router's weight scales each expert's *input*).

    Weights in Hugging Face's layout: ``router`` ``[E, d]``, ``gate_up`` ``[E, d, 2f]``
    (gate the first ``f`` columns, up the rest), ``down`` ``[E, f, d]``; the
    ``shared_expert`` a dense SwiGLU MLP module (ungated).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, shared_expert: nnx.Module):
        c = config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.dtype = jnp.dtype(dtype)
        self.top_k = c.num_experts_per_tok
        self.router = nnx.Param(_init(rngs, (e, d), param_dtype))
        self.gate_up = nnx.Param(_init(rngs, (e, d, 2 * f), param_dtype))
        self.down = nnx.Param(_init(rngs, (e, f, d), param_dtype))
        self.shared_expert = shared_expert

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` [..., hidden_size] -> [..., hidden_size] in the compute dtype."""
        with jax.named_scope("moe_mlp"):
            lead, d = x.shape[:-1], x.shape[-1]
            x2 = x.reshape(-1, d).astype(self.dtype)  # [tokens, d]
            experts = self.router.shape[0]
            logits = fj.matmul(x2, self.router[...].astype(self.dtype), trans_b=True)
            top, ids = jax.lax.top_k(logits.astype(jnp.float32), self.top_k)  # [tokens, k]
            xs, sizes, order = fj.moe_permute(x2, ids.astype(jnp.int32), experts)
            gate_of_row = jax.nn.sigmoid(top).reshape(-1)[order]  # each sorted row's weight
            xs = (xs.astype(jnp.float32) * gate_of_row[:, None]).astype(self.dtype)
            w_gu, w_down = self.gate_up.get_value(), self.down.get_value()
            quantized = isinstance(w_gu, fj.QuantizedArray)
            if not quantized:
                w_gu, w_down = w_gu.astype(self.dtype), w_down.astype(self.dtype)
            h = fj.grouped_matmul(xs, w_gu, sizes, trans_w=quantized)  # [tokens * k, 2f]
            f = h.shape[-1] // 2
            act = fj.silu_mul(h[:, :f], h[:, f:])
            y = fj.grouped_matmul(act, w_down, sizes, trans_w=quantized)
            out = fj.moe_unpermute(y, order, jnp.ones(ids.shape, jnp.float32))
            out = out.astype(jnp.float32) + self.shared_expert(x2).astype(jnp.float32)
            return out.astype(self.dtype).reshape(*lead, d)


class GeluExpertsMoe(nnx.Module):
    """Gemma 4's mixture of experts, beside its dense MLP: ``out[t] = sum_j w[t, j] *
    expert_{e[t, j]}(x[t])``, routed from another input ``r[t]`` (the layer's residual
    stream): logits ``(rms(r) * scale * d ** -0.5) @ router.T``, a softmax, the
    ``top_k`` largest renormalised to sum 1, each times ``per_expert_scale[e]``.

    Weights: ``router`` ``[E, d]`` (HF's ``router.proj.weight``), ``scale`` ``[d]``,
    ``per_expert_scale`` ``[E]``; ``gate_up`` ``[E, d, 2f]`` (gate the first ``f``
    columns) and ``down`` ``[E, f, d]``, transposed from HF's ``[E, out, in]`` at load;
    each expert ``gelu_tanh(x @ gate) * (x @ up) @ down``.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        c = config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.dtype = jnp.dtype(dtype)
        self.top_k = c.top_k_experts
        self.router = nnx.Param(_init(rngs, (e, d), param_dtype))
        self.scale = nnx.Param(jnp.ones((d,), param_dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((e,), param_dtype))
        self.gate_up = nnx.Param(_init(rngs, (e, d, 2 * f), param_dtype))
        self.down = nnx.Param(_init(rngs, (e, f, d), param_dtype))

    def __call__(self, x: jax.Array, route: jax.Array, *, eps: float) -> jax.Array:
        """``x`` (the experts' input) and ``route`` (the router's) [..., d] -> [..., d]."""
        with jax.named_scope("moe_mlp"):
            lead, d = x.shape[:-1], x.shape[-1]
            x2 = x.reshape(-1, d).astype(self.dtype)
            r = fj.rms_norm(route.reshape(-1, d), jnp.ones((d,), jnp.float32), eps=eps)
            r = r * self.scale[...].astype(r.dtype) * jnp.asarray(d ** -0.5, r.dtype)
            logits = fj.matmul(r.astype(self.dtype), self.router[...].astype(self.dtype),
                               trans_b=True, out_dtype=jnp.float32)
            experts = self.router.shape[0]
            weights, ids = fj.moe_route(logits, self.top_k, routing="softmax_topk",
                                        renormalize=True)
            weights = weights * self.per_expert_scale[...].astype(jnp.float32)[ids]
            xs, sizes, order = fj.moe_permute(x2, ids.astype(jnp.int32), experts)
            w_gu, w_down = self.gate_up.get_value(), self.down.get_value()
            quantized = isinstance(w_gu, fj.QuantizedArray)
            if not quantized:
                w_gu, w_down = w_gu.astype(self.dtype), w_down.astype(self.dtype)
            h = fj.grouped_matmul(xs, w_gu, sizes, trans_w=quantized)  # [tokens * k, 2f]
            f = h.shape[-1] // 2
            y = fj.grouped_matmul(fj.gelu_tanh_mul(h[:, :f], h[:, f:]), w_down, sizes,
                                  trans_w=quantized)
            out = fj.moe_unpermute(y, order, weights)
            return out.astype(self.dtype).reshape(*lead, d)
