"""The gated delta-rule linear-attention layer of Qwen3-Next and Qwen3.5 (Gated DeltaNet), as a
Flax NNX module composed of public ops (:func:`forge_jax.causal_conv1d`,
:func:`forge_jax.gated_delta_gates`, :func:`forge_jax.gated_delta_rule`).

Per token: projections to ``q, k`` (``k_heads`` of ``dk``), ``v`` and the output gate ``z``
(``v_heads`` of ``dv``) and the gate inputs ``a, b`` (per value head); a depthwise causal
convolution with SiLU over ``[q | k | v]``; the gated delta rule from the layer's state; an
RMSNorm of each head's output times ``silu(z)``; the output projection. With a
:class:`~forge_jax.kv_cache.contract.StateCache` the layer reads its states from the cache
and writes back what the ops return, so a sequence continues across calls; the convolution
and the delta rule run on one row per sequence as the cache lays them out (the serving
engine's packed row gathered per sequence, ``to_sequences``), the projections on the step's
rows as they come.

The weights are stored as Qwen3.5 names them (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``: plain ``[q | k | v]`` and per-head rows); Qwen3-Next's fused, key-head-grouped
``in_proj_qkvz`` and ``in_proj_ba`` are reordered into them when loaded
(:func:`load_hf`). For tensor parallelism over ``groups`` devices
(:mod:`forge_jax.models.qwen3_next_sharding`) the ``[q | k | v]`` rows of ``in_proj_qkv``,
and the convolution's channels with them, are stored group by group (``[q_0 k_0 v_0 | q_1
k_1 v_1 | ...]``, :class:`~forge_jax.models.llama_model.Linear`'s layout), so that an even
split gives each device whole key heads and their value heads; the convolution is per
channel, so it runs on that order as well as on the plain one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.models.llama_model import Linear, Part


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The sizes of a gated delta-rule layer (a Qwen3-Next / Qwen3.5 ``config.json``'s
    ``linear_*`` keys) and the prefill's chunk size."""

    hidden_size: int
    k_heads: int
    v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        if self.v_heads % self.k_heads:
            raise ValueError(f"linear_num_value_heads={self.v_heads} must be a multiple of "
                             f"linear_num_key_heads={self.k_heads}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **kwargs) -> GatedDeltaNetConfig:
        return cls(hidden_size=config["hidden_size"], k_heads=config["linear_num_key_heads"],
                   v_heads=config["linear_num_value_heads"],
                   k_head_dim=config["linear_key_head_dim"],
                   v_head_dim=config["linear_value_head_dim"],
                   conv_kernel=config.get("linear_conv_kernel_dim", 4),
                   rms_norm_eps=config.get("rms_norm_eps", 1e-6), **kwargs)

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedDeltaNet(nnx.Module):
    """One gated delta-rule layer (module docstring); ``groups``: the tensor-parallel
    groups its ``[q | k | v]`` rows and convolution channels are stored in (1: one device),
    a divisor of the key heads."""

    def __init__(self, config: GatedDeltaNetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, groups: int = 1):
        self.config = config
        c = config
        if groups < 1 or c.k_heads % groups:
            raise ValueError(f"linear_num_key_heads={c.k_heads} does not split into "
                             f"{groups=} groups")
        lin = dict(use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.in_proj_qkv = Linear(c.hidden_size, c.conv_dim, parts=(
            Part("q", c.key_dim, c.k_head_dim), Part("k", c.key_dim, c.k_head_dim),
            Part("v", c.value_dim, c.v_head_dim)), groups=groups, **lin)
        self.in_proj_z = Linear(c.hidden_size, c.value_dim, **lin)
        self.in_proj_b = Linear(c.hidden_size, c.v_heads, **lin)
        self.in_proj_a = Linear(c.hidden_size, c.v_heads, **lin)
        self.out_proj = Linear(c.value_dim, c.hidden_size, **lin)
        # [kernel, conv_dim]: fj.causal_conv1d's layout (PyTorch's [conv_dim, 1, kernel]
        # transposed).
        self.conv_weight = nnx.Param((0.3 * jax.random.normal(
            rngs.params(), (c.conv_kernel, c.conv_dim), jnp.float32)).astype(param_dtype))
        self.dt_bias = nnx.Param(jnp.ones((c.v_heads,), param_dtype))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, c.v_heads)).astype(param_dtype))
        self.norm_weight = nnx.Param(jnp.ones((c.v_head_dim,), param_dtype))
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array, *, cache: Any = None, layer: int = 0,
                 lengths: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """``x`` ``[batch, t, hidden]`` (right-padded after ``lengths[b]`` tokens) -> ``(y
        [batch, t, hidden], cache)``; the states come from and go back to ``cache`` (a
        :class:`~forge_jax.kv_cache.contract.StateCache`, layer ``layer``), or start from
        zeros when it is None."""
        c = self.config
        batch, t, _ = x.shape
        if cache is None:
            conv_state, state = None, None
        else:
            conv_state, state = cache.read(layer)
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(batch, t, c.v_heads, c.v_head_dim)
        g, beta = fj.gated_delta_gates(self.in_proj_a(x), self.in_proj_b(x), self.A_log[...],
                                       self.dt_bias[...])
        if cache is not None:  # one row per sequence (a packed row's sequences gathered)
            mixed, g, beta = (cache.to_sequences(a) for a in (mixed, g, beta))
            lengths = cache.sequence_lengths(lengths)
        seqs, span = mixed.shape[:2]
        mixed, conv_state = fj.causal_conv1d(mixed, self.conv_weight[...],
                                             state=conv_state, lengths=lengths)
        q, k, v = self.in_proj_qkv.split(mixed)  # the stored order -> [q], [k], [v]
        out, state = fj.gated_delta_rule(
            q.reshape(seqs, span, c.k_heads, c.k_head_dim),
            k.reshape(seqs, span, c.k_heads, c.k_head_dim),
            v.reshape(seqs, span, c.v_heads, c.v_head_dim), g, beta, state=state,
            lengths=lengths, chunk_size=c.chunk_size)
        if cache is not None:
            out = cache.from_sequences(out, t)  # [batch, t, v_heads, v_head_dim]
        # The gated RMSNorm: weight * norm(out) rounded to the compute dtype, times silu(z)
        # in float32 (transformers' Qwen3NextRMSNormGated).
        normed = fj.rms_norm(out, self.norm_weight[...], eps=c.rms_norm_eps)
        gated = (normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(
            self.dtype)
        y = self.out_proj(gated.reshape(batch, t, c.value_dim))
        if cache is not None:
            cache = cache.write_state(layer, conv_state, state)
        return y, cache


def stored_channels(module: GatedDeltaNet) -> np.ndarray:
    """Stored channel -> channel of the plain ``[q | k | v]`` order, for ``in_proj_qkv``'s
    rows and the convolution's channels (the identity with one group)."""
    lin, out, start = module.in_proj_qkv, np.empty(module.config.conv_dim, np.int64), 0
    for part, (_, stored, source) in zip(lin.parts, lin.hf_rows(), strict=True):
        out[stored] = start + source
        start += part.rows
    return out


def load_hf(module: GatedDeltaNet, weights: Mapping[str, np.ndarray], prefix: str) -> None:
    """Sets ``module``'s parameters from a checkpoint's tensors under ``prefix`` (e.g.
    ``"model.layers.0.linear_attn."``): Qwen3.5's names as they are, Qwen3-Next's fused
    ``in_proj_qkvz`` / ``in_proj_ba`` reordered from their key-head groups."""
    c = module.config

    def put(param: nnx.Param, value: np.ndarray) -> None:
        value = np.asarray(value)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{prefix}: a tensor of shape {value.shape} for a parameter of "
                             f"shape {tuple(param.shape)}")
        param.set_value(jnp.asarray(value, param.dtype))

    if prefix + "in_proj_qkvz.weight" in weights:
        group = c.v_heads // c.k_heads
        w = np.asarray(weights[prefix + "in_proj_qkvz.weight"])
        w = w.reshape(c.k_heads, 2 * c.k_head_dim + 2 * group * c.v_head_dim, c.hidden_size)
        q, k, v, z = np.split(w, np.cumsum([c.k_head_dim, c.k_head_dim,
                                            group * c.v_head_dim]), axis=1)
        flat = lambda a: a.reshape(-1, c.hidden_size)  # noqa: E731 ([heads, rows] -> rows)
        qkv, z = np.concatenate([flat(q), flat(k), flat(v)]), flat(z)
        ba = np.asarray(weights[prefix + "in_proj_ba.weight"])
        b, a = np.split(ba.reshape(c.k_heads, 2 * group, c.hidden_size), 2, axis=1)
        b, a = flat(b), flat(a)
    else:
        qkv, z, b, a = (weights[prefix + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a"))
    order = stored_channels(module)
    qkv = np.asarray(qkv)[order]
    for linear, w in ((module.in_proj_qkv, qkv), (module.in_proj_z, z), (module.in_proj_b, b),
                      (module.in_proj_a, a), (module.out_proj,
                                              weights[prefix + "out_proj.weight"])):
        put(linear.kernel, Linear.kernel_from_hf(np.asarray(w)))
    put(module.conv_weight, np.asarray(weights[prefix + "conv1d.weight"])[order, 0, :].T)
    put(module.dt_bias, weights[prefix + "dt_bias"])
    put(module.A_log, weights[prefix + "A_log"])
    put(module.norm_weight, weights[prefix + "norm.weight"])
