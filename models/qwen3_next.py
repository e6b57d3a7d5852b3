"""Qwen3-Next (``model_type: qwen3_next``) and Qwen3.5 text (``qwen3_5_text``): decoders
whose layers alternate gated delta-rule linear attention with gated full attention, in Flax
NNX, built from forge_jax's public ops.

Per layer (:class:`Qwen3NextDecoderLayer`), as transformers' ``Qwen3NextForCausalLM`` and
``Qwen3_5ForCausalLM`` compute it:

* **Token mixing.** A ``"linear_attention"`` layer is a Gated DeltaNet
  (:class:`~forge_jax.models.gated_deltanet.GatedDeltaNet`: short causal convolution, the
  gated delta rule, a gated RMSNorm), whose per-sequence state lives in a
  :class:`~forge_jax.kv_cache.RecurrentStatePool`. A ``"full_attention"`` layer is
  :class:`GatedAttention`: ``q_proj`` gives each head's query and an output gate (twice the
  width), q and k are RMS-normed per head, RoPE rotates the first ``rotary_dim`` dims
  (``partial_rotary_factor``, 1/4), and the attention's output is multiplied by
  ``sigmoid(gate)`` before ``o_proj``; its keys and values live in a KV cache (contiguous or
  paged).
* **Feed-forward.** Qwen3.5: a SwiGLU MLP. Qwen3-Next: a mixture of experts (softmax top-k,
  renormalised) with a shared expert scaled by ``sigmoid(x @ shared_expert_gate)``
  (:class:`~forge_jax.models.llama_moe.SparseMoe`), or the SwiGLU MLP in ``mlp_only_layers``.
* Every RMSNorm except the delta rule's gated one scales by ``1 + weight`` (float32).

The cache of a step is a :class:`~forge_jax.kv_cache.HybridCache`: the attention layers'
:class:`~forge_jax.kv_cache.KVCache` and the linear layers' state pool, addressed by the
model's layer index. :meth:`Qwen3Next.forward_cached` has the signature and the contract of
:meth:`forge_jax.models.llama_model.Llama.forward_cached`. Checkpoints load with
:func:`forge_jax.models.qwen3_next_checkpoint.from_pretrained`, on one device or on a mesh
(:class:`~forge_jax.models.qwen3_next_sharding.Qwen3NextLayout`,
:mod:`forge_jax.models.qwen3_next_sharding`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import HybridCache, RecurrentStatePool
from forge_jax.models.gated_deltanet import GatedDeltaNet
from forge_jax.models.llama_model import Linear, LlamaMLP, Part, RMSNorm, TensorLayout
from forge_jax.models.llama_moe import SparseMoe
from forge_jax.models.output_head import check_tokens, output_logits
from forge_jax.models.qwen3_next_caches import Qwen3NextCaches
from forge_jax.models.qwen3_next_config import Qwen3NextConfig
from forge_jax.models.qwen3_next_sharding import Qwen3NextLayout

# Every RMSNorm of these families but the delta rule's scales by 1 + weight.
_OFFSET = 1.0
_ONE_DEVICE = TensorLayout()
_ONE_DEVICE_LAYOUT = Qwen3NextLayout()


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


def _rope(x, positions, config: Qwen3NextConfig):
    """RoPE on the first ``rotary_dim`` dims of each head of ``x`` ``[b, t, heads, head_dim]``
    (the rotate-half form), the rest passed through."""
    r = config.rotary_dim
    rotated = fj.rope(x[..., :r], positions, theta=config.rope_theta)
    return jnp.concatenate([rotated, x[..., r:]], axis=-1) if r < x.shape[-1] else rotated


class GatedAttention(nnx.Module):
    """Full attention with an output gate: ``o_proj(attention(q, k, v) * sigmoid(gate))``.

    ``qkv_proj`` fuses HF's ``q_proj`` (``[heads * 2 * head_dim, hidden]``: per head its
    query rows, then its gate rows), ``k_proj`` and ``v_proj`` into one product."""

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs, dtype, param_dtype,
                 layout: TensorLayout = _ONE_DEVICE):
        c = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        r = layout.kv_repeat  # each KV head stored r times (a tensor axis wider than them)
        kv_part = functools.partial(Part, rows=kv, unit=c.head_dim, repeat=r)
        self.qkv_proj = Linear(c.hidden_size, 2 * q + 2 * kv * r, parts=(
            Part("q_proj", 2 * q), kv_part("k_proj"), kv_part("v_proj")),
            groups=layout.groups, **kw)
        self.o_proj = Linear(q, c.hidden_size, **kw)
        self.q_norm = RMSNorm(c.head_dim, param_dtype=param_dtype)
        self.k_norm = RMSNorm(c.head_dim, param_dtype=param_dtype)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable, cache: Any, *,
                 config: Qwen3NextConfig) -> tuple[jax.Array, Any]:
        """``x`` ``[batch, t, hidden]`` at int ``positions [batch, t]`` -> ``(out [batch, t,
        hidden], cache)``; ``attend(q, k, v, cache) -> (o, cache)`` as in
        :class:`~forge_jax.models.llama_model.LlamaAttention`."""
        c = config
        batch, t, _ = x.shape
        heads, hd = c.num_attention_heads, c.head_dim
        with jax.named_scope("gated_attention"):
            qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
            qg = qg.reshape(batch, t, heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]  # [b, t, heads, hd] each
            k = k.reshape(batch, t, -1, hd)  # the layout's KV heads (copies included)
            v = v.reshape(batch, t, -1, hd)
            q = _rope(self.q_norm(q, eps=c.rms_norm_eps, offset=_OFFSET), positions, c)
            k = _rope(self.k_norm(k, eps=c.rms_norm_eps, offset=_OFFSET), positions, c)
            o, cache = attend(q, k, v, cache)  # [b, t, heads, hd]
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(
                self.dtype)
            return self.o_proj(o.reshape(batch, t, heads * hd)), cache


class Qwen3NextDecoderLayer(nnx.Module):
    """One layer: ``linear_attn`` (a Gated DeltaNet) or ``self_attn`` (:class:`GatedAttention`),
    then the MLP (a :class:`~forge_jax.models.llama_moe.SparseMoe` with its shared expert, or
    a :class:`~forge_jax.models.llama_model.LlamaMLP`), each after an RMSNorm, each added to
    the residual stream."""

    def __init__(self, config: Qwen3NextConfig, layer: int, *, rngs: nnx.Rngs, dtype,
                 param_dtype, layout: Qwen3NextLayout = _ONE_DEVICE_LAYOUT):
        c = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        tp = dict(kw, layout=layout.attention)
        self.linear_attn = GatedDeltaNet(c.linear, groups=layout.linear_groups, **kw) if (
            c.is_linear(layer)) else None
        self.self_attn = None if c.is_linear(layer) else GatedAttention(c, **tp)
        if c.is_moe(layer):
            shared = LlamaMLP(c, intermediate_size=c.shared_expert_intermediate_size, **tp)
            self.mlp = SparseMoe(c, shared_expert=shared, **kw)
        else:
            self.mlp = LlamaMLP(c, **tp)
        self.input_layernorm = RMSNorm(c.hidden_size, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, param_dtype=param_dtype)

    def __call__(self, x, residual, positions, attend: Callable, cache: Any, *,
                 config: Qwen3NextConfig, layer: int, lengths: jax.Array | None):
        """``(mlp_out, residual, cache)`` as
        :class:`~forge_jax.models.llama_model.LlamaDecoderLayer` returns them; ``lengths``
        (int ``[batch]`` or None) the real tokens of each row, for the delta-rule layer."""
        kw = dict(eps=config.rms_norm_eps, offset=_OFFSET)
        if residual is None:
            y, residual = self.input_layernorm(x, **kw), x
        else:
            y, residual = self.input_layernorm(x, residual, **kw)
        if self.linear_attn is not None:
            x, cache = self.linear_attn(y, cache=cache, layer=layer, lengths=lengths)
        else:
            x, cache = self.self_attn(y, positions, attend, cache, config=config)
        y, residual = self.post_attention_layernorm(x, residual, **kw)
        return self.mlp(y), residual, cache


class Qwen3Next(Qwen3NextCaches, nnx.Module):
    """A Qwen3-Next or Qwen3.5 text decoder with its output head.

    Args:
      config: the :class:`~forge_jax.models.qwen3_next_config.Qwen3NextConfig`.
      rngs: ``nnx.Rngs`` for the random initialisation.
      dtype: the compute dtype of activations (weights are cast to it at use; the delta
        rule's state is float32 whatever it is).
      param_dtype: the storage dtype of the weights.
      layout: the weights' layout for a tensor axis
        (:class:`~forge_jax.models.qwen3_next_sharding.Qwen3NextLayout`; the default: one
        device).

    Attributes set after construction: ``mesh`` (None: one device) and
    ``generation_config`` (``from_pretrained``'s, or None).

    It keeps the runtime's model contract (``forward_cached`` and the cache members of
    :class:`~forge_jax.models.qwen3_next_caches.Qwen3NextCaches`), so
    :func:`forge_jax.generation.generate` runs it with either attention cache.
    """

    # The runtime's speculative decoding rolls a cache back past rejected drafts; the
    # delta-rule states have absorbed them.
    speculation_refused = ("the gated delta-rule layers' recurrent states cannot be rolled "
                           "back past rejected draft tokens")

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, layout: Qwen3NextLayout = _ONE_DEVICE_LAYOUT):
        self.config = config
        self.layout = layout
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.mesh = None
        self.generation_config = None
        c = config
        self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), param_dtype))
        self.layers = nnx.List([
            Qwen3NextDecoderLayer(c, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  layout=layout) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs, dtype=dtype,
            param_dtype=param_dtype)

    @property
    def kv_heads(self) -> int:
        """KV heads in the attention layers' cache (copies included, on a mesh wider than
        the KV heads)."""
        return self.config.num_key_value_heads * self.layout.attention.kv_repeat

    @property
    def num_attention_layers(self) -> int:
        """The full-attention layers: the layers the KV cache of :meth:`hybrid_cache` holds."""
        return self.config.kinds.count("attention")

    def hybrid_cache(self, attention: Any, *, num_slots: int | None = None,
                     state_dtype=jnp.float32) -> HybridCache:
        """A :class:`~forge_jax.kv_cache.HybridCache` of ``attention`` (a
        :class:`~forge_jax.kv_cache.KVCache` over :attr:`num_attention_layers` layers, e.g.
        ``ContiguousKVCache.create(num_layers=model.num_attention_layers, ...)``) and an empty
        state pool of ``num_slots`` slots (default: the attention cache's rows, row ``b`` on
        slot ``b``), conv states in the compute dtype, delta-rule states in ``state_dtype``."""
        lin = self.config.linear
        batch = attention.batch or None  # (an engine's pool has no rows: one per slot)
        pool = RecurrentStatePool.create(
            num_layers=self.config.kinds.count("linear"),
            num_slots=batch if num_slots is None else num_slots, conv_kernel=lin.conv_kernel,
            conv_dim=lin.conv_dim, v_heads=lin.v_heads, k_head_dim=lin.k_head_dim,
            v_head_dim=lin.v_head_dim, dtype=self.dtype, state_dtype=state_dtype, batch=batch)
        return HybridCache(attention=attention, linear=pool, kinds=self.config.kinds)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Full causal forward without a cache: int32 ``tokens [batch, seq]`` (token ``t``
        at position ``t``) -> float32 logits ``[batch, seq, vocab_size]``."""
        check_tokens(tokens, self.config.vocab_size)
        batch, seq = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

        def attend(q, k, v, cache):
            return fj.attention(q, k, v, causal=True), cache

        hidden, _ = self._layers(tokens, positions, lambda i: attend, None, None)
        return self._logits(hidden)

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                       cache: HybridCache, *, logits_at: jax.Array | None = None,
                       empty_cache: bool = False) -> tuple[jax.Array, HybridCache]:
        """Forward over new tokens that continue the sequences in ``cache``.

        As :meth:`forge_jax.models.llama_model.Llama.forward_cached`: the attention layers
        write their keys and values at ``positions`` and attend through the cache; the
        delta-rule layers read each row's states from the cache, run the row's valid tokens
        (``valid`` must mark a prefix of each row: right padding) and write the states back,
        so a sequence prefilled in pieces ends as one prefilled at once.

        Args:
          tokens: int32 ``[batch, t]``.
          positions: int32 ``[batch, t]``, continuing the cache (row ``b``'s first new
            position is ``cache.lengths[b]``).
          valid: bool ``[batch, t]``, True on each row's first ``n_b`` tokens.
          cache: a :class:`~forge_jax.kv_cache.HybridCache` (:meth:`hybrid_cache`).
          logits_at: optional int32 ``[batch]`` (or ``[batch, n]``, n per row: the serving
            engine's packed row): logits only at these indices of ``t``.
          empty_cache: static; True promises the cache holds no token yet: the attention
            layers then attend over the new tokens alone with ``fj.attention``.

        Returns:
          ``(logits, cache)``: float32 ``[batch, t, vocab]`` (``[batch, vocab]`` or
          ``[batch, n, vocab]`` with ``logits_at``) and the updated cache.
        """
        positions = positions.astype(jnp.int32)
        new_lengths = jnp.maximum(cache.lengths.astype(jnp.int32),
                                  jnp.max(jnp.where(valid, positions + 1, 0), axis=1))
        lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)  # the delta rule's real tokens

        def attend(i, q, k, v, cache):
            cache = cache.write(i, k, v, positions, valid)
            if empty_cache:
                k, v = cache.as_stored(k), cache.as_stored(v)
                return fj.attention(q, k, v, causal=True), cache
            return cache.attend(i, q, q_positions=positions, kv_lengths=new_lengths), cache

        hidden, cache = self._layers(tokens, positions, lambda i: functools.partial(attend, i),
                                     cache, lengths)
        if logits_at is not None and logits_at.ndim == 2:  # n per row (a packed row's)
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, :, None],
                                         axis=1)  # [batch, n, hidden]
        elif logits_at is not None:
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, None, None],
                                         axis=1)[:, 0]  # [batch, hidden]
        return self._logits(hidden), cache.with_lengths(new_lengths)

    def _layers(self, tokens, positions, attend_of: Callable, cache, lengths):
        """The layer stack: final-normed hidden states ``[batch, t, hidden]`` and the cache."""
        c = self.config
        x = fj.embedding(self.embed_tokens[...], tokens).astype(self.dtype)
        residual = None
        with fj.sharding.use_mesh(self.mesh):
            for i, layer in enumerate(self.layers):
                with jax.named_scope(f"layer_{i}"):
                    x, residual, cache = layer(x, residual, positions, attend_of(i), cache,
                                               config=c, layer=i, lengths=lengths)
            hidden = self.norm(x, residual, eps=c.rms_norm_eps, offset=_OFFSET)[0]
        return hidden, cache

    def _logits(self, hidden):
        """hidden ``[..., hidden_size]`` -> float32 logits ``[..., vocab]``."""
        return output_logits(hidden, self.lm_head, self.embed_tokens, self.dtype)
