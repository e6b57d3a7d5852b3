"""DeepSeek-V3's decoder from forge_jax's public ops (multi-head latent attention over a
latent cache, sigmoid-routed experts) and :class:`DeepseekV3`, the NNX module the runtime
drives (:class:`forge_jax.models.protocol.CausalLM`); what it computes is in
:mod:`forge_jax.models.deepseek`'s docstring."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import (
    CacheSpec,
    ContiguousLatentCache,
    PagedLatentCache,
    RaggedLatentCache,
)
from forge_jax.kv_cache.latent import pool_width
from forge_jax.models.deepseek_config import DeepseekV3Config


def _linear(x, w):
    """``x [..., in]`` times a projection ``w [out, in]`` (float or quantized)."""
    out = fj.matmul(x.reshape(-1, x.shape[-1]), w, trans_b=True)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _mlp(x, w):
    return _linear(fj.silu_mul(_linear(x, w["gate_proj"]), _linear(x, w["up_proj"])),
                   w["down_proj"])


def route(x, router, bias, config: DeepseekV3Config):
    """``(weights [tokens, k] float32, experts [tokens, k] int32)``: sigmoid scores, the
    correction bias for the choice, group-limited top-k, the routed scaling factor."""
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router,
                                    precision=jax.lax.Precision.HIGHEST))  # [t, experts]
    choice = scores + bias
    tokens, experts = scores.shape
    groups = choice.reshape(tokens, config.n_group, experts // config.n_group)
    group_scores = jax.lax.top_k(groups, 2)[0].sum(-1)  # [t, n_group]
    _, best = jax.lax.top_k(group_scores, config.topk_group)
    keep = jnp.zeros_like(group_scores, jnp.bool_).at[
        jnp.arange(tokens)[:, None], best].set(True)
    choice = jnp.where(jnp.repeat(keep, experts // config.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids.astype(jnp.int32)


def _moe(x, w, config: DeepseekV3Config):
    weights, ids = route(x, w["router"], w["bias"], config)
    x_sorted, sizes, order = fj.moe_permute(x, ids, config.n_routed_experts)
    hidden = fj.silu_mul(fj.grouped_matmul(x_sorted, w["gate_proj"], sizes, trans_w=True),
                         fj.grouped_matmul(x_sorted, w["up_proj"], sizes, trans_w=True))
    out = fj.moe_unpermute(fj.grouped_matmul(hidden, w["down_proj"], sizes, trans_w=True),
                           order, weights.astype(x.dtype))
    return out + _mlp(x, w["shared"])


def _deinterleave(x):
    """DeepSeek's interleaved RoPE pairs ``(x0, x1), (x2, x3), ...`` as the halves
    :func:`forge_jax.rope` rotates (``[x0, x2, ...], [x1, x3, ...]``)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _attention(x, w, cache, layer, positions, valid, kv_lengths, config, empty_cache=False):
    batch, t, _ = x.shape
    heads, nope, rope = (config.num_attention_heads, config.qk_nope_head_dim,
                         config.qk_rope_head_dim)
    eps = config.rms_norm_eps
    if config.q_lora_rank is None:
        q = _linear(x, w["q_proj"])
    else:
        q = _linear(fj.rms_norm(_linear(x, w["q_a_proj"]), w["q_a_norm"], eps=eps),
                    w["q_b_proj"])
    q = q.reshape(batch, t, heads, nope + rope)
    kv = _linear(x, w["kv_a_proj"])  # [b, t, kv_lora_rank + rope]
    latent = fj.rms_norm(kv[..., :config.kv_lora_rank], w["kv_a_norm"], eps=eps)
    q_pe, k_pe = q[..., nope:], kv[..., None, config.kv_lora_rank:]
    if config.rope_interleave:
        q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
    q_pe = fj.rope(q_pe, positions, theta=config.rope_theta, scaling=config.rope_scaling)
    k_pe = fj.rope(k_pe, positions, theta=config.rope_theta, scaling=config.rope_scaling)
    cache = cache.write(layer, latent[:, :, None], k_pe, positions, valid)
    if empty_cache:  # the new latents alone, as the cache holds them (key j at position j)
        out = fj.mla_attention(q[..., :nope], q_pe, cache.as_stored(latent),
                               cache.as_stored(k_pe[:, :, 0]), w["w_uk"], w["w_uv"],
                               scale=config.scale, causal=True)
    else:
        out = cache.attend(layer, jnp.concatenate([q[..., :nope], q_pe], axis=-1),
                           q_positions=positions, kv_lengths=kv_lengths, scale=config.scale,
                           up_proj=(w["w_uk"], w["w_uv"]))  # [b, t, heads, v_head_dim]
    return _linear(out.reshape(batch, t, -1), w["o_proj"]), cache


def _decoder(weights, tokens, cache, positions, valid, config, empty_cache=False):
    """The final-normed hidden states ``[batch, t, hidden]`` and the cache with the tokens
    written (its lengths updated)."""
    kv_lengths = jnp.maximum(cache.lengths, jnp.max(jnp.where(valid, positions + 1, 0), 1))
    x = fj.embedding(weights["embed"], tokens)
    eps = config.rms_norm_eps
    for i, layer in enumerate(weights["layers"]):
        with jax.named_scope(f"layer_{i}"):
            h = fj.rms_norm(x, layer["input_norm"], eps=eps)
            a, cache = _attention(h, layer["attn"], cache, i, positions, valid, kv_lengths,
                                  config, empty_cache)
            x = x + a
            h = fj.rms_norm(x, layer["post_norm"], eps=eps)
            if "mlp" in layer:
                x = x + _mlp(h, layer["mlp"])
            else:
                x = x + _moe(h.reshape(-1, h.shape[-1]), layer["moe"],
                             config).reshape(h.shape)
    return fj.rms_norm(x, weights["norm"], eps=eps), cache.with_lengths(kv_lengths)


def forward(weights, tokens, cache: PagedLatentCache, positions, valid, *,
            config: DeepseekV3Config):
    """Logits ``[batch, t, vocab]`` (float32) of ``tokens [batch, t]`` at ``positions``
    (``valid`` False: padding, not written), and the cache with them written."""
    x, cache = _decoder(weights, tokens, cache, positions, valid, config)
    return _linear(x, weights["lm_head"]).astype(jnp.float32), cache


class DeepseekV3(nnx.Module):
    """DeepSeek-V3 as the runtime drives it: a :class:`forge_jax.models.protocol.CausalLM`
    (:func:`forge_jax.generation.generate`, chat, the serving engine), its weights
    (:func:`load`'s pytree) held as ``nnx.Param`` leaves so that ``nnx.split`` makes them
    arguments of the jitted steps.

    Its caches hold latents: ``CacheSpec(kind="paged")`` a
    :class:`~forge_jax.kv_cache.PagedLatentCache`, ``"contiguous"`` a
    :class:`~forge_jax.kv_cache.ContiguousLatentCache`, the engine's packed step a
    :class:`~forge_jax.kv_cache.RaggedLatentCache` over the pool (prefix caching through the
    block manager as for any pool). A quantized cache (``kv_dtype``) is refused: the latent
    is stored in a float dtype.

    Args:
      config: the :class:`DeepseekV3Config`.
      weights: :func:`load`'s pytree (float or quantized leaves).

    Attributes set after construction: ``mesh`` (None: one device) and
    ``generation_config`` (:func:`from_pretrained` reads ``generation_config.json``).
    """

    def __init__(self, config: DeepseekV3Config, weights: dict[str, Any]):
        self.config = config
        self.dtype = jnp.dtype(weights["embed"].dtype)
        self.param_dtype = self.dtype
        self.mesh = None
        self.generation_config = None
        self.weights = nnx.data(jax.tree.map(nnx.Param, weights))

    def arrays(self) -> dict[str, Any]:
        """The weights as :func:`load`'s pytree of arrays."""
        return jax.tree.map(lambda p: p[...], self.weights,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))

    def forward_cached(self, tokens, positions, valid, cache, *, logits_at=None,
                       empty_cache: bool = False):
        """See :meth:`forge_jax.models.protocol.CausalLM.forward_cached`; ``cache`` is one of
        this model's latent caches."""
        weights = self.arrays()
        with fj.sharding.use_mesh(self.mesh):
            hidden, cache = _decoder(weights, tokens, cache, positions.astype(jnp.int32),
                                     valid, self.config, empty_cache)
            if logits_at is not None and logits_at.ndim == 1:
                hidden = jnp.take_along_axis(
                    hidden, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
            elif logits_at is not None:  # [batch, n]: the packed row's last tokens
                hidden = jnp.take_along_axis(
                    hidden, logits_at.astype(jnp.int32)[:, :, None], axis=1)
            return _linear(hidden, weights["lm_head"]).astype(jnp.float32), cache

    def _dtype(self, spec: CacheSpec):
        if spec.kv_dtype is not None:
            raise ValueError(f"kv_dtype={spec.kv_dtype!r}: DeepSeek-V3's latent cache is "
                             "stored in a float dtype (CacheSpec(dtype=...)), not quantized")
        return spec.resolved_dtype(self.dtype)

    def _create(self, make):
        if self.mesh is None:
            return make()
        shardings = self.cache_shardings(jax.eval_shape(make))
        return jax.jit(make, out_shardings=shardings)()

    def create_cache(self, spec: CacheSpec, *, batch: int, max_len: int,
                     num_pages: int | None = None, block_tables=None):
        """See :meth:`forge_jax.models.protocol.CausalLM.create_cache`."""
        c, dtype = self.config, self._dtype(spec)
        dims = dict(num_layers=c.num_hidden_layers, kv_lora_rank=c.kv_lora_rank,
                    rope_dim=c.qk_rope_head_dim, dtype=dtype)
        if spec.kind == "paged":
            return self._create(lambda: PagedLatentCache.create(
                num_pages=num_pages, page_size=spec.page_size, block_tables=block_tables,
                **dims))
        return self._create(lambda: ContiguousLatentCache.create(batch=batch, max_len=max_len,
                                                                 **dims))

    def create_pool(self, spec: CacheSpec, *, num_pages: int, pages_per_seq: int,
                    prefix_caching: bool = False,
                    max_seqs: int | None = None) -> PagedLatentCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.create_pool`: a latent pool (its
        pages shared freely)."""
        del prefix_caching, max_seqs
        return self.create_cache(dataclasses.replace(spec, kind="paged"), batch=0, max_len=0,
                                 num_pages=num_pages,
                                 block_tables=np.zeros((0, pages_per_seq), np.int32))

    def packed_cache(self, pool: PagedLatentCache, metadata) -> RaggedLatentCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.packed_cache`."""
        return RaggedLatentCache.from_pool(pool, metadata)

    def cache_shardings(self, cache):
        """See :meth:`forge_jax.models.protocol.CausalLM.cache_shardings`: the latent is
        shared by every head, so a pool is replicated; a contiguous cache's rows split over
        the data axis (when they divide)."""
        mesh = self.mesh
        shardings = jax.tree.map(lambda _: mesh.replicated(), cache)
        if isinstance(cache, ContiguousLatentCache):
            rows = mesh.sharding(mesh.batch_axis(cache.batch), None, None)
            shardings = dataclasses.replace(shardings,
                                            buffers=tuple(rows for _ in cache.buffers))
        return shardings

    def cache_bytes(self, spec: CacheSpec, *, batch: int, max_len: int,
                    num_pages: int | None = None) -> int:
        """See :meth:`forge_jax.models.protocol.CausalLM.cache_bytes`: one
        ``pool_width(kv_lora_rank, rope_dim)`` vector per token and layer."""
        c = self.config
        width = pool_width(c.kv_lora_rank, c.qk_rope_head_dim)
        if spec.kind == "paged":
            slots = num_pages * spec.page_size
        else:
            rows = 1 if self.mesh is None or self.mesh.batch_axis(batch) is None \
                else self.mesh.dp
            slots = batch // rows * max_len
        return int(c.num_hidden_layers * slots * width * jnp.dtype(self._dtype(spec)).itemsize)
