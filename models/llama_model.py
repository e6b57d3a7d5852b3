"""The Llama-family decoder's layers in Flax NNX, built only from forge_jax ops.

The config is in :mod:`forge_jax.models.llama_config`, loading checkpoints in
:mod:`forge_jax.models.checkpoints.hf`, the generation loop in
:mod:`forge_jax.generation.loop`; :mod:`forge_jax.models.llama` gathers them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import KVCache
from forge_jax.models.llama_caches import LlamaCaches
from forge_jax.models.llama_config import (  # noqa: F401  (LlamaConfig: API here too)
    SUPPORTED_ARCHITECTURES,
    LlamaConfig,
)
from forge_jax.models.llama_moe import BiasedMoe, ScaledInputMoe, SparseMoe
from forge_jax.models.llama_positions import layer_positions
from forge_jax.models.output_head import check_tokens, output_logits

# --------------------------------------------------------------------------------------
# Modules hold their weights; head_dim, RoPE and eps come with each call (the config).
# What a module holds besides arrays is in the graphdef, a static argument of the jitted
# steps, which jit hashes on every call: the chat session's per-token decode step, where a
# 30-layer graphdef already takes ~1 ms to hash on CPU.

def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Part:
    """One Hugging Face tensor inside a fused projection.

    Attributes:
      name: the HF name suffix, e.g. ``"k_proj"``.
      rows: its rows in the checkpoint (its ``out`` features).
      unit: rows per head (the block that ``repeat`` copies).
      repeat: each block of ``unit`` rows is stored ``repeat`` times in a row (KV heads
        replicated for tensor parallelism; 1 otherwise).
    """

    name: str
    rows: int
    unit: int = 1
    repeat: int = 1

    @property
    def stored_rows(self) -> int:
        return self.rows * self.repeat


class Linear(nnx.Module):
    """``y = x @ W.T + b``. The one place that knows how projection weights are stored.

    ``kernel`` is ``[out_features, in_features]``, Hugging Face's (torch ``nn.Linear``'s)
    layout, so loading and exporting copy it as is. Contracting ``x``'s last axis with
    the kernel's ``in`` axis reads each output's weights contiguously; batch-1 decode on
    CPU measured ~5-10% faster this way than with an ``[in, out]`` kernel (an A/B of the
    decode step). To try another layout, change ``kernel_from_hf``, ``hf_shape`` and
    ``__call__`` together.

    A fused projection (``parts``) stacks several HF tensors along ``out``. With
    ``groups > 1`` (tensor parallelism over ``groups`` devices) the rows are stored group
    by group, each group holding its share of every part: ``[q_0 k_0 v_0 | q_1 k_1 v_1
    | ...]``, so that splitting ``out`` evenly across devices gives each device whole
    heads of every part. ``groups == 1`` is the plain ``[q | k | v]`` layout.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32,
                 parts: tuple[Part | tuple[str, int], ...] | None = None, groups: int = 1):
        self.in_features, self.out_features = in_features, out_features
        # e.g. (Part("q_proj", 512), Part("k_proj", 128), Part("v_proj", 128)); a plain
        # (name, rows) pair is a part stored once.
        self.parts = tuple(p if isinstance(p, Part) else Part(*p) for p in parts or ())
        self.groups = groups
        if self.parts and sum(p.stored_rows for p in self.parts) != out_features:
            raise ValueError(f"{parts=} do not add up to {out_features=}")
        if any(p.stored_rows % groups for p in self.parts) or out_features % groups:
            raise ValueError(f"{parts=} ({out_features=}) do not split into {groups=}")
        self.dtype = jnp.dtype(dtype)
        # Drawn as [in, out] and transposed, part by part: the same random model as an
        # [in, out] layout with separate projections (so train_tiny still reproduces).
        sizes = [p.stored_rows for p in self.parts] or [out_features]
        kernel = jnp.concatenate(
            [_normal(rngs, (in_features, n), param_dtype).T for n in sizes], axis=0)
        if self.parts and groups > 1:
            kernel = kernel[self._order()]
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    @staticmethod
    def kernel_from_hf(weight: np.ndarray) -> np.ndarray:
        """HF's torch layout ``[out, in]`` -> the stored layout (the same: identity)."""
        return weight

    def hf_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def _order(self) -> np.ndarray:
        """Stored row -> row of the parts concatenated (``[q | k | v]``, copies included)."""
        starts = np.cumsum([0] + [p.stored_rows for p in self.parts])
        return np.concatenate([
            np.arange(start + g * (p.stored_rows // self.groups),
                      start + (g + 1) * (p.stored_rows // self.groups))
            for g in range(self.groups)
            for p, start in zip(self.parts, starts, strict=False)])

    def hf_rows(self) -> tuple[tuple[str, np.ndarray, np.ndarray], ...]:
        """Per fused part: (HF name suffix, stored rows, the HF rows they hold).

        Loading sets ``kernel[stored] = hf[source]``; a part stored with ``repeat > 1``
        lists each HF row several times.
        """
        position = np.empty(self.out_features, np.int64)  # concatenated row -> stored row
        position[self._order()] = np.arange(self.out_features)
        out, start = [], 0
        for p in self.parts:
            logical = np.arange(p.stored_rows)
            source = (logical // (p.unit * p.repeat)) * p.unit + logical % p.unit
            out.append((p.name, position[start:start + p.stored_rows], source))
            start += p.stored_rows
        return tuple(out)

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        """The output ``[..., out_features]`` of a fused projection, split into its parts
        (each ``[..., part.stored_rows]``)."""
        lead = y.shape[:-1]
        blocks = y.reshape(*lead, self.groups, self.out_features // self.groups)
        bounds = np.cumsum([p.stored_rows // self.groups for p in self.parts])[:-1].tolist()
        return tuple(part.reshape(*lead, -1) for part in jnp.split(blocks, bounds, axis=-1))

    def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
        """x ``[..., in_features]`` -> ``[..., out_features]`` in ``out_dtype`` (default: dtype)."""
        out_dtype = self.dtype if out_dtype is None else out_dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).astype(self.dtype)  # [m, in]
        kernel = self.kernel.get_value()
        # A quantized kernel (forge_jax.QuantizedArray, from_pretrained(quantize=...)) is
        # dequantized inside the product; a float one is cast to the compute dtype.
        if not isinstance(kernel, fj.QuantizedArray):
            kernel = kernel.astype(self.dtype)  # [out, in]
        if self.bias is None:
            y = fj.matmul(x2, kernel, trans_b=True, out_dtype=out_dtype)
        else:
            y = fj.matmul(x2, kernel, trans_b=True, beta=1.0,
                          c=self.bias[...].astype(self.dtype), out_dtype=out_dtype)
        return y.reshape(*lead, self.out_features)


class RMSNorm(nnx.Module):
    """An RMSNorm's ``weight`` [dim], applied with ``fj.rms_norm`` (float32 math)."""

    def __init__(self, dim: int, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, residual: jax.Array | None = None, *, eps: float,
                 offset: float = 0.0):
        """``x`` [..., dim] -> ``y`` [..., dim]; with ``residual`` [..., dim], the fused
        residual add: ``(y, h)`` with ``h = x + residual`` and ``y`` its norm. The scale is
        ``offset + weight`` (Gemma stores ``weight - 1``: ``offset=1``), added in float32
        as Gemma does."""
        weight = self.weight[...]
        if offset:
            weight = weight.astype(jnp.float32) + offset
        return fj.rms_norm(x, weight, eps=eps, residual=residual)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How a model's weights are laid out for tensor parallelism.

    Attributes:
      groups: devices on the tensor axis (1: one device). Fused projections store their
        rows group by group (see :class:`Linear`).
      kv_repeat: each KV head is stored this many times in a row, for a tensor axis
        larger than the number of KV heads (each device then holds one copy of the KV
        head its query heads read). 1: no copies.

    :func:`forge_jax.models.llama_sharding.layout_for` gives the layout for a mesh.
    """

    groups: int = 1
    kv_repeat: int = 1


# attend(q, k, v, cache) -> (o, cache): the attention of one layer, over the new keys
# alone or over a KV cache they are first written into. q ``[batch, t, heads, head_dim]``,
# k and v ``[batch, t, kv_heads, head_dim]`` (RoPE applied), o like q; ``cache`` is
# whatever the caller threads through the layers (None without a cache).
Attend = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class LlamaAttention(nnx.Module):
    """Grouped-query self-attention: the fused q/k/v projection, the per-head q and k
    norms (``config.qk_norm``), RoPE (over the first ``config.rotary_dim`` dimensions),
    the attention (``attend``, which the caller gives) and the output projection."""

    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype,
                 layout: TensorLayout = TensorLayout()):
        c = config
        kw = dict(use_bias=c.attention_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        qkv_kw = dict(kw, use_bias=c.attention_bias or c.qkv_bias)
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # q, k and v in one [q + 2 kv, hidden] weight: one matrix-vector product per decode
        # step instead of three (measured a few percent faster on CPU); loading and export
        # still see HF's q_proj / k_proj / v_proj tensors (see Linear.hf_rows).
        kv_part = functools.partial(Part, rows=kv, unit=c.head_dim, repeat=layout.kv_repeat)
        self.qkv_proj = Linear(c.hidden_size, q + 2 * kv * layout.kv_repeat,
                               parts=(Part("q_proj", q), kv_part("k_proj"), kv_part("v_proj")),
                               groups=layout.groups, **qkv_kw)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, **kw)
        self.q_norm = RMSNorm(c.head_dim, param_dtype=param_dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, param_dtype=param_dtype) if c.qk_norm else None
        # gpt-oss: a learned logit per query head in the softmax's denominator
        self.sinks = nnx.Param(jnp.zeros((c.num_attention_heads,), param_dtype)) if (
            c.attention_sinks) else None

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend, cache: Any = None,
                 *, config: LlamaConfig, layer: int = 0, rows: jax.Array | None = None
                 ) -> tuple[jax.Array, Any]:
        """Self-attention of ``x``.

        Args:
          x: ``[batch, t, hidden_size]``, the normed hidden states.
          positions: int32 ``[batch, t]``, each token's absolute position (for RoPE).
          attend: the attention itself (:data:`Attend`): ``fj.attention`` for a full
            forward, or a KV cache's write and ``attend`` for this layer.
          cache: passed to ``attend`` and returned as it returns it.
          config: the model's config (head_dim, RoPE).
          layer: this layer's index (its RoPE base: :meth:`LlamaConfig.layer_rope`).
          rows: optional int32 ``[batch, n]``: only these tokens' outputs are wanted.
            Keys and values are still made (and cached) for all ``t`` tokens, but only
            these rows query (``attend`` is then called with ``rows=rows``).

        Returns:
          ``(out, cache)``: ``out`` ``[batch, t, hidden_size]`` (``[batch, n, ...]``
          with ``rows``).
        """
        batch, t, _ = x.shape
        c = config
        with jax.named_scope("attention"):
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
            # [batch, t, heads, head_dim]; k and v have the layout's KV heads (copies
            # included), which the weights' shape gives.
            q = q.reshape(batch, t, c.num_attention_heads, c.head_dim)
            k = k.reshape(batch, t, -1, c.head_dim)
            v = v.reshape(batch, t, -1, c.head_dim)
            if self.q_norm is not None:  # RMSNorm over each head, before RoPE
                q = self.q_norm(q, eps=c.rms_norm_eps, offset=c.norm_offset)
                k = self.k_norm(k, eps=c.rms_norm_eps, offset=c.norm_offset)
            theta, scaling = c.layer_rope(layer)
            rope = layer_positions(c, layer)  # RoPE, or NoPE, and Llama 4's variants
            k = rope(k, positions, c.rotary_dim, theta, scaling, key=True)
            if self.sinks is not None:
                attend = functools.partial(attend, sinks=self.sinks[...].astype(jnp.float32))
            if rows is None:
                q = rope(q, positions, c.rotary_dim, theta, scaling)
                o, cache = attend(q, k, v, cache)  # [batch, t, heads, head_dim]
            else:
                q = rope(_take_rows(q, rows), _take_rows(positions, rows), c.rotary_dim,
                         theta, scaling)
                o, cache = attend(q, k, v, cache, rows=rows)  # [batch, n, heads, head_dim]
            return self.o_proj(o.reshape(batch, -1, c.num_attention_heads * c.head_dim)), cache


def _take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """``x`` ``[batch, t, ...]`` at the tokens ``rows`` ``[batch, n]``: ``[batch, n, ...]``."""
    index = rows.astype(jnp.int32).reshape(rows.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


class LlamaMLP(nnx.Module):
    """``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or tanh-GELU (GeGLU), of
    width ``intermediate_size`` (default: the config's; a shared expert's its own)."""

    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype,
                 layout: TensorLayout = TensorLayout(), intermediate_size: int | None = None):
        c = config
        inter = c.intermediate_size if intermediate_size is None else intermediate_size
        kw = dict(use_bias=c.mlp_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_up_proj = Linear(  # gate and up fused, like q/k/v
            c.hidden_size, 2 * inter, parts=(("gate_proj", inter), ("up_proj", inter)),
            groups=layout.groups, **kw)
        self.down_proj = Linear(inter, c.hidden_size, **kw)
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` [..., hidden_size] -> [..., hidden_size]."""
        with jax.named_scope("mlp"):
            gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
            act = fj.gelu_tanh_mul if self.gelu else fj.silu_mul
            return self.down_proj(act(gate, up))


class LlamaDecoderLayer(nnx.Module):
    """A pre-norm decoder block: ``h += attention(norm(h)); h += mlp(norm(h))``; with
    ``config.sandwich_norms`` (Gemma 2 and 3), ``h += norm(attention(norm(h))); h +=
    norm(mlp(norm(h)))``.

    The residual adds are fused into the norms (``fj.rms_norm(x, w, residual=h)`` adds
    and normalises in one op), so a layer returns its MLP output unadded, with the
    residual stream beside it; the next layer's input norm (or the model's final norm)
    adds them.

    Layer ``layer`` of a mixture of experts (``config.is_moe(layer)``) has a
    :class:`~forge_jax.models.llama_moe.SparseMoe` as its ``mlp``.
    """

    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype,
                 layout: TensorLayout = TensorLayout(), layer: int = 0):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, layout=layout)
        # Named as in HF: without sandwich norms, post_attention_layernorm is the MLP's input
        # norm; with them, it norms the attention's output and pre_feedforward_layernorm is
        # the MLP's input norm.
        norm = functools.partial(RMSNorm, config.hidden_size, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, **kw)
        self.post_attention_layernorm = norm()
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = norm() if sandwich else None
        self.post_feedforward_layernorm = norm() if sandwich else None
        if config.is_moe(layer) and config.expert_bias:
            self.mlp = BiasedMoe(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        elif config.is_moe(layer) and config.sigmoid_router:
            self.mlp = ScaledInputMoe(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                      shared_expert=LlamaMLP(
                                          config, intermediate_size=(
                                              config.shared_expert_intermediate_size), **kw))
        elif config.is_moe(layer):
            shared = config.shared_expert_intermediate_size
            self.mlp = SparseMoe(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                 shared_expert=None if shared is None else LlamaMLP(
                                     config, intermediate_size=shared, **kw))
        else:
            self.mlp = LlamaMLP(config, **kw)

    def norms(self) -> dict[str, RMSNorm]:
        """HF name (under the layer) -> each RMSNorm of the layer, q and k norms included."""
        out = {name: getattr(self, name) for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm") if getattr(self, name) is not None}
        if self.self_attn.q_norm is not None:
            out["self_attn.q_norm"] = self.self_attn.q_norm
            out["self_attn.k_norm"] = self.self_attn.k_norm
        return out

    def __call__(self, x: jax.Array, residual: jax.Array | None, positions: jax.Array,
                 attend: Attend, cache: Any = None, *, config: LlamaConfig, layer: int = 0,
                 rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Any]:
        """One block.

        Args:
          x: ``[batch, t, hidden_size]``: the previous layer's MLP output, not yet added
            to ``residual``; for the first layer, the embeddings (``residual`` None).
          residual: ``[batch, t, hidden_size]``, the residual stream, or None.
          positions, attend, cache, config, layer, rows: as
            :meth:`LlamaAttention.__call__` takes them.

        Returns:
          ``(mlp_out, residual, cache)``: the MLP output (to add to ``residual``) and the
          residual stream, both ``[batch, t, hidden_size]`` (``[batch, n, ...]``, the
          tokens ``rows``, with ``rows``); the cache ``attend`` returned.
        """
        kw = dict(eps=config.rms_norm_eps, offset=config.norm_offset)
        if residual is None:
            y, residual = self.input_layernorm(x, **kw), x
        else:
            y, residual = self.input_layernorm(x, residual, **kw)
        x, cache = self.self_attn(y, positions, attend, cache, config=config, layer=layer,
                                  rows=rows)
        if rows is not None:
            residual = _take_rows(residual, rows)
        if self.pre_feedforward_layernorm is None:
            y, residual = self.post_attention_layernorm(x, residual, **kw)
            return self.mlp(y), residual, cache
        x = self.post_attention_layernorm(x, **kw)
        y, residual = self.pre_feedforward_layernorm(x, residual, **kw)
        return self.post_feedforward_layernorm(self.mlp(y), **kw), residual, cache


class Llama(LlamaCaches, nnx.Module):
    """A Llama decoder with its output head (HF ``LlamaForCausalLM``), or a decoder of
    another family the config describes (:mod:`forge_jax.models.families`).

    Args:
      config: the :class:`LlamaConfig`.
      rngs: ``nnx.Rngs`` for the random initialisation (normal, std 0.02, as HF's
        ``initializer_range``; norms start at 1, biases at 0).
      dtype: the compute dtype of activations (weights are cast to it at use).
      param_dtype: the storage dtype of the weights.
      layout: the :class:`TensorLayout` of the weights (default: one device). A model
        sharded over a mesh (:func:`forge_jax.models.llama_sharding.shard`) has its
        tensor axis's layout and carries the mesh in ``mesh``.

    Attributes set after construction: ``mesh`` (the sharding MeshConfig, None on one
    device) and ``generation_config`` (``from_pretrained``'s :class:`GenerationConfig`,
    whose eos ids ``generate`` stops at by default).

    Each layer's weights live in their own module (``self.layers[i]``), not in stacked
    ``[layers, ...]`` arrays: indexing a stacked array inside ``jit`` made XLA copy the
    layer's weights on every decode step on CPU.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, layout: TensorLayout = TensorLayout()):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.layout = layout
        self.mesh = None
        self.generation_config = None
        c = config
        self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), param_dtype))
        self.layers = nnx.List([
            LlamaDecoderLayer(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype, layout=layout,
                              layer=i)
            for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs, dtype=dtype,
            param_dtype=param_dtype)

    @property
    def kv_heads(self) -> int:
        """KV heads in the KV cache: the config's, times ``layout.kv_repeat``."""
        return self.config.num_key_value_heads * self.layout.kv_repeat

    def __call__(self, tokens: jax.Array, *, allow_beyond_max_positions: bool = False
                 ) -> jax.Array:
        """Full causal forward without a cache.

        Args:
          tokens: int32 ``[batch, seq]``, token ``t`` at position ``t``.
          allow_beyond_max_positions: run a ``seq`` longer than the config's
            ``max_position_embeddings`` (for a RoPE scaling that extends the range);
            otherwise such a sequence raises ValueError.

        Returns:
          float32 logits ``[batch, seq, vocab_size]``.
        """
        check_tokens(tokens, self.config.vocab_size)
        batch, seq = tokens.shape
        if seq > self.config.max_position_embeddings and not allow_beyond_max_positions:
            raise ValueError(
                f"tokens.shape={tuple(tokens.shape)} has {seq} positions, beyond the model's "
                f"max_position_embeddings={self.config.max_position_embeddings}; pass "
                f"allow_beyond_max_positions=True if its RoPE scaling extends the range")
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

        def attend(i, q, k, v, cache, **kw):
            return fj.attention(q, k, v, causal=True, **kw), cache

        hidden, _ = self._decoder(tokens, positions, attend, None)
        return self._logits(hidden)

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                       cache: KVCache, *, logits_at: jax.Array | None = None,
                       empty_cache: bool = False) -> tuple[jax.Array, KVCache]:
        """Forward over new tokens that attend to themselves and to a KV cache.

        Each layer writes the new keys/values into ``cache`` at ``positions`` (padding,
        ``valid == False``, is not written) and attends with the cache's ``attend``:
        a query at position ``p`` of sequence ``b`` sees the cached keys ``0..p`` of that
        sequence. After the call ``cache.lengths[b]`` is ``max(old length, 1 + the
        largest valid position of b)``.

        Args:
          tokens: int32 ``[batch, t]``.
          positions: int32 ``[batch, t]``, absolute positions (contiguous per sequence,
            continuing the cache: the first new position of ``b`` is ``cache.lengths[b]``).
          valid: bool ``[batch, t]``; False marks padding.
          cache: a :class:`forge_jax.kv_cache.KVCache` with ``num_hidden_layers`` layers
            (``ContiguousKVCache``, ``PagedKVCache``, or the serving step's
            ``RaggedBatchCache``, whose one packed row holds many sequences); only the
            contract's members are called.
          logits_at: optional int32 ``[batch]``: compute logits only at these indices
            of the ``t`` axis (e.g. each prompt's last token), saving the vocabulary
            projection of the others.
          empty_cache: static; True promises that the cache holds no token yet
            (``cache.lengths`` all 0) and that each row's valid tokens come first, at
            positions ``0, 1, ...`` (a prompt right-padded, as :func:`generate`'s
            prefill has it). The tokens then attend to themselves alone with
            ``fj.attention`` (causal), instead of reading back the cache's whole
            capacity; the cache is written all the same. A valid token never sees the
            padding after it, so the result is the cached path's.

        Positions are traced values, so nothing here compares them with
        ``max_position_embeddings``: :func:`generate` does, before it runs.

        Returns:
          ``(logits, cache)``: float32 logits ``[batch, t, vocab]``, or ``[batch, vocab]``
          with ``logits_at``; and the updated cache.
        """
        new_lengths = jnp.maximum(
            cache.lengths.astype(jnp.int32),
            jnp.max(jnp.where(valid, positions.astype(jnp.int32) + 1, 0), axis=1))

        def attend(i, q, k, v, cache: KVCache, rows=None, **kw):
            cache = cache.write(i, k, v, positions, valid)
            q_positions = positions if rows is None else _take_rows(positions, rows)
            if empty_cache:
                # The keys as the cache holds them (its dtype, quantized and dequantized
                # for a quantized cache), as decode will read them.
                k, v = cache.as_stored(k), cache.as_stored(v)
                if rows is None:
                    return fj.attention(q, k, v, causal=True, **kw), cache
                # (key j sits at position j: the cache was empty)
                return fj.attention(q, k, v, causal=True, q_positions=q_positions,
                                    **kw), cache
            return cache.attend(i, q, q_positions=q_positions, kv_lengths=new_lengths,
                                **kw), cache

        # Only the tokens whose logits are asked for go past the last layer's keys and
        # values: its queries, attention output and MLP serve no other token.
        last_rows = None
        if logits_at is not None and logits_at.ndim == 1 and tokens.shape[1] > 1:
            last_rows = logits_at.astype(jnp.int32)[:, None]
        hidden, cache = self._decoder(tokens, positions, attend, cache, last_rows)
        if last_rows is not None:
            return self._logits(hidden[:, 0]), cache.with_lengths(new_lengths)
        cache = cache.with_lengths(new_lengths)
        # logits_at may also be [batch, n], n indices per row (the serving step's one packed
        # row: each sequence's last token): the logits are then [batch, n, vocab].
        if logits_at is not None and logits_at.ndim == 2:
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, :, None],
                                         axis=1)  # [batch, n, hidden]
        elif logits_at is not None:
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, None, None],
                                         axis=1)[:, 0]  # [batch, hidden]
        return self._logits(hidden), cache

    def _decoder(self, tokens, positions, attend: Callable, cache, last_rows=None):
        """The layer stack; returns the final-normed hidden states ``[batch, t, hidden]``
        (``[batch, n, hidden]``, the tokens ``last_rows`` ``[batch, n]``, with those:
        the last layer computes its keys and values for every token and the rest for
        these alone)."""
        # On a mesh, the ops run per shard there (forge_jax.sharding); the model is the same.
        with fj.sharding.use_mesh(self.mesh):
            return self._layers(tokens, positions, attend, cache, last_rows)

    def _layers(self, tokens, positions, attend: Callable, cache, last_rows=None):
        batch = tokens.shape[0]
        x = fj.embedding(self.embed_tokens[...], tokens).astype(self.dtype)  # [b, t, d]
        if self.config.scale_embeddings:  # Gemma: sqrt(hidden) rounded to the dtype, as HF
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.dtype)
        if self.mesh is not None:  # the batch rows stay on their data-axis shard throughout
            rows = self.mesh.batch_axis(batch)
            x = jax.lax.with_sharding_constraint(x, self.mesh.sharding(rows, None, None))
        residual = None
        c = self.config
        for i, layer in enumerate(self.layers):
            # The layer's attention settings are Python values: the loop is unrolled into
            # one program, so sliding and global layers compile once, together.
            kw = dict(scale=c.attention_scale, sliding_window=c.layer_window(i),
                      logits_soft_cap=c.attn_logit_softcapping)
            if c.layer_chunk(i) is not None:  # Llama 4's chunked layers
                kw["attention_chunk_size"] = c.layer_chunk(i)
            last = i == len(self.layers) - 1
            with jax.named_scope(f"layer_{i}"):
                x, residual, cache = layer(x, residual, positions,
                                           functools.partial(attend, i, **kw), cache,
                                           config=c, layer=i,
                                           rows=last_rows if last else None)
        hidden = self.norm(x, residual, eps=c.rms_norm_eps, offset=c.norm_offset)[0]
        return hidden, cache

    def _logits(self, hidden):
        """hidden ``[..., hidden_size]`` -> float32 logits ``[..., vocab]``."""
        return output_logits(hidden, self.lm_head, self.embed_tokens, self.dtype,
                             self.config.final_logit_softcapping)
