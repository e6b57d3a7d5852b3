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

The weights are a pytree of arrays (:func:`load`), held by the NNX module
:class:`DeepseekV3` (:mod:`forge_jax.models.deepseek_model`) as parameters, so they are
arguments of the jitted steps, never constants in their programs. :func:`load` may quantize
them (``quantize=``) and reads DeepSeek's FP8 block-quantized releases as stored.
:class:`DeepseekV3` keeps the runtime's model contract
(:class:`forge_jax.models.protocol.CausalLM`): :func:`forge_jax.generation.generate` with a
paged or a contiguous latent cache, chat, and the serving engine over a latent page pool
with prefix caching. The config is :mod:`forge_jax.models.deepseek_config`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax.kv_cache import BlockManager, PagedLatentCache
from forge_jax.models.checkpoints import fp8
from forge_jax.models.checkpoints.generation_config import CheckpointError
from forge_jax.models.deepseek_config import DeepseekV3Config
from forge_jax.models.deepseek_model import DeepseekV3, forward, route  # noqa: F401


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

    A fine-grained FP8 checkpoint (DeepSeek-V3's own release: ``quantization_config``
    ``quant_method: "fp8"``, 128 x 128 blocks; :mod:`forge_jax.models.checkpoints.fp8`)
    loads as stored: each ``float8_e4m3fn`` projection and expert with its
    ``weight_scale_inv`` becomes an fp8 :class:`~forge_jax.QuantizedArray` of the file's
    bytes (experts stacked, each its own scales); ``kv_b_proj`` is dequantized (its key and
    value halves are the latent up-projections, read in float); what the file stores as a
    float (embedding, norms, router, ``lm_head``) loads as ``dtype``. ``quantize=`` is then
    refused (the weights are quantized already).
    """
    from forge_jax.models.checkpoints import quantize as quantize_load

    quantize_load.check_quantize(quantize, group_size)  # before any tensor is read
    directory = pathlib.Path(directory)
    raw_config = json.loads((directory / "config.json").read_text())
    config = DeepseekV3Config.from_hf(raw_config)
    fp8_config = fp8.quantization(raw_config, directory / "config.json")
    if fp8_config is not None and quantize is not None:
        raise ValueError(f"quantize={quantize!r}: this checkpoint's weights are fp8 already "
                         "(its quantization_config); load it without quantize=")
    raw, file_of = fp8.open_files(sorted(directory.glob("*.safetensors")))
    tensors = set(raw.names())

    def array(name) -> np.ndarray:  # a float tensor, float32
        if name not in tensors:
            raise CheckpointError(f"{directory}: the checkpoint has no tensor {name!r}")
        tensors.remove(name)
        if fp8.is_fp8(raw, name):
            raise CheckpointError(f"tensor {name!r} in {file_of[name]} is {fp8.FP8} but is not a "
                                  "linear layer's weight; forge_jax reads fp8 linear layers only")
        return np.asarray(raw.get(name), np.float32)

    def stored_fp8(name) -> bool:
        return fp8_config is not None and name in tensors and fp8.is_fp8(raw, name)

    def fp8_kernel(name):
        tensors.difference_update((name, name + fp8.SCALE_SUFFIX))
        return fp8.linear_kernel(name, raw, file_of, fp8_config, dtype)

    def take(name, transpose=False, as_dtype=dtype):
        x = array(name)
        return jnp.asarray(x.T if transpose else x, as_dtype)

    def quantized(w):
        if quantize is None:
            return w
        return fj.quantize(w, quantize, group_size=group_size if quantize == "int4" else None)

    def proj(name):  # a projection [out, in]: as stored in fp8, else quantized when asked
        return fp8_kernel(name) if stored_fp8(name) else quantized(take(name))

    def experts(names):
        if stored_fp8(names[0]):
            return fp8.stack_kernels([fp8_kernel(n) for n in names])
        return quantized(jnp.stack([take(n) for n in names]))

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
        name = p + "self_attn.kv_b_proj.weight"
        kv_b = (np.asarray(fj.dequantize(fp8_kernel(name), jnp.float32)) if stored_fp8(name)
                else array(name))
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
    tensors = {k for k in tensors if "mtp" not in k and ".layers." not in k
               or int(k.split(".")[2]) < config.num_hidden_layers}
    if tensors:  # (multi-token prediction layers past num_hidden_layers are not used)
        raise CheckpointError(f"unused tensors in the checkpoint: {sorted(tensors)[:5]}")
    return config, weights


def from_pretrained(path, *, revision: str | None = None, dtype=jnp.float32,
                    quantize: str | None = None, group_size: int | None = None, mesh=None,
                    tp_axis: str = "tp", dp_axis: str = "dp") -> DeepseekV3:
    """The :class:`DeepseekV3` model of a local checkpoint directory or a Hugging Face Hub
    repository id (``ORG/NAME``, fetched into the ``huggingface_hub`` cache; a local
    directory wins): :func:`load`'s weights (``dtype``, ``quantize``, ``group_size``), and
    ``generation_config.json`` (if present) in ``model.generation_config``.
    :func:`forge_jax.models.llama.from_pretrained`, the common entry point, hands
    ``deepseek_v3`` checkpoints here.

    ``mesh``: a ``jax.sharding.Mesh`` (axes named by ``tp_axis`` and ``dp_axis``) or a
    :class:`forge_jax.sharding.MeshConfig` to place the weights on, split as
    :mod:`forge_jax.models.deepseek_sharding` says (``model.mesh`` then holds it); None: one
    device."""
    from forge_jax.models import deepseek_sharding
    from forge_jax.models.checkpoints.generation_config import load_generation_config
    from forge_jax.models.checkpoints.hub import resolve_checkpoint

    directory = resolve_checkpoint(path, revision=revision)
    if mesh is not None:  # refused before the weights are read
        mesh = deepseek_sharding.mesh_config(mesh, tp_axis=tp_axis, dp_axis=dp_axis)
        deepseek_sharding.check(load_config(directory), mesh)
    config, weights = load(directory, dtype, quantize=quantize, group_size=group_size)
    if mesh is not None:
        weights = deepseek_sharding.place(
            weights, deepseek_sharding.weight_shardings(config, weights, mesh))
    model = DeepseekV3(config, weights)
    model.mesh = mesh
    model.generation_config = load_generation_config(directory)
    return model


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
