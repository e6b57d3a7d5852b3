"""DeepSeek-V3 (``model_type: deepseek_v3``): multi-head latent attention over the paged latent
cache and sigmoid-routed experts, built from forge_jax's public ops.

The decoder, as Hugging Face transformers' ``DeepseekV3ForCausalLM`` computes it:

* **Attention (MLA).** Queries through a low-rank bottleneck (``q_a_proj``, RMS norm,
  ``q_b_proj``; or one ``q_proj`` when ``q_lora_rank`` is None), split per head into
  ``qk_nope_head_dim`` and ``qk_rope_head_dim`` values. Keys and values through one shared
  latent: ``kv_a_proj_with_mqa`` gives the latent (``kv_lora_rank``, RMS-normed) and one RoPE
  key shared by the heads. RoPE rotates interleaved pairs (``rope_interleave``), here
  de-interleaved and rotated by :func:`forge_jax.rope`. The cache
  (:class:`forge_jax.kv_cache.PagedLatentCache`) stores the latent and the RoPE key only, and
  attention runs weight-absorbed through :func:`forge_jax.mla_paged_attention` with
  ``kv_b_proj`` split into the heads' key and value up-projections.
* **Feed-forward.** The first ``first_k_dense_replace`` layers are SwiGLU MLPs; the others
  mixtures of experts: sigmoid scores of a float32 router, ``e_score_correction_bias`` added
  for the choice only, group-limited top-k (the ``topk_group`` best of ``n_group`` groups,
  a group scored by the sum of its two best experts), the chosen experts' sigmoid scores as
  weights (renormalised with ``norm_topk_prob``) times ``routed_scaling_factor``, computed
  by :func:`forge_jax.moe_permute`, :func:`forge_jax.grouped_matmul` and
  :func:`forge_jax.moe_unpermute`; plus ``n_shared_experts`` shared experts (one SwiGLU MLP
  of ``moe_intermediate_size * n_shared_experts``) for every token.

RoPE may be YaRN-scaled (``rope_type: "yarn"``, :class:`forge_jax.RopeScaling`): the tables
carry its attention factor and the softmax scale its ``mscale_all_dim`` correction
(:func:`forge_jax.ops.mla.yarn_softmax_scale`).

The weights are a pytree of arrays (:func:`load`), an argument of the jitted step, never
constants in its program; :func:`load` may quantize them (``quantize=``). Not yet here: FP8
block-quantized checkpoints, :func:`forge_jax.generation.generate` and the serving engine
(this module's :func:`generate_greedy` drives the latent cache directly), a mesh.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import (
    BlockManager,
    CacheSpec,
    ContiguousLatentCache,
    PagedLatentCache,
    RaggedLatentCache,
)
from forge_jax.kv_cache.latent import pool_width
from forge_jax.ops.mla import yarn_softmax_scale


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """The sizes and switches of a DeepSeek-V3 checkpoint's ``config.json`` (the names are
    transformers')."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    rope_scaling: fj.RopeScaling | None = None
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale: ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor,
        mscale_all_dim) ** 2`` with YaRN rope scaling (transformers' ``yarn_apply_mscale``);
        the RoPE tables carry YaRN's own attention factor."""
        s = self.rope_scaling
        if s is None or not s.mscale_all_dim:
            return yarn_softmax_scale(self.qk_head_dim)
        return yarn_softmax_scale(self.qk_head_dim, s.factor, s.mscale_all_dim)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DeepseekV3Config:
        """The config of a transformers ``config.json`` of ``model_type`` ``deepseek_v3``;
        raises ValueError naming what this module does not compute."""
        if config.get("model_type") != "deepseek_v3":
            raise ValueError(f"not a DeepSeek-V3 config: model_type={config.get('model_type')!r}")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_type={kind!r}: DeepSeek-V3 checkpoints use the default "
                             "RoPE or YaRN")
        scaling = fj.RopeScaling.from_hf(
            {k: v for k, v in rope.items() if k != "rope_theta"},
            max_position_embeddings=config.get("max_position_embeddings"))
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r}: DeepSeek-V3 uses silu")
        if config.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported (DeepSeek-V3 has none)")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        eos = config.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in np.atleast_1d(eos))
        names = [f.name for f in dataclasses.fields(cls)
                 if f.name not in ("rope_theta", "rope_scaling", "eos_token_ids")]
        return cls(rope_theta=float(theta), rope_scaling=scaling, eos_token_ids=eos,
                   **{n: config[n] for n in names if n in config})


def load_config(directory) -> DeepseekV3Config:
    return DeepseekV3Config.from_hf(json.loads(
        (pathlib.Path(directory) / "config.json").read_text()))


def load(directory, dtype=jnp.float32, *, quantize: str | None = None,
         group_size: int | None = None) -> tuple[DeepseekV3Config, dict[str, Any]]:
    """``(config, weights)`` from a transformers-written safetensors checkpoint: the weights
    a pytree of ``dtype`` arrays (the router's in float32), projections in the ``[out, in]``
    layout, experts stacked ``[experts, out, in]``, ``kv_b_proj`` split into ``w_uk
    [kv_lora_rank, heads, nope]`` and ``w_uv [kv_lora_rank, heads, v]``.

    ``quantize``: ``"int8"``, ``"int4"`` or ``"fp8"`` stores the projections and the experts
    as :class:`forge_jax.QuantizedArray` (:func:`forge_jax.quantize`, scales per output
    channel, or per ``group_size`` for int4; per expert), multiplied dequantized; the
    embedding, norms, router, the latent up-projections and the output head stay ``dtype``.
    """
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    config = load_config(directory)
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "np") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118

    def take(name, transpose=False, as_dtype=dtype):
        x = tensors.pop(name).astype(np.float32)
        return jnp.asarray(x.T if transpose else x, as_dtype)

    def proj(name):  # a projection [out, in], quantized when asked
        w = take(name)
        if quantize is None:
            return w
        return fj.quantize(w, quantize, group_size=group_size if quantize == "int4" else None)

    def experts(names):
        w = jnp.stack([take(n) for n in names])
        if quantize is None:
            return w
        return fj.quantize(w, quantize, group_size=group_size if quantize == "int4" else None)

    heads, nope = config.num_attention_heads, config.qk_nope_head_dim
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = {}
        if config.q_lora_rank is None:
            attn["q_proj"] = proj(p + "self_attn.q_proj.weight")
        else:
            attn.update(q_a_proj=proj(p + "self_attn.q_a_proj.weight"),
                        q_a_norm=take(p + "self_attn.q_a_layernorm.weight"),
                        q_b_proj=proj(p + "self_attn.q_b_proj.weight"))
        kv_b = tensors.pop(p + "self_attn.kv_b_proj.weight").astype(np.float32)
        kv_b = kv_b.reshape(heads, nope + config.v_head_dim, config.kv_lora_rank)
        attn.update(kv_a_proj=proj(p + "self_attn.kv_a_proj_with_mqa.weight"),
                    kv_a_norm=take(p + "self_attn.kv_a_layernorm.weight"),
                    w_uk=jnp.asarray(kv_b[:, :nope].transpose(2, 0, 1), dtype),
                    w_uv=jnp.asarray(kv_b[:, nope:].transpose(2, 0, 1), dtype),
                    o_proj=proj(p + "self_attn.o_proj.weight"))
        layer = dict(attn=attn, input_norm=take(p + "input_layernorm.weight"),
                     post_norm=take(p + "post_attention_layernorm.weight"))
        mlp = ("gate_proj", "up_proj", "down_proj")
        if i < config.first_k_dense_replace:
            layer["mlp"] = {k: proj(f"{p}mlp.{k}.weight") for k in mlp}
        else:
            layer["moe"] = dict(
                router=take(p + "mlp.gate.weight", True, jnp.float32),
                bias=take(p + "mlp.gate.e_score_correction_bias", as_dtype=jnp.float32),
                **{k: experts([f"{p}mlp.experts.{e}.{k}.weight"
                               for e in range(config.n_routed_experts)]) for k in mlp},
                shared={k: proj(f"{p}mlp.shared_experts.{k}.weight") for k in mlp})
        layers.append(layer)
    weights = dict(embed=take("model.embed_tokens.weight"), layers=layers,
                   norm=take("model.norm.weight"))
    weights["lm_head"] = (weights["embed"] if config.tie_word_embeddings
                          else take("lm_head.weight"))
    tensors = {k: v for k, v in tensors.items() if "mtp" not in k and ".layers." not in k
               or int(k.split(".")[2]) < config.num_hidden_layers}
    if tensors:  # (multi-token prediction layers past num_hidden_layers are not used)
        raise ValueError(f"unused tensors in the checkpoint: {sorted(tensors)[:5]}")
    return config, weights


def from_pretrained(path, *, revision: str | None = None, dtype=jnp.float32,
                    quantize: str | None = None, group_size: int | None = None
                    ) -> DeepseekV3:
    """The :class:`DeepseekV3` model of a local checkpoint directory or a Hugging Face Hub
    repository id (``ORG/NAME``, fetched into the ``huggingface_hub`` cache; a local
    directory wins): :func:`load`'s weights, and ``generation_config.json`` (if present) in
    ``model.generation_config``."""
    from forge_jax.models.checkpoints.generation_config import load_generation_config
    from forge_jax.models.checkpoints.hub import resolve_checkpoint

    directory = resolve_checkpoint(path, revision=revision)
    model = DeepseekV3(*load(directory, dtype, quantize=quantize, group_size=group_size))
    model.generation_config = load_generation_config(directory)
    return model


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


def generate_greedy(config: DeepseekV3Config, weights, prompts, max_new_tokens: int, *,
                    page_size: int = 16, dtype=jnp.float32):
    """Greedy continuations (int ``[batch, max_new_tokens]``) of equal-length ``prompts``
    (int ``[batch, prompt_len]``) through a :class:`PagedLatentCache` whose pages a
    :class:`BlockManager` hands out; also returns the prompt's logits."""
    prompts = np.asarray(prompts, np.int32)
    batch, n = prompts.shape
    total = n + max_new_tokens
    max_pages = -(-total // page_size)
    manager = BlockManager(num_pages=batch * max_pages, page_size=page_size)
    for b in range(batch):
        manager.allocate(b, total)
    cache = PagedLatentCache.create(
        num_layers=config.num_hidden_layers, num_pages=batch * max_pages, page_size=page_size,
        kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, dtype=dtype,
        block_tables=manager.block_tables(range(batch), max_pages))
    step = jax.jit(lambda w, tok, c, pos, valid: forward(w, tok, c, pos, valid, config=config),
                   donate_argnums=(2,))
    positions = np.broadcast_to(np.arange(n, dtype=np.int32), (batch, n))
    logits, cache = step(weights, prompts, cache, positions, np.ones((batch, n), bool))
    prompt_logits = logits
    out = []
    token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    for i in range(max_new_tokens):
        out.append(token)
        if i == max_new_tokens - 1:
            break
        pos = np.full((batch, 1), n + i, np.int32)
        logits, cache = step(weights, token[:, None], cache, pos, np.ones((batch, 1), bool))
        token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    return np.stack([np.asarray(t) for t in out], 1), prompt_logits


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

    def create_pool(self, spec: CacheSpec, *, num_pages: int, pages_per_seq: int
                    ) -> PagedLatentCache:
        """See :meth:`forge_jax.models.protocol.CausalLM.create_pool`."""
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
