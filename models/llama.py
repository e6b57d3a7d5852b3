"""A Llama-family decoder in Flax NNX, built only from forge_jax ops.

Covers what Hugging Face's ``LlamaForCausalLM`` configs describe: multi-head, grouped
and multi-query attention, ``head_dim`` different from ``hidden_size //
num_attention_heads``, tied or separate output embeddings, optional attention and MLP
biases, and RoPE with no scaling or with the ``linear`` and ``llama3`` scalings.
Anything else (another architecture, another rope type, another activation) is
refused when the config is read, never run wrongly.

Every numerical step is a forge_jax op (``fj.embedding``, ``fj.rms_norm`` with the
fused residual add, ``fj.rope``, ``fj.attention`` or the KV cache's ``attend``,
``fj.silu_mul``, ``fj.matmul``), so ``fj.use_implementation(...)`` switches the whole
model.

Usage::

    from forge_jax.models import llama
    model = llama.from_pretrained("path/to/hf_llama_dir")
    logits = model(tokens)                                  # [batch, seq, vocab]
    new_tokens = llama.generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=16)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors can read it)
import numpy as np
from flax import nnx
from forge_jax.models import sampling as sampling_lib

import forge_jax as fj
from forge_jax import memory as fj_memory
from forge_jax.kv_cache import BlockManager, ContiguousKVCache, PagedKVCache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)

# Config keys that change the computation and that forge_jax does not implement: refused
# when present with a value other than the harmless one.
_HARMLESS = {
    "pretraining_tp": (None, 1),  # tensor-parallel slicing in training; same maths.
    "attention_dropout": (None, 0.0, 0),
    "mlp_dropout": (None, 0.0, 0),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder, named as in a Hugging Face ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (MHA) and ``head_dim``
    to ``hidden_size // num_attention_heads``. ``rope_scaling`` is a
    :class:`forge_jax.RopeScaling` (an HF-style dict is converted) or None.
    ``eos_token_id`` is an int, a tuple of ints (Llama 3 lists several) or None.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: fj.RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not a multiple of "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim explicitly")
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        _positive_int("num_key_value_heads", self.num_key_value_heads)
        _positive_int("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got head_dim={self.head_dim}")
        if isinstance(self.rope_scaling, Mapping):
            set_("rope_scaling", fj.RopeScaling.from_hf(dict(self.rope_scaling)))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, fj.RopeScaling):
            raise TypeError(f"rope_scaling must be a forge_jax.RopeScaling, a dict or None, "
                            f"got {self.rope_scaling!r}")
        if isinstance(self.eos_token_id, list | tuple):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}: Llama uses 'silu'")
        if self.model_type != "llama":
            raise ValueError(f"unsupported model_type={self.model_type!r}: this is the Llama model")
        if not (isinstance(self.rms_norm_eps, int | float) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a (possibly empty) tuple."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5 format).

        Reads the RoPE settings from the older top-level keys (``rope_theta``,
        ``rope_scaling``) or from the transformers-5 ``rope_parameters`` dict
        (``{"rope_type": ..., "rope_theta": ..., <scaling fields>}``). Keys that do not
        affect inference (``torch_dtype``, ``initializer_range``, ...) are ignored.

        Raises:
          ValueError: another architecture or ``model_type``, an unsupported rope type
            or activation, or a setting forge_jax does not implement.
        """
        config = dict(config)
        model_type = config.get("model_type", "llama")
        architectures = config.get("architectures") or list(SUPPORTED_ARCHITECTURES)
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if model_type != "llama" or unsupported:
            raise ValueError(
                f"unsupported checkpoint: model_type={model_type!r}, "
                f"architectures={architectures!r}; forge_jax's Llama model reads "
                f"model_type 'llama' with architectures {list(SUPPORTED_ARCHITECTURES)}")
        for key, allowed in _HARMLESS.items():
            if config.get(key) not in allowed:
                raise ValueError(f"unsupported config setting {key}={config[key]!r}")
        theta, scaling = _rope_from_hf(config)
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "rope_scaling"}
        kwargs = {k: config[k] for k in fields if k in config and config[k] is not None}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in kwargs]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        return cls(**kwargs, rope_theta=theta, rope_scaling=scaling)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings"}


def _rope_from_hf(config: dict) -> tuple[float, fj.RopeScaling | None]:
    """(rope_theta, scaling) from either HF config format."""
    params = config.get("rope_parameters")
    if params is None:
        theta = config.get("rope_theta", 10000.0)
        rope = config.get("rope_scaling")
    else:
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(f"unsupported rope_parameters {params!r}: expected one flat dict "
                             f"(per-layer-type RoPE is not part of the Llama architecture)")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope = params
    if rope:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in (None, "default") and "factor" in rope:
            raise ValueError(f"rope parameters {rope!r} give a factor but no rope_type")
        unknown = set(rope) - _ROPE_KEYS
        if unknown and kind in ("linear", "llama3", "default", None):
            # e.g. "attention_factor" or "partial_rotary_factor": not part of these types in
            # transformers, and forge_jax will not guess what they mean.
            raise ValueError(f"unsupported rope parameters {sorted(unknown)} in {rope!r}")
    return float(theta), fj.RopeScaling.from_hf(dict(rope) if rope else None)


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------

def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype)


class Linear(nnx.Module):
    """``y = x @ W.T + b``. The one place that knows how projection weights are stored.

    ``kernel`` is ``[out_features, in_features]``, Hugging Face's (torch ``nn.Linear``'s)
    layout, so loading and exporting copy it as is. Contracting ``x``'s last axis with
    the kernel's ``in`` axis reads each output's weights contiguously; batch-1 decode on
    CPU measured ~5-10% faster this way than with an ``[in, out]`` kernel (an A/B of the
    decode step). To try another layout, change ``kernel_from_hf``, ``hf_shape`` and
    ``__call__`` together.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32,
                 parts: tuple[tuple[str, int], ...] | None = None):
        self.in_features, self.out_features = in_features, out_features
        # A fused projection stacks several HF tensors along ``out``: ``parts`` names them
        # with their sizes, e.g. (("q_proj", 512), ("k_proj", 128), ("v_proj", 128)).
        self.parts = parts or ()
        if self.parts and sum(n for _, n in self.parts) != out_features:
            raise ValueError(f"{parts=} do not add up to {out_features=}")
        self.dtype = jnp.dtype(dtype)
        # Drawn as [in, out] and transposed, part by part: the same random model as an
        # [in, out] layout with separate projections (so train_tiny still reproduces).
        sizes = [n for _, n in self.parts] or [out_features]
        self.kernel = nnx.Param(jnp.concatenate(
            [_normal(rngs, (in_features, n), param_dtype).T for n in sizes], axis=0))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    @staticmethod
    def kernel_from_hf(weight: np.ndarray) -> np.ndarray:
        """HF's torch layout ``[out, in]`` -> the stored layout (the same: identity)."""
        return weight

    def hf_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def hf_parts(self) -> tuple[tuple[str, slice], ...]:
        """(HF name suffix, the rows of ``kernel`` / ``bias`` it fills) per fused part."""
        out, start = [], 0
        for name, size in self.parts:
            out.append((name, slice(start, start + size)))
            start += size
        return tuple(out)

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        """The output ``[..., out_features]`` of a fused projection, split into its parts."""
        bounds = np.cumsum([n for _, n in self.parts])[:-1].tolist()
        return tuple(jnp.split(y, bounds, axis=-1))

    def __call__(self, x: jax.Array, *, out_dtype=None) -> jax.Array:
        """x ``[..., in_features]`` -> ``[..., out_features]`` in ``out_dtype`` (default: dtype)."""
        out_dtype = self.dtype if out_dtype is None else out_dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).astype(self.dtype)  # [m, in]
        kernel = self.kernel[...].astype(self.dtype)  # [out, in]
        if self.bias is None:
            y = fj.matmul(x2, kernel, trans_b=True, out_dtype=out_dtype)
        else:
            y = fj.matmul(x2, kernel, trans_b=True, beta=1.0,
                          c=self.bias[...].astype(self.dtype), out_dtype=out_dtype)
        return y.reshape(*lead, self.out_features)


class RMSNorm(nnx.Module):
    """Holds the ``weight`` [dim] of an RMSNorm; the model calls ``fj.rms_norm`` with it."""

    def __init__(self, dim: int, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))


class LlamaAttention(nnx.Module):
    """The q/k/v/o projections of one layer; the attention itself runs in the model loop."""

    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype):
        c = config
        kw = dict(use_bias=c.attention_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # q, k and v in one [q + 2 kv, hidden] weight: one matrix-vector product per decode
        # step instead of three (measured a few percent faster on CPU); loading and export
        # still see HF's q_proj / k_proj / v_proj tensors (see Linear.hf_parts).
        self.qkv_proj = Linear(c.hidden_size, q + 2 * kv,
                               parts=(("q_proj", q), ("k_proj", kv), ("v_proj", kv)), **kw)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, **kw)


class LlamaMLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype):
        c = config
        kw = dict(use_bias=c.mlp_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_up_proj = Linear(  # gate and up fused, like q/k/v
            c.hidden_size, 2 * c.intermediate_size,
            parts=(("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)), **kw)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, **kw)

    def __call__(self, x):
        with jax.named_scope("mlp"):
            gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
            return self.down_proj(fj.silu_mul(gate, up))


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs, dtype, param_dtype):
        self.input_layernorm = RMSNorm(config.hidden_size, param_dtype=param_dtype)
        self.self_attn = LlamaAttention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, param_dtype=param_dtype)
        self.mlp = LlamaMLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


class Llama(nnx.Module):
    """A Llama decoder with its output head (HF ``LlamaForCausalLM``).

    Args:
      config: the :class:`LlamaConfig`.
      rngs: ``nnx.Rngs`` for the random initialisation (normal, std 0.02, as HF's
        ``initializer_range``; norms start at 1, biases at 0).
      dtype: the compute dtype of activations (weights are cast to it at use).
      param_dtype: the storage dtype of the weights.

    Each layer's weights live in their own module (``self.layers[i]``), not in stacked
    ``[layers, ...]`` arrays: indexing a stacked array inside ``jit`` made XLA copy the
    layer's weights on every decode step on CPU.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        c = config
        self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), param_dtype))
        self.layers = nnx.List([
            LlamaDecoderLayer(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, param_dtype=param_dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs, dtype=dtype,
            param_dtype=param_dtype)

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
        _check_tokens(tokens, self.config.vocab_size)
        batch, seq = tokens.shape
        if seq > self.config.max_position_embeddings and not allow_beyond_max_positions:
            raise ValueError(
                f"tokens.shape={tuple(tokens.shape)} has {seq} positions, beyond the model's "
                f"max_position_embeddings={self.config.max_position_embeddings}; pass "
                f"allow_beyond_max_positions=True if its RoPE scaling extends the range")
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

        def attend(i, q, k, v, cache):
            return fj.attention(q, k, v, causal=True), cache

        hidden, _ = self._decoder(tokens, positions, attend, None)
        return self._logits(hidden)

    def forward_cached(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array, cache,
                       *, logits_at: jax.Array | None = None):
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
          cache: a ``forge_jax.kv_cache.ContiguousKVCache`` or ``PagedKVCache`` with
            ``num_hidden_layers`` layers.
          logits_at: optional int32 ``[batch]``: compute logits only at these indices
            of the ``t`` axis (e.g. each prompt's last token), saving the vocabulary
            projection of the others.

        Positions are traced values, so nothing here compares them with
        ``max_position_embeddings``: :func:`generate` does, before it runs.

        Returns:
          ``(logits, cache)``: float32 logits ``[batch, t, vocab]``, or ``[batch, vocab]``
          with ``logits_at``; and the updated cache.
        """
        new_lengths = jnp.maximum(
            cache.lengths.astype(jnp.int32),
            jnp.max(jnp.where(valid, positions.astype(jnp.int32) + 1, 0), axis=1))

        def attend(i, q, k, v, cache):
            cache = cache.write(i, k, v, positions, valid)
            return cache.attend(i, q, q_positions=positions, kv_lengths=new_lengths), cache

        hidden, cache = self._decoder(tokens, positions, attend, cache)
        cache = cache.with_lengths(new_lengths)
        if logits_at is not None:
            hidden = jnp.take_along_axis(hidden, logits_at.astype(jnp.int32)[:, None, None],
                                         axis=1)[:, 0]  # [batch, hidden]
        return self._logits(hidden), cache

    def _decoder(self, tokens, positions, attend: Callable, cache):
        """The layer stack; returns the final-normed hidden states ``[batch, t, hidden]``."""
        c = self.config
        batch, t = tokens.shape
        x = fj.embedding(self.embed_tokens[...], tokens).astype(self.dtype)  # [b, t, d]
        residual = None
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                # Pre-norm block, with the residual add fused into the next norm:
                # residual += delta; y = norm(residual).
                w = layer.input_layernorm.weight[...]
                if residual is None:
                    y, residual = fj.rms_norm(x, w, eps=c.rms_norm_eps), x
                else:
                    y, residual = fj.rms_norm(x, w, eps=c.rms_norm_eps, residual=residual)
                attn = layer.self_attn
                q, k, v = attn.qkv_proj.split(attn.qkv_proj(y))
                q = q.reshape(batch, t, c.num_attention_heads, c.head_dim)
                k = k.reshape(batch, t, c.num_key_value_heads, c.head_dim)
                v = v.reshape(batch, t, c.num_key_value_heads, c.head_dim)
                q = fj.rope(q, positions, theta=c.rope_theta, scaling=c.rope_scaling)
                k = fj.rope(k, positions, theta=c.rope_theta, scaling=c.rope_scaling)
                o, cache = attend(i, q, k, v, cache)  # [b, t, heads, head_dim]
                x = attn.o_proj(o.reshape(batch, t, c.num_attention_heads * c.head_dim))
                y, residual = fj.rms_norm(x, layer.post_attention_layernorm.weight[...],
                                          eps=c.rms_norm_eps, residual=residual)
                x = layer.mlp(y)
        hidden = fj.rms_norm(x, self.norm.weight[...], eps=c.rms_norm_eps, residual=residual)[0]
        return hidden, cache

    def _logits(self, hidden):
        """hidden ``[..., hidden_size]`` -> float32 logits ``[..., vocab]``."""
        with jax.named_scope("lm_head"):
            if self.lm_head is not None:
                return self.lm_head(hidden, out_dtype=jnp.float32)
            lead = hidden.shape[:-1]
            table = self.embed_tokens[...].astype(self.dtype)  # [vocab, hidden]
            logits = fj.matmul(hidden.reshape(-1, hidden.shape[-1]), table, trans_b=True,
                               out_dtype=jnp.float32)
            return logits.reshape(*lead, table.shape[0])


def _check_tokens(tokens, vocab_size):
    if not hasattr(tokens, "dtype") or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an int array, got {tokens!r:.80}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got tokens.shape={tokens.shape}")


# --------------------------------------------------------------------------------------
# Loading Hugging Face checkpoints
# --------------------------------------------------------------------------------------

class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message names the file or tensor."""


# Buffers some older checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _hf_parameters(
    model: Llama,
) -> dict[str, tuple[nnx.Param, tuple[int, ...], Callable, slice | None]]:
    """HF tensor name -> (the parameter, the tensor's HF shape, HF array -> stored array,
    the rows of the parameter it fills: None for all of it, a slice for a fused part)."""
    same = lambda w: w
    out = {"model.embed_tokens.weight": (model.embed_tokens, model.embed_tokens.shape, same,
                                         None),
           "model.norm.weight": (model.norm.weight, model.norm.weight.shape, same, None)}

    def linear(name, lin: Linear):
        if not lin.parts:
            out[f"{name}.weight"] = (lin.kernel, lin.hf_shape(), lin.kernel_from_hf, None)
            if lin.bias is not None:
                out[f"{name}.bias"] = (lin.bias, lin.bias.shape, same, None)
            return
        prefix = name.rsplit(".", 1)[0]
        for part, rows in lin.hf_parts():
            size = rows.stop - rows.start
            out[f"{prefix}.{part}.weight"] = (lin.kernel, (size, lin.in_features),
                                              lin.kernel_from_hf, rows)
            if lin.bias is not None:
                out[f"{prefix}.{part}.bias"] = (lin.bias, (size,), same, rows)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weight = getattr(layer, norm).weight
            out[f"{p}.{norm}.weight"] = (weight, weight.shape, same, None)
        for proj in ("qkv_proj", "o_proj"):
            linear(f"{p}.self_attn.{proj}", getattr(layer.self_attn, proj))
        for proj in ("gate_up_proj", "down_proj"):
            linear(f"{p}.mlp.{proj}", getattr(layer.mlp, proj))
    if model.lm_head is not None:
        linear("lm_head", model.lm_head)
    return out


def _safetensors_files(path: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
    """The checkpoint's files, each with the tensor names the index assigns it (or None)."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files: dict[pathlib.Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names the shard {file.name}, which is missing")
        return files
    if single.is_file():
        return {single: None}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise CheckpointError(
            f"{path} holds only pickle checkpoints (*.bin/*.pt); forge_jax reads safetensors "
            f"only (never pickle). Convert with transformers' save_pretrained(..., "
            f"safe_serialization=True).")
    raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_config(path: str | os.PathLike) -> LlamaConfig:
    """Reads ``path/config.json`` into a :class:`LlamaConfig` (errors name the file)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    try:
        return LlamaConfig.from_hf(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None) -> Llama:
    """Loads a Hugging Face Llama-family checkpoint directory.

    Reads ``config.json`` and ``model.safetensors`` (or the shards named by
    ``model.safetensors.index.json``) with the safetensors library; pickle files are
    never opened. Tensors of any float dtype (bfloat16 included) are cast to
    ``param_dtype``. With ``tie_word_embeddings`` the output head reuses
    ``model.embed_tokens.weight`` (an ``lm_head.weight`` in the file is then ignored,
    as transformers does).

    Args:
      path: the checkpoint directory.
      dtype: compute dtype of the model.
      param_dtype: storage dtype of the weights; defaults to ``dtype``.

    Returns:
      A :class:`Llama` holding the checkpoint's weights.

    Raises:
      CheckpointError (a ValueError): unreadable or unsupported config, missing
        files, or a missing, mis-shaped or unexpected tensor (named in the message).
    """
    from safetensors import SafetensorError, safe_open

    path = pathlib.Path(path)
    config = load_config(path)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
    weights = fj_memory.estimate_inference_memory(config, batch=1, max_len=1,
                                                  param_dtype=param_dtype).weights
    fj_memory.check_fits(weights, what=f"the weights of {path} in {param_dtype.name}")
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype,
                                         param_dtype=param_dtype))
    expected = _hf_parameters(model)
    loaded: set[str] = set()
    fused: dict[int, tuple[nnx.Param, np.ndarray]] = {}
    for file, names in _safetensors_files(path).items():
        try:
            handle = safe_open(file, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from None
        with handle as f:
            keys = set(f.keys())
            if names is not None and set(names) - keys:
                raise CheckpointError(f"{file.name} lacks tensors its index assigns to it: "
                                      f"{sorted(set(names) - keys)[:5]}")
            for name in sorted(keys):
                if name.endswith(_IGNORED_SUFFIXES) or (
                        name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name not in expected:
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {file.name}: not a parameter of a "
                        f"Llama with this config.json")
                param, hf_shape, convert, rows = expected[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(hf_shape):
                    raise CheckpointError(f"tensor {name!r} in {file.name} has shape {shape}, "
                                          f"expected {tuple(hf_shape)} from config.json")
                array = f.get_tensor(name)
                if not np.issubdtype(array.dtype, np.floating) and array.dtype != jnp.bfloat16:
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has dtype {array.dtype}, expected float")
                value = convert(array).astype(param_dtype)
                if rows is None:
                    param.set_value(jnp.asarray(value))
                else:  # A part of a fused parameter: assembled on the host, set below.
                    fused.setdefault(id(param), (param, np.empty(param.shape, param_dtype)))
                    fused[id(param)][1][rows] = value
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:5]}{more}")
    for param, value in fused.values():
        param.set_value(jnp.asarray(value))
    return model


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and in HF's layout, as float32 NumPy
    arrays (the inverse of :func:`from_pretrained`, e.g. to ``save_file`` them)."""
    out = {}
    for name, (param, hf_shape, convert, rows) in _hf_parameters(model).items():
        stored = np.asarray(param[...], np.float32)
        if rows is not None:
            stored = stored[rows]
        # convert maps HF's layout to ours (the identity today); check that it still is.
        if stored.shape != tuple(hf_shape) or not np.array_equal(convert(stored), stored):
            raise ValueError(f"cannot convert {name} of shape {stored.shape} to HF's {hf_shape}")
        out[name] = stored
    return out


# --------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class GenerationStats:
    """Timings and sizes of one :func:`generate_with_stats` call.

    Attributes:
      batch: the number of prompts.
      padded_batch, prompt_bucket, cache_len: the bucketed shapes the steps ran with
        (batch padded to a power of two, prompts padded to a power of two >= 8, cache
        length per sequence).
      cache: "paged" or "contiguous".
      max_new_tokens: the tokens asked for per prompt (0: nothing ran; 1: the prefill
        gives the only token, so there are no decode steps).
      prompt_tokens: prompt tokens summed over the batch (padding excluded).
      new_tokens: tokens returned, summed over the batch.
      decode_tokens: tokens returned that decode steps produced (the first new token of
        each prompt comes from the prefill).
      decode_steps: decode steps run. With ``eos_token_id``, one more than needed when
        every sequence stops early (eos is checked one step behind, so the host never
        stalls the device).
      compile_seconds: tracing and compiling both steps (about 0 when cached).
      prefill_seconds: the prefill step, compilation excluded.
      decode_seconds: all decode steps, compilation excluded.
    """

    batch: int
    padded_batch: int
    prompt_bucket: int
    cache_len: int
    cache: str
    max_new_tokens: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    compile_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens processed per second by the prefill."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second by the decode steps (all sequences together)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _sample(logits, key, temperature, top_p, mode):
    greedy, top_k, use_top_p = mode
    return sampling_lib.sample(logits, key, temperature=0.0 if greedy else temperature,
                               top_k=top_k, top_p=top_p if use_top_p else None)


def _implementation_key():
    """The active implementation preference (``fj.use_implementation``, the environment).

    Ops pick their implementation when traced and jit's cache does not see the
    preference, so the steps take it as a static argument: one compiled step per
    preference.
    """
    return fj.dispatch.current_preference()


_STATIC = ("graphdef", "mode", "implementation_key")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _prefill_step(state, cache, tokens, lengths, key, temperature, top_p, *, graphdef, mode,
                  implementation_key=None):
    """Prefill of right-padded prompts ``tokens`` [batch, t] with ``lengths`` [batch];
    returns the first new token of each prompt (int32 [batch]) and the cache.
    ``mode`` is :attr:`SamplingParams.mode`; temperature and top_p are float32 scalars."""
    model = nnx.merge(graphdef, state)
    batch, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    valid = positions < lengths[:, None]
    logits, cache = model.forward_cached(tokens, positions, valid, cache,
                                         logits_at=jnp.maximum(lengths - 1, 0))
    return _sample(logits, jax.random.fold_in(key, 0), temperature, top_p, mode), cache


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _decode_step(state, cache, tokens, active, key, step, temperature, top_p, *, graphdef, mode,
                 implementation_key=None):
    """One token per sequence: ``tokens`` [batch] at position ``cache.lengths``; rows with
    ``active`` False (batch padding) are not written. Returns (next tokens, cache)."""
    model = nnx.merge(graphdef, state)
    positions = cache.lengths[:, None]  # [batch, 1]
    logits, cache = model.forward_cached(tokens[:, None], positions, active[:, None], cache,
                                         logits_at=jnp.zeros_like(cache.lengths))
    return _sample(logits, jax.random.fold_in(key, step), temperature, top_p, mode), cache


def _check_prompt_array(prompts, vocab_size) -> list[list[int]]:
    """A NumPy or JAX ``[batch, seq]`` integer array of equal-length prompts -> lists."""
    if isinstance(prompts, jax.core.Tracer):
        raise TypeError("prompts must be concrete token ids, not a traced array: generate "
                        "runs its own jitted steps and needs the ids on the host")
    if not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise TypeError(f"prompts must hold integer token ids, got "
                        f"prompts.dtype={np.dtype(prompts.dtype).name}")
    if prompts.ndim != 2:
        hint = " (one prompt: prompts[None])" if prompts.ndim == 1 else ""
        raise ValueError(f"prompts as an array must be [batch, seq], got "
                         f"prompts.shape={tuple(prompts.shape)}{hint}")
    if 0 in prompts.shape:
        raise ValueError(f"prompts must be non-empty, got prompts.shape={tuple(prompts.shape)}")
    ids = np.asarray(prompts)
    lo, hi = int(ids.min()), int(ids.max())  # Python ints: no overflow whatever the dtype
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"prompts has token ids outside [0, {vocab_size}): min {lo}, max {hi}")
    return ids.astype(np.int64).tolist()


def _check_prompts(prompts, vocab_size) -> list[list[int]]:
    if hasattr(prompts, "ndim") and hasattr(prompts, "dtype"):
        return _check_prompt_array(prompts, vocab_size)
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of lists of token ids, got "
                         f"{prompts!r:.80}")
    out = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not (np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompts[{i}] must be a non-empty list of ints, got {prompt!r:.80}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): "
                             f"min {ids.min()}, max {ids.max()}")
        out.append([int(x) for x in ids])
    return out


def check_sequence_length(config: LlamaConfig, prompt_tokens: int, max_new_tokens: int, *,
                          allow_beyond_max_positions: bool = False, what: str = "the prompt"
                          ) -> None:
    """Raises ValueError if ``prompt_tokens + max_new_tokens`` exceeds the config's
    ``max_position_embeddings`` (unless ``allow_beyond_max_positions``, for a model whose
    RoPE scaling extends the range). ``what`` names the prompt in the message."""
    total = prompt_tokens + max_new_tokens
    limit = config.max_position_embeddings
    if total > limit and not allow_beyond_max_positions:
        raise ValueError(
            f"{what} has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} the "
            f"sequence reaches {total} positions, beyond the model's "
            f"max_position_embeddings={limit}. Pass allow_beyond_max_positions=True if its "
            f"RoPE scaling extends the range")


def _cache_plan(batch: int, longest_prompt: int, max_new_tokens: int, cache: str,
                page_size: int) -> tuple[int, int, int, int]:
    """(padded batch, prompt bucket, cache length per sequence, pages per sequence)."""
    padded_batch = _next_pow2(batch)
    prompt_bucket = max(8, _next_pow2(longest_prompt))
    cache_len = _next_pow2(prompt_bucket + max_new_tokens)
    max_pages = -(-cache_len // page_size)
    if cache == "paged":
        cache_len = max_pages * page_size
    return padded_batch, prompt_bucket, cache_len, max_pages


def check_generation_fits(config: LlamaConfig, *, batch: int, longest_prompt: int,
                          max_new_tokens: int, cache: str = "paged", page_size: int = 16,
                          param_dtype=jnp.float32, dtype=jnp.float32, cache_dtype=None) -> None:
    """Raises ``forge_jax.memory.InsufficientMemoryError`` if :func:`generate` with these
    sizes would not fit its KV cache and activations in the device's free memory.

    :func:`generate` runs this check itself; it is public so that a caller can run it
    before building a large batch of prompts (the CLI does, for ``--num-problems``).
    """
    cache_dtype = jnp.dtype(dtype if cache_dtype is None else cache_dtype)
    padded_batch, prompt_bucket, cache_len, max_pages = _cache_plan(
        batch, longest_prompt, max_new_tokens, cache, page_size)
    kv_dim = config.num_key_value_heads * config.head_dim
    if cache == "paged":
        # The pool depends on the bucketed shapes only (so other prompt lengths in the same
        # buckets reuse the compiled steps): room for every row at full length.
        cache_bytes = 2 * config.num_hidden_layers * padded_batch * max_pages * page_size * kv_dim
    else:
        cache_bytes = 2 * config.num_hidden_layers * padded_batch * cache_len * kv_dim
    cache_bytes *= cache_dtype.itemsize
    need = fj_memory.estimate_inference_memory(
        config, batch=padded_batch, max_len=cache_len, prefill_len=prompt_bucket,
        param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype)
    fj_memory.check_fits(cache_bytes + need.activations,
                         what=f"a {cache} KV cache for {padded_batch} x {cache_len} tokens "
                              f"plus activations")


def _eos_set(eos_token_id) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int | np.integer) and not isinstance(eos_token_id, bool):
        return frozenset([int(eos_token_id)])
    if isinstance(eos_token_id, Sequence | set | frozenset) and all(
            isinstance(e, int | np.integer) and not isinstance(e, bool) for e in eos_token_id):
        return frozenset(int(e) for e in eos_token_id)
    raise TypeError(f"eos_token_id must be an int, a collection of ints or None, got "
                    f"{eos_token_id!r}")


def generate_with_stats(model: Llama, prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
                        max_new_tokens: int, *, temperature: float = 0.0,
                        top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                        cache: str = "paged", page_size: int = 16,
                        eos_token_id: int | Sequence[int] | None = None, cache_dtype=None,
                        progress: Callable[[int, int], None] | None = None,
                        allow_beyond_max_positions: bool = False
                        ) -> tuple[list[list[int]], GenerationStats]:
    """:func:`generate`, also returning a :class:`GenerationStats` with the timings.

    ``progress``, when given, is called on the host as ``progress(done, total)`` after
    the prefill and after each decode step (``done`` new tokens per sequence so far,
    ``total = max_new_tokens``), e.g. to drive a progress bar.
    """
    config = model.config
    prompts = _check_prompts(prompts, config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    check_sequence_length(config, len(prompts[longest]), max_new_tokens,
                          allow_beyond_max_positions=allow_beyond_max_positions,
                          what=f"prompts[{longest}]")
    if cache not in ("paged", "contiguous"):
        raise ValueError(f"cache must be 'paged' or 'contiguous', got {cache=!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size=!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) \
            or not -2**63 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [-2**63, 2**63), got {seed=!r}")
    sampling = sampling_lib.SamplingParams(float(temperature), top_k,
                                           None if top_p is None else float(top_p))
    eos = _eos_set(eos_token_id)
    cache_dtype = model.dtype if cache_dtype is None else jnp.dtype(cache_dtype)

    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    padded_batch, prompt_bucket, cache_len, max_pages = _cache_plan(
        batch, int(lengths.max()), max_new_tokens, cache, page_size)
    stats = GenerationStats(batch=batch, padded_batch=padded_batch, prompt_bucket=prompt_bucket,
                            cache_len=cache_len, cache=cache, max_new_tokens=max_new_tokens,
                            prompt_tokens=int(lengths.sum()))
    if max_new_tokens == 0:
        return [[] for _ in prompts], stats

    # Inputs, padded to the bucketed shapes: prompts right-padded with token 0 (never
    # written to the cache), extra batch rows with length 0 (never written either).
    tokens = np.zeros((padded_batch, prompt_bucket), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    padded_lengths = np.zeros((padded_batch,), np.int32)
    padded_lengths[:batch] = lengths
    active = np.arange(padded_batch) < batch

    check_generation_fits(config, batch=batch, longest_prompt=int(lengths.max()),
                          max_new_tokens=max_new_tokens, cache=cache, page_size=page_size,
                          param_dtype=model.param_dtype, dtype=model.dtype,
                          cache_dtype=cache_dtype)

    if cache == "paged":
        num_pages = padded_batch * max_pages
        manager = BlockManager(num_pages, page_size)
        for b in range(batch):
            manager.allocate(b, int(lengths[b]) + max_new_tokens)
        block_tables = np.zeros((padded_batch, max_pages), np.int32)
        block_tables[:batch] = manager.block_tables(list(range(batch)), max_pages)
        kv = PagedKVCache.create(num_layers=config.num_hidden_layers, num_pages=num_pages,
                                 page_size=page_size, kv_heads=config.num_key_value_heads,
                                 head_dim=config.head_dim, dtype=cache_dtype,
                                 block_tables=block_tables)
    else:
        kv = ContiguousKVCache.create(num_layers=config.num_hidden_layers, batch=padded_batch,
                                      max_len=cache_len, kv_heads=config.num_key_value_heads,
                                      head_dim=config.head_dim, dtype=cache_dtype)

    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    tokens, padded_lengths, active = (jnp.asarray(tokens), jnp.asarray(padded_lengths),
                                      jnp.asarray(active))
    step0 = jnp.asarray(1, jnp.int32)
    # Temperature and top_p are arguments, not constants: changing them does not recompile.
    temp = jnp.asarray(sampling.temperature, jnp.float32)
    top_p = jnp.asarray(1.0 if sampling.top_p is None else sampling.top_p, jnp.float32)
    statics = dict(graphdef=graphdef, mode=sampling.mode,
                   implementation_key=_implementation_key())
    # Compile ahead of time (cached by jit after the first call) so that the timings
    # below measure the steps alone.
    start = time.perf_counter()
    prefill = _prefill_step.lower(state, kv, tokens, padded_lengths, key, temp, top_p,
                                  **statics).compile()
    decode = None
    if max_new_tokens > 1:
        decode = _decode_step.lower(state, kv, tokens[:, 0], active, key, step0, temp, top_p,
                                    **statics).compile()
    stats.compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    next_tokens, kv = prefill(state, kv, tokens, padded_lengths, key, temp, top_p)
    next_tokens.block_until_ready()
    stats.prefill_seconds = time.perf_counter() - start
    if progress is not None:
        progress(1, max_new_tokens)

    outputs = [next_tokens]
    done = np.zeros((batch,), bool)
    if eos:
        done |= np.isin(np.asarray(next_tokens)[:batch], list(eos))
    eos_ids = np.asarray(sorted(eos), np.int32)
    unchecked = None  # the latest tokens not yet compared with eos
    start = time.perf_counter()
    for step in range(1, max_new_tokens):
        if done.all():
            break
        next_tokens, kv = decode(state, kv, next_tokens, active, key,
                                 jnp.asarray(step, jnp.int32), temp, top_p)
        outputs.append(next_tokens)
        stats.decode_steps += 1
        if eos:
            # Stopping early needs the tokens on the host. Reading the previous step's
            # while this one is queued keeps the device busy; the cost is at most one
            # step past the last eos, whose tokens are cut off below.
            if unchecked is not None:
                done |= np.isin(np.asarray(unchecked)[:batch], eos_ids)
            unchecked = next_tokens
        if progress is not None:
            progress(step + 1, max_new_tokens)
    jax.block_until_ready(outputs)
    stats.decode_seconds = time.perf_counter() - start if stats.decode_steps else 0.0

    generated = np.stack([np.asarray(t) for t in outputs], axis=1)[:batch]  # [batch, steps]
    results = []
    for row in generated:
        row = [int(t) for t in row]
        for i, t in enumerate(row):
            if t in eos:
                row = row[:i + 1]
                break
        results.append(row)
    stats.new_tokens = sum(len(r) for r in results)
    stats.decode_tokens = stats.new_tokens - batch  # the prefill gave each its first token
    return results, stats


def generate(model: Llama, prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
             max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, cache: str = "paged",
             page_size: int = 16, eos_token_id: int | Sequence[int] | None = None,
             allow_beyond_max_positions: bool = False) -> list[list[int]]:
    """Generates continuations of a batch of prompts of different lengths.

    Runs one jitted prefill over the right-padded prompts, then jitted decode steps of
    one token per sequence, each with the KV cache donated (updated in place). The
    model is split with ``nnx.split`` outside the steps and merged inside, so the
    weights are arguments of the compiled steps, not constants. Shapes are bucketed
    (batch to a power of two, prompt length to a power of two >= 8, cache length to a
    power of two) so that a later call with similar shapes reuses the compiled steps.

    Args:
      model: a :class:`Llama`.
      prompts: a list of token-id lists (each non-empty, ids in ``[0, vocab_size)``), or a
        NumPy or JAX integer array ``[batch, seq]`` of equal-length prompts.
      max_new_tokens: tokens to generate per prompt (>= 0).
      temperature: 0 for greedy decoding; otherwise sampling from
        ``softmax(logits / temperature)`` after the top-k / top-p filters. A temperature
        below float32's smallest normal number (~1.18e-38) is greedy too: float32
        cannot divide by it faithfully, and the distribution it asks for is the argmax.
      top_k: keep the ``top_k`` most likely tokens (None: all).
      top_p: nucleus sampling with Hugging Face's semantics (None: off).
      seed: seed of the ``jax.random`` key used for sampling.
      cache: ``"paged"`` (pages allocated with ``forge_jax.kv_cache.BlockManager`` for
        prompt + ``max_new_tokens`` up front) or ``"contiguous"``. Both give the same
        greedy tokens.
      page_size: tokens per page of the paged cache.
      eos_token_id: an id or a collection of ids; a sequence stops after generating one
        of them, and the eos token *is included* in its output (as transformers'
        ``generate`` returns it). None: always ``max_new_tokens`` tokens. (The model's
        ``config.eos_token_ids`` are not applied unless passed here.)
      allow_beyond_max_positions: run prompts whose length plus ``max_new_tokens``
        exceeds ``config.max_position_embeddings`` (for a model whose RoPE scaling
        extends the range); otherwise they raise ValueError before any work.

    Returns:
      For each prompt, the list of new token ids (the prompt not included).

    Raises:
      ValueError: bad prompts or arguments, or a sequence longer than
        ``config.max_position_embeddings``.
      TypeError: a prompt array of a non-integer dtype.
      forge_jax.memory.InsufficientMemoryError: the KV cache and activations would not fit
        in the device's free memory.

    See :func:`generate_with_stats` for the same call with timings (prefill and decode
    tokens/s) and a progress callback.
    """
    return generate_with_stats(model, prompts, max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, cache=cache,
                               page_size=page_size, eos_token_id=eos_token_id,
                               allow_beyond_max_positions=allow_beyond_max_positions)[0]
