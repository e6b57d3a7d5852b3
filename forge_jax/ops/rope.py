"""Rotary position embeddings (RoPE), with Hugging Face's scaling variants."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding

ROPE_KINDS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies, as Hugging Face defines it.

    Attributes:
      kind: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"``
        (Llama 3.1: low frequencies divided by ``factor``, high ones kept, the band
        between interpolated smoothly).
      factor: the context-extension factor (> 0).
      low_freq_factor, high_freq_factor: llama3 only; wavelengths longer than
        ``original_max_position_embeddings / low_freq_factor`` are scaled, shorter
        than ``original_max_position_embeddings / high_freq_factor`` are kept.
      original_max_position_embeddings: llama3 only, the pre-extension context.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling kind must be one of {ROPE_KINDS}, got {self.kind=!r}")
        _checks.positive_float("factor", self.factor)
        if self.kind == "llama3":
            _checks.positive_float("low_freq_factor", self.low_freq_factor)
            _checks.positive_float("high_freq_factor", self.high_freq_factor)
            _checks.positive_int("original_max_position_embeddings",
                                 self.original_max_position_embeddings)
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"llama3 scaling needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor=}, {self.low_freq_factor=}")

    @classmethod
    def from_hf(cls, config: dict[str, Any] | None) -> RopeScaling | None:
        """From an HF ``rope_scaling`` / ``rope_parameters`` dict; None for default RoPE.

        Raises ValueError for a rope type forge_jax does not implement, so that a
        model is never run with the wrong positions.
        """
        if not config:
            return None
        kind = config.get("rope_type", config.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in ROPE_KINDS:
            raise ValueError(
                f"unsupported rope type {kind!r} (supported: default, {', '.join(ROPE_KINDS)})")
        needed = ("factor",) if kind == "linear" else (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in needed if key not in config]
        if missing:
            raise ValueError(f"{kind} rope scaling needs {missing} in the config, got {config=}")
        if kind == "linear":
            return cls("linear", float(config["factor"]))
        return cls("llama3", float(config["factor"]), float(config["low_freq_factor"]),
                   float(config["high_freq_factor"]),
                   int(config["original_max_position_embeddings"]))


def inverse_frequencies(head_dim: int, theta: float = 10000.0,
                        scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``head_dim // 2`` rotation frequencies, float32, computed on the host.

    Follows Hugging Face's float32 arithmetic step for step so that the tables match.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    if scaling.kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    old = np.float32(scaling.original_max_position_embeddings)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    low_freq_wavelen, high_freq_wavelen = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _check_rope_static(head_dim, theta, scaling):
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim=}")
    _checks.positive_float("theta", theta)
    if scaling is not None and not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaling must be a forge_jax.RopeScaling or None, got {scaling=!r}")


def rope_cos_sin(positions, head_dim, *, theta=10000.0, scaling=None):
    """The cosine and sine tables of RoPE for the given positions.

    ``angle[..., i] = positions[...] * inv_freq[i]`` for ``i < head_dim // 2``, with
    ``inv_freq[i] = theta ** (-2i / head_dim)`` adjusted by ``scaling``. Angles are
    float32: in bfloat16, position 257 rounds to 256 and its sine is not sin(257).

    Args:
      positions: int array of any shape.
      head_dim: the (even) size of the rotated head dimension.
      theta: the RoPE base.
      scaling: optional :class:`RopeScaling`.

    Returns:
      ``(cos, sin)``, each float32 ``[*positions.shape, head_dim // 2]``: one entry per
      rotated pair, valid for both the rotate-half and the interleaved layout.
    """
    _checks.array("positions", positions, kind="int")
    head_dim = _checks.positive_int("head_dim", head_dim)
    _check_rope_static(head_dim, theta, scaling)
    inv_freq = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def _check_positions(positions):
    """Positions are >= 0: checked where concrete, and under ``debug_checks`` when traced."""
    rule = "must be >= 0 (a token's position in its sequence)"
    values = _checks.concrete_ints(positions)
    if values is not None:
        bad = np.argwhere(values < 0)
        if bad.size:
            at = tuple(int(i) for i in bad[0])
            raise ValueError(f"positions{list(at)}={values[at]} {rule}")
    elif _checks.debug_checks_enabled():
        i = _checks.first_bad(positions < 0)
        _checks.traced_check(~jnp.any(positions < 0), f"positions (flat index {{i}})={{n}} "
                             f"{rule}", i=i, n=jnp.ravel(positions)[i])


def _rope_args(x, positions, *, theta=10000.0, scaling=None, interleaved=False):
    _checks.array("x", x, ndim=4)
    _checks.array("positions", positions, ndim=2, kind="int")
    if tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"positions must be [batch, seq] = {tuple(x.shape[:2])}, got {positions.shape=}")
    _check_rope_static(x.shape[-1], theta, scaling)
    _check_positions(positions)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved=!r}")
    return dict(x=x, positions=positions, theta=float(theta), scaling=scaling,
                interleaved=interleaved)


def rope(x, positions, *, theta=10000.0, scaling=None, interleaved=False, implementation=None):
    """Rotates query or key vectors by their positions (rotary position embedding).

    Each head vector is split into ``head_dim // 2`` pairs; pair ``i`` of the token
    at position ``p`` is rotated by the angle ``p * inv_freq[i]`` (see
    :func:`rope_cos_sin`). The pairing follows the checkpoint's convention:

    * ``interleaved=False`` (default, Hugging Face transformers' ``rotate_half``):
      pair ``i`` is ``(x[i], x[i + head_dim // 2])``.
    * ``interleaved=True`` (GPT-J, the original Meta Llama code): pair ``i`` is
      ``(x[2i], x[2i + 1])``.

    Math in float32.

    Args:
      x: ``[batch, seq, heads, head_dim]``, head_dim even.
      positions: int ``[batch, seq]``, the absolute position of each token.
      theta: the RoPE base (``rope_theta``).
      scaling: optional :class:`RopeScaling` ("linear" or "llama3").
      interleaved: the pairing convention, see above.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      An array like ``x`` (shape and dtype).
    """
    args = _rope_args(x, positions, theta=theta, scaling=scaling, interleaved=interleaved)
    return dispatch.call("rope", args, implementation)


def _rope_partition(args, config):
    """How ``rope`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    x = args["x"]  # [batch, seq, heads, head_dim]
    b = sharding.divisible(config, config.dp_name, x.shape[0])
    h = sharding.divisible(config, config.tp_name, x.shape[2])
    return {"x": P(b, None, h, None), "positions": P(b, None)}, P(b, None, h, None)


dispatch.define("rope", _rope_args, partition=_rope_partition)


def _materialised(cos, sin):
    """``(cos, sin)`` through an identity product (exact in float32: one term of each sum
    is the value, the others are zeros), so that XLA:CPU writes the ``[batch, seq, half]``
    tables once. Otherwise it fuses the sine and cosine into each consumer and evaluates
    them again for every head and both halves of the rotation: RoPE of a 2048-token
    prompt's queries and keys (SmolLM2-135M's 9 + 3 heads), jitted alone, took 4-10 ms
    on a loaded 2-core CPU, 1-2 ms with the tables written once (BENCHMARKS.md). CPU
    only: other platforms keep the plain tables."""
    half = cos.shape[-1]
    both = jnp.einsum("...f,fg->...g", jnp.concatenate([cos, sin], axis=-1),
                      jnp.eye(2 * half, dtype=jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return both[..., :half], both[..., half:]


@dispatch.register("rope", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 angles")
def rope_xla(x, positions, *, theta, scaling, interleaved):
    with jax.named_scope("rope"):
        cos, sin = rope_cos_sin(positions, x.shape[-1], theta=theta, scaling=scaling)
        cos, sin = jax.lax.platform_dependent(cos, sin, cpu=_materialised,
                                              default=lambda cos, sin: (cos, sin))
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [batch, seq, 1, head_dim // 2]
        x32 = x.astype(jnp.float32)
        if interleaved:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
        else:
            x1, x2 = jnp.split(x32, 2, axis=-1)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        if interleaved:
            out = jnp.stack([r1, r2], axis=-1).reshape(x.shape)
        else:
            out = jnp.concatenate([r1, r2], axis=-1)
        return out.astype(x.dtype)
