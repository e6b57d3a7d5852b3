"""Gemma 4 text (HF ``Gemma4ForCausalLM``, ``model_type: "gemma4_text"``) in Flax NNX,
built from forge_jax ops; its config is :class:`~forge_jax.models.gemma4_config.Gemma4Config`.

Its layers differ from the Llama decoder's enough to be a model of their own: two head
widths (sliding and full layers), per-layer input embeddings, layers that reuse an
earlier layer's keys and values, a dense MLP and a mixture of experts side by side, and a
scalar per layer. Its cached forward, :meth:`Gemma4.forward_cached`, takes and returns
what :meth:`forge_jax.models.llama.Llama.forward_cached` does, so :func:`generate` and the
serving engine run it with their caches.

**One KV cache for two widths.** The cache holds a slot per layer that computes keys and
values (the shared layers read their source layer's slot) at the wider type's geometry
(:attr:`Gemma4Config.kv_cache_geometry`): a narrower layer's keys and values are
zero-padded to the wider ``head_dim`` and its KV heads repeated to the larger count, and
its queries are zero-padded too. The padding adds nothing to ``q . k`` (attention is
unscaled: scale 1) and its output columns are dropped; a repeated KV head serves the same
query heads as before. The cost is memory (a sliding layer of Gemma 4 E2B stores 512
values per head instead of 256); the gain is that every cache (contiguous, paged, the
engine's ragged batch, the quantized ones), the block manager, prefix caching and every
attention kernel take the model unchanged, where a cache per layer group would need each
of them to carry two geometries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import KVCache
from forge_jax.models.gemma4_config import Gemma4Config
from forge_jax.models.llama_caches import LlamaCaches
from forge_jax.models.llama_model import Linear, LlamaMLP, RMSNorm, TensorLayout
from forge_jax.models.llama_moe import GeluExpertsMoe
from forge_jax.models.output_head import output_logits

_ONE_DEVICE = TensorLayout()  # the layout of an unsharded model


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


def _rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight (Gemma 4's value norm and router norm)."""
    return fj.rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), eps=eps)


def _pad(x: jax.Array, heads: int, width: int) -> jax.Array:
    """``[b, t, h, d]`` -> ``[b, t, heads, width]``: each head repeated ``heads // h``
    times, then zeros past ``d``."""
    if x.shape[2] != heads:
        x = jnp.repeat(x, heads // x.shape[2], axis=2)
    if x.shape[3] != width:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[3])))
    return x


class Gemma4Attention(nnx.Module):
    """Layer ``layer``'s attention: q (and, unless shared, k and v) projections, per-head
    RMSNorms of q, k and v (v without weight), RoPE of its layer type, unscaled attention."""

    def __init__(self, c: Gemma4Config, layer: int, *, rngs, dtype, param_dtype):
        kw = dict(use_bias=c.attention_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        hd, kv = c.layer_head_dim(layer), c.layer_kv_heads(layer)
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * hd, **kw)
        self.o_proj = Linear(c.num_attention_heads * hd, c.hidden_size, **kw)
        self.q_norm = RMSNorm(hd, param_dtype=param_dtype)
        shared = c.is_shared(layer)
        self.k_proj = None if shared else Linear(c.hidden_size, kv * hd, **kw)
        self.v_proj = Linear(c.hidden_size, kv * hd, **kw) if (
            not shared and c.has_v_proj(layer)) else None
        self.k_norm = None if shared else RMSNorm(hd, param_dtype=param_dtype)

    def __call__(self, x, positions, attend, cache, *, c: Gemma4Config, layer: int):
        batch, t, _ = x.shape
        hd = c.layer_head_dim(layer)
        theta, scaling = c.layer_rope(layer)
        rope = functools.partial(fj.rope, positions=positions, theta=theta, scaling=scaling)
        q = self.q_proj(x).reshape(batch, t, c.num_attention_heads, hd)
        q = rope(self.q_norm(q, eps=c.rms_norm_eps))
        k = v = None
        if self.k_proj is not None:
            k = self.k_proj(x).reshape(batch, t, -1, hd)
            v = k if self.v_proj is None else self.v_proj(x).reshape(batch, t, -1, hd)
            k = rope(self.k_norm(k, eps=c.rms_norm_eps))
            v = _rms(v, c.rms_norm_eps).astype(k.dtype)
        o, cache = attend(q, k, v, cache)  # [batch, t, heads, hd]
        return self.o_proj(o.reshape(batch, t, c.num_attention_heads * hd)), cache


class Gemma4DecoderLayer(nnx.Module):
    """``h += norm(attn(norm(h))); h += norm(mlp(norm(h)) [+ moe]); h += ple(h); h *= s``."""

    def __init__(self, c: Gemma4Config, layer: int, *, rngs, dtype, param_dtype,
                 layout: TensorLayout = _ONE_DEVICE):
        norm = functools.partial(RMSNorm, c.hidden_size, param_dtype=param_dtype)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(c, layer, rngs=rngs, dtype=dtype,
                                         param_dtype=param_dtype)
        self.mlp = LlamaMLP(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype, layout=layout,
                            intermediate_size=c.mlp_width(layer))
        moe = bool(c.num_experts)
        self.moe = GeluExpertsMoe(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if (
            moe) else None
        self.post_feedforward_layernorm_1 = norm() if moe else None
        self.post_feedforward_layernorm_2 = norm() if moe else None
        self.pre_feedforward_layernorm_2 = norm() if moe else None
        p = c.hidden_size_per_layer_input
        kw = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.per_layer_input_gate = Linear(c.hidden_size, p, **kw) if p else None
        self.per_layer_projection = Linear(p, c.hidden_size, **kw) if p else None
        self.post_per_layer_input_norm = norm() if p else None
        self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))

    def norms(self) -> dict[str, RMSNorm]:
        """HF name (under the layer) -> each RMSNorm with a weight."""
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                 "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2",
                 "post_per_layer_input_norm")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        out["self_attn.q_norm"] = self.self_attn.q_norm
        if self.self_attn.k_norm is not None:
            out["self_attn.k_norm"] = self.self_attn.k_norm
        return out

    def __call__(self, x, per_layer_input, positions, attend, cache, *, c: Gemma4Config,
                 layer: int):
        eps = c.rms_norm_eps
        y, cache = self.self_attn(self.input_layernorm(x, eps=eps), positions, attend, cache,
                                  c=c, layer=layer)
        x = x + self.post_attention_layernorm(y, eps=eps)
        y = self.mlp(self.pre_feedforward_layernorm(x, eps=eps))
        if self.moe is not None:
            routed = self.moe(self.pre_feedforward_layernorm_2(x, eps=eps), x, eps=eps)
            y = (self.post_feedforward_layernorm_1(y, eps=eps)
                 + self.post_feedforward_layernorm_2(routed, eps=eps))
        x = x + self.post_feedforward_layernorm(y, eps=eps)
        if self.per_layer_input_gate is not None:
            gate = self.per_layer_input_gate(x)
            g = fj.gelu_tanh_mul(gate, per_layer_input.astype(gate.dtype))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g), eps=eps)
        return x * self.layer_scalar[...].astype(x.dtype), cache


class Gemma4(LlamaCaches, nnx.Module):
    """Gemma 4 text with its output head. Attributes as :class:`Llama`'s (``config``,
    ``dtype``, ``param_dtype``, ``layout``, ``mesh`` (None: one device),
    ``generation_config``); its caches are the Llama's
    (:class:`~forge_jax.models.llama_caches.LlamaCaches`) at
    :attr:`Gemma4Config.kv_cache_geometry` (its KV heads ``layout.kv_repeat`` times over
    on a mesh: :mod:`forge_jax.models.gemma4_sharding`), so it keeps the model contract
    (:class:`forge_jax.models.protocol.CausalLM`)."""

    def __init__(self, config: Gemma4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, layout: TensorLayout = _ONE_DEVICE):
        c = self.config = config
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.layout = layout
        self.mesh = None
        self.generation_config = None
        self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), param_dtype))
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.layers = nnx.List([Gemma4DecoderLayer(c, i, **kw, layout=layout)
                                for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, use_bias=False, **kw)
        p = c.hidden_size_per_layer_input
        self.embed_tokens_per_layer = nnx.Param(_normal(
            rngs, (c.vocab_size_per_layer_input, c.num_hidden_layers * p), param_dtype)) if (
            p) else None
        self.per_layer_model_projection = Linear(
            c.hidden_size, c.num_hidden_layers * p, use_bias=False, **kw) if p else None
        self.per_layer_projection_norm = RMSNorm(p, param_dtype=param_dtype) if p else None

    @property
    def kv_heads(self) -> int:
        """KV heads in the KV cache: the larger of the two layer types', times
        ``layout.kv_repeat``."""
        return self.config.kv_cache_geometry[1] * self.layout.kv_repeat

    def __call__(self, tokens: jax.Array, *, allow_beyond_max_positions: bool = False
                 ) -> jax.Array:
        """Full causal forward without a cache: float32 logits ``[batch, seq, vocab]``."""
        if not (hasattr(tokens, "dtype") and jnp.issubdtype(tokens.dtype, jnp.integer)
                and tokens.ndim == 2):
            raise ValueError(f"tokens must be an int [batch, seq] array, got {tokens!r:.80}")
        batch, seq = tokens.shape
        if seq > self.config.max_position_embeddings and not allow_beyond_max_positions:
            raise ValueError(f"tokens.shape={tuple(tokens.shape)} has {seq} positions, beyond "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        kept: dict[int, tuple] = {}

        def attend(i, q, k, v, cache, **kw):
            if k is None:
                k, v = kept[self.config.kv_source(i)]
            kept[i] = k, v
            return fj.attention(q, k, v, causal=True, **kw), cache

        return self._logits(self._layers(tokens, positions, attend, None)[0])

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                       cache: KVCache, *, logits_at: jax.Array | None = None,
                       empty_cache: bool = False) -> tuple[jax.Array, KVCache]:
        """As :meth:`forge_jax.models.llama.Llama.forward_cached` (the same arguments and
        results); ``cache`` has :attr:`Gemma4Config.kv_cache_geometry`: layer ``i``
        writes slot ``i`` and a shared layer attends to its source layer's slot."""
        c = self.config
        heads, width = self.kv_heads, c.kv_cache_geometry[2]
        new_lengths = jnp.maximum(
            cache.lengths.astype(jnp.int32),
            jnp.max(jnp.where(valid, positions.astype(jnp.int32) + 1, 0), axis=1))
        kept: dict[int, tuple] = {}

        def attend(i, q, k, v, cache, **kw):
            d = q.shape[-1]
            q = _pad(q, q.shape[2], width)
            if k is not None:
                k, v = _pad(k, heads, width), _pad(v, heads, width)
                cache = cache.write(i, k, v, positions, valid)
                kept[i] = cache.as_stored(k), cache.as_stored(v)
            if empty_cache:
                k, v = kept[c.kv_source(i)]
                o = fj.attention(q, k, v, causal=True, **kw)
            else:
                o = cache.attend(c.kv_source(i), q, q_positions=positions,
                                 kv_lengths=new_lengths, **kw)
            return o[..., :d], cache

        hidden, cache = self._layers(tokens, positions, attend, cache)
        cache = cache.with_lengths(new_lengths)
        if logits_at is not None and logits_at.ndim == 2:  # [batch, n]: n per row
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, :, None],
                                         axis=1)
        elif logits_at is not None:
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, None, None],
                                         axis=1)[:, 0]
        return self._logits(hidden), cache

    def _per_layer_inputs(self, tokens, x):
        """The per-layer inputs ``[batch, t, layers, p]``: the per-layer embedding of the
        tokens and the normed projection of the embeddings ``x``, averaged over sqrt(2)."""
        c = self.config
        p = c.hidden_size_per_layer_input
        table = self.embed_tokens_per_layer[...]
        ids = fj.embedding(table, tokens).astype(self.dtype)
        ids = ids * jnp.asarray(p ** 0.5, self.dtype)
        proj = self.per_layer_model_projection(x) * jnp.asarray(c.hidden_size ** -0.5,
                                                                 self.dtype)
        proj = proj.reshape(*x.shape[:-1], c.num_hidden_layers, p)
        proj = self.per_layer_projection_norm(proj, eps=c.rms_norm_eps)
        return ((proj + ids.reshape(proj.shape)) * jnp.asarray(2.0 ** -0.5, self.dtype))

    def _layers(self, tokens, positions, attend, cache):
        # On a mesh, the ops run per shard there (forge_jax.sharding); the model is the same.
        with fj.sharding.use_mesh(self.mesh):
            return self._decoder_layers(tokens, positions, attend, cache)

    def _decoder_layers(self, tokens, positions, attend, cache):
        c = self.config
        x = fj.embedding(self.embed_tokens[...], tokens).astype(self.dtype)
        x = x * jnp.asarray(c.hidden_size ** 0.5, self.dtype)  # rounded to the dtype, as HF
        if self.mesh is not None:  # the batch rows stay on their data-axis shard throughout
            rows = self.mesh.batch_axis(tokens.shape[0])
            x = jax.lax.with_sharding_constraint(x, self.mesh.sharding(rows, None, None))
        per_layer = None if self.embed_tokens_per_layer is None else (
            self._per_layer_inputs(tokens, x))
        for i, layer in enumerate(self.layers):
            window = c.sliding_window if c.is_sliding(i) else None
            with jax.named_scope(f"layer_{i}"):
                x, cache = layer(x, None if per_layer is None else per_layer[:, :, i],
                                 positions, functools.partial(attend, i, scale=1.0,
                                                              sliding_window=window),
                                 cache, c=c, layer=i)
        return self.norm(x, eps=c.rms_norm_eps), cache

    def _logits(self, hidden):
        return output_logits(hidden, self.lm_head, self.embed_tokens, self.dtype,
                             self.config.final_logit_softcapping)
