"""How each decoder layer encodes positions in its queries and keys: RoPE over the first
``rotary_dim`` dimensions (partial rotary, interleaved pairs), none at all (NoPE layers),
and Llama 4's variants (an L2 QK-norm after RoPE; temperature-tuned queries on the NoPE
layers). :func:`layer_positions` picks a layer's; each takes ``(x, positions,
rotary_dim, theta, scaling, key=)``, ``x`` ``[batch, t, heads, head_dim]``, ``key`` True
for keys."""

from __future__ import annotations

import functools

import jax.numpy as jnp

import forge_jax as fj
from forge_jax.models.llama_config import LlamaConfig


def layer_positions(c: LlamaConfig, layer: int):
    """The position encoding of layer ``layer`` (a function as the module docstring says)."""
    if not c.uses_rope(layer):
        if c.attn_temperature_tuning:
            return functools.partial(_temperature_tuned, c)
        return _no_rope
    rope = functools.partial(_rope, interleaved=True) if c.rope_interleaved else _rope
    if c.qk_l2_norm:  # Llama 4: after RoPE, no weight
        return functools.partial(_l2_normed, rope, eps=c.rms_norm_eps)
    return rope


def _rope(x, positions, rotary_dim, theta, scaling, key=False, interleaved=False):
    """RoPE on the first ``rotary_dim`` dimensions of each head of ``x`` [b, t, heads,
    head_dim]; the rest pass through (partial rotary, as Phi-3's ``partial_rotary_factor``).
    ``interleaved``: on adjacent pairs (Llama 4)."""
    if rotary_dim == x.shape[-1]:
        return fj.rope(x, positions, theta=theta, scaling=scaling, interleaved=interleaved)
    rotated = fj.rope(x[..., :rotary_dim], positions, theta=theta, scaling=scaling,
                      interleaved=interleaved)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def _no_rope(x, positions, rotary_dim, theta, scaling, key=False):
    """A NoPE layer's queries and keys: unrotated."""
    return x


def _l2_normed(rope, x, positions, rotary_dim, theta, scaling, key=False, *, eps):
    """``rope``'s result divided by its RMS over each head (Llama 4's QK-norm)."""
    x = rope(x, positions, rotary_dim, theta, scaling)
    return fj.rms_norm(x, jnp.ones((x.shape[-1],), jnp.float32), eps=eps)


def _temperature_tuned(config, x, positions, rotary_dim, theta, scaling, key=False):
    """Llama 4's NoPE layers: queries (not keys) times ``1 + attn_scale *
    log1p(floor((position + 1) / floor_scale))``, in float32."""
    if key:
        return x
    p = positions.astype(jnp.float32)
    scale = jnp.log1p(jnp.floor((p + 1.0) / config.floor_scale)) * config.attn_scale + 1.0
    return (x.astype(jnp.float32) * scale[..., None, None]).astype(x.dtype)
