"""Rotary position embeddings (RoPE), with Hugging Face's scaling variants."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding

ROPE_KINDS = ("linear", "llama3", "yarn", "longrope", "dynamic", "proportional")

# Keys of a Hugging Face rope dict that belong to the model rather than to the scaling:
# the base (``theta=``) and the partial rotary fraction (the model rotates only the first
# ``rotary_dim`` dimensions), except that "proportional" reads its fraction itself.
_MODEL_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_KIND_KEYS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "truncate"},
    "longrope": {"factor", "attention_factor", "short_factor", "long_factor",
                 "original_max_position_embeddings"},
    "dynamic": {"factor"},
    "proportional": {"factor"},
}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction: ``0.1 * mscale * ln(scale) + 1`` for
    ``scale > 1``, else 1 (Peng et al., "YaRN", 2023; DeepSeek-V2/V3 also scale the
    softmax by its square)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies, as Hugging Face defines it.

    Attributes:
      kind: one of

        * ``"linear"``: every frequency divided by ``factor``.
        * ``"llama3"`` (Llama 3.1): low frequencies divided by ``factor``, high ones
          kept, the band between interpolated smoothly.
        * ``"yarn"``: frequencies interpolated between extrapolation (rotating faster
          than ``beta_fast`` turns over the original context) and division by
          ``factor`` (slower than ``beta_slow`` turns), with the cos/sin tables
          multiplied by :attr:`resolved_attention_factor`.
        * ``"longrope"`` (Phi-3.5, Phi-4-mini): frequency ``i`` divided by
          ``short_factor[i]``, or by ``long_factor[i]`` when the largest position of
          the call is at or past ``original_max_position_embeddings``; cos/sin
          multiplied by :attr:`resolved_attention_factor`.
        * ``"dynamic"`` (dynamic NTK): the base grows with the length of the call,
          ``max(positions) + 1``, once it passes ``original_max_position_embeddings``
          (Hugging Face's ``max_position_embeddings`` for this kind).
        * ``"proportional"`` (Gemma 4's global layers): only the first
          ``int(partial_rotary_factor * head_dim // 2)`` of the ``head_dim // 2`` pairs
          rotate (frequency exponent over the full ``head_dim``), the rest have
          frequency 0; all divided by ``factor``.
      factor: the context-extension factor (> 0). LongRoPE uses it only for the
        attention factor.
      low_freq_factor, high_freq_factor: llama3 only.
      original_max_position_embeddings: the pre-extension context (llama3, yarn,
        longrope, dynamic).
      beta_fast, beta_slow: yarn's ramp bounds, in rotations over the original context.
      mscale, mscale_all_dim: yarn; with both set, the attention factor is
        ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``.
      attention_factor: yarn/longrope multiplier on cos and sin; None derives it as
        Hugging Face does (:attr:`resolved_attention_factor`).
      short_factor, long_factor: longrope's per-frequency divisors (``head_dim // 2``
        each).
      truncate: yarn; round the correction range outwards to whole dimensions.
      partial_rotary_factor: proportional only, the fraction of pairs that rotate.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling kind must be one of {ROPE_KINDS}, got {self.kind=!r}")
        _checks.positive_float("factor", self.factor)
        if self.kind in ("llama3", "yarn", "longrope", "dynamic"):
            _checks.positive_int("original_max_position_embeddings",
                                 self.original_max_position_embeddings)
        if self.kind == "llama3":
            _checks.positive_float("low_freq_factor", self.low_freq_factor)
            _checks.positive_float("high_freq_factor", self.high_freq_factor)
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"llama3 scaling needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor=}, {self.low_freq_factor=}")
        if self.kind in ("yarn", "longrope"):
            _checks.positive_float("attention_factor", self.attention_factor, allow_none=True)
        if self.kind == "yarn":
            _checks.positive_float("beta_fast", self.beta_fast)
            _checks.positive_float("beta_slow", self.beta_slow)
            if self.beta_fast <= self.beta_slow:
                raise ValueError(f"yarn scaling needs beta_fast > beta_slow, got "
                                 f"{self.beta_fast=}, {self.beta_slow=}")
            for name in ("mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    _checks.number(name, getattr(self, name))
            if not isinstance(self.truncate, bool):
                raise TypeError(f"truncate must be a bool, got {self.truncate=!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise TypeError(f"{name} must be a sequence of floats, got {name}={value!r}")
                value = tuple(value)
            value = tuple(float(v) for v in value)
            if not all(v > 0 and math.isfinite(v) for v in value):
                raise ValueError(f"{name} entries must be finite and > 0, got {name}={value!r}")
            object.__setattr__(self, name, value)  # hashable: the scaling is a static argument
        if self.kind == "longrope" and (not self.short_factor
                                        or len(self.short_factor) != len(self.long_factor)):
            raise ValueError(
                f"longrope scaling needs short_factor and long_factor of one nonzero length, "
                f"got {len(self.short_factor)=}, {len(self.long_factor)=}")
        if self.kind == "proportional" and not 0 <= self.partial_rotary_factor <= 1:
            raise ValueError(f"proportional scaling needs 0 <= partial_rotary_factor <= 1, got "
                             f"{self.partial_rotary_factor=}")

    @property
    def resolved_attention_factor(self) -> float:
        """The multiplier on cos and sin: ``attention_factor`` if given, else as Hugging
        Face derives it (yarn: ``yarn_mscale(factor)``, or the mscale ratio when ``mscale``
        and ``mscale_all_dim`` are both set; longrope: ``sqrt(1 + ln(factor) /
        ln(original_max_position_embeddings))`` for ``factor > 1``); 1 for other kinds."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "yarn":
            if self.mscale and self.mscale_all_dim:
                return float(yarn_mscale(self.factor, self.mscale)
                             / yarn_mscale(self.factor, self.mscale_all_dim))
            return yarn_mscale(self.factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor)
                         / math.log(self.original_max_position_embeddings))

    @property
    def depends_on_length(self) -> bool:
        """True when the frequencies depend on the call's largest position (longrope,
        dynamic), so that no single host table holds them."""
        return self.kind in ("longrope", "dynamic")

    @staticmethod
    def layer_parameters(config: Mapping[str, Any] | None,
                         layer_type: str | None = None) -> dict[str, Any] | None:
        """The flat rope dict of one layer type.

        Hugging Face writes either one flat dict for every layer or (Gemma 3n/4) one
        dict per layer type, ``{"sliding_attention": {...}, "full_attention": {...}}``.
        A flat dict is every layer type's; a keyed one needs ``layer_type``.
        """
        if not config:
            return None
        if not isinstance(config, Mapping):
            raise TypeError(f"rope parameters must be a dict or None, got {config=!r}")
        nested = sorted(k for k, v in config.items() if isinstance(v, Mapping))
        if not nested:
            return dict(config)
        if layer_type is None:
            raise ValueError(f"rope parameters are keyed by layer type {nested}: pass "
                             f"layer_type= (one of them)")
        if layer_type not in config:
            raise ValueError(f"rope parameters have no entry for {layer_type=!r} "
                             f"(layer types: {nested})")
        return dict(config[layer_type]) if config[layer_type] else None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | None, layer_type: str | None = None, *,
                max_position_embeddings: int | None = None,
                original_max_position_embeddings: int | None = None) -> RopeScaling | None:
        """From an HF ``rope_scaling`` / ``rope_parameters`` dict; None for default RoPE.

        Args:
          config: the dict, flat or keyed by layer type (see :meth:`layer_parameters`).
          layer_type: which layer type's entry of a keyed dict to read.
          max_position_embeddings: the config's top-level value; dynamic NTK scales
            past it, and yarn / longrope derive a missing ``factor`` and
            ``original_max_position_embeddings`` from it, as transformers does.
          original_max_position_embeddings: a top-level value (Phi-3 writes one), which
            transformers prefers over the one in the rope dict.

        Raises ValueError for a rope type or key forge_jax does not implement, so that a
        model is never run with the wrong positions. ``rope_theta`` and
        ``partial_rotary_factor`` are the model's (``theta=`` and the rotated width),
        except for "proportional", which reads its fraction.
        """
        config = cls.layer_parameters(config, layer_type)
        if not config:
            return None
        kind = config.get("rope_type", config.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in ROPE_KINDS:
            raise ValueError(
                f"unsupported rope type {kind!r} (supported: default, {', '.join(ROPE_KINDS)})")
        if kind in ("yarn", "longrope", "dynamic", "proportional"):
            unknown = sorted(set(config) - _MODEL_KEYS - _KIND_KEYS[kind])
            if unknown:
                raise ValueError(f"unsupported {kind} rope parameters {unknown} in {config=}")
        if kind in ("yarn", "longrope"):
            original = (original_max_position_embeddings
                        or config.get("original_max_position_embeddings")
                        or max_position_embeddings)
            if original is None:
                raise ValueError(f"{kind} rope scaling needs original_max_position_embeddings "
                                 f"(in the dict or as max_position_embeddings=), got {config=}")
            factor = config.get("factor")
            if factor is None:
                if max_position_embeddings is None:
                    raise ValueError(f"{kind} rope scaling without a factor needs "
                                     f"max_position_embeddings= to derive it, got {config=}")
                factor = max_position_embeddings / original
            attention = config.get("attention_factor")
            attention = None if attention is None else float(attention)
            if kind == "yarn":
                mscale, mscale_all_dim = config.get("mscale"), config.get("mscale_all_dim")
                return cls("yarn", float(factor), original_max_position_embeddings=int(original),
                           beta_fast=float(config.get("beta_fast") or 32.0),
                           beta_slow=float(config.get("beta_slow") or 1.0),
                           mscale=None if mscale is None else float(mscale),
                           mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
                           attention_factor=attention,
                           truncate=bool(config.get("truncate", True)))
            missing = [key for key in ("short_factor", "long_factor") if key not in config]
            if missing:
                raise ValueError(f"longrope rope scaling needs {missing} in the config, "
                                 f"got {config=}")
            return cls("longrope", float(factor), original_max_position_embeddings=int(original),
                       attention_factor=attention, short_factor=tuple(config["short_factor"]),
                       long_factor=tuple(config["long_factor"]))
        if kind == "dynamic":
            if "factor" not in config:
                raise ValueError(f"dynamic rope scaling needs ['factor'] in the config, "
                                 f"got {config=}")
            if max_position_embeddings is None:
                raise ValueError(f"dynamic rope scaling needs max_position_embeddings= (the "
                                 f"config's), got {config=}")
            return cls("dynamic", float(config["factor"]),
                       original_max_position_embeddings=int(max_position_embeddings))
        if kind == "proportional":
            return cls("proportional", float(config.get("factor", 1.0)),
                       partial_rotary_factor=float(config.get("partial_rotary_factor", 1.0)))
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


def _base_exponents(head_dim: int, count: int | None = None) -> np.ndarray:
    """``arange(0, 2 * count, 2) / head_dim`` in float32, as transformers computes it."""
    count = head_dim // 2 if count is None else count
    return np.arange(0, 2 * count, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)


def _yarn_inverse_frequencies(head_dim, theta, s):
    pos_freqs = np.float32(theta) ** _base_exponents(head_dim)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = (np.float32(1) - ramp).astype(np.float32)  # 1: extrapolate (high frequencies)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def inverse_frequencies(head_dim: int, theta: float = 10000.0,
                        scaling: RopeScaling | None = None, *,
                        long: bool = False) -> np.ndarray:
    """The ``head_dim // 2`` rotation frequencies, float32, computed on the host.

    Follows Hugging Face's float32 arithmetic step for step so that the tables match.
    For "longrope", ``long`` picks the long factors; for "dynamic", these are the
    frequencies of a call whose positions stay within the original context (the scaled
    ones depend on the positions: :func:`rope_cos_sin` computes them).
    """
    if scaling is None:
        return (np.float32(1.0) / (np.float32(theta) ** _base_exponents(head_dim))).astype(
            np.float32)
    factor = np.float32(scaling.factor)
    if scaling.kind == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    if scaling.kind == "longrope":
        ext = scaling.long_factor if long else scaling.short_factor
        if len(ext) != head_dim // 2:
            raise ValueError(f"longrope short_factor and long_factor need head_dim // 2 = "
                             f"{head_dim // 2} entries, got {len(ext)}")
        ext = np.asarray(ext, np.float32)
        return (np.float32(1.0) / (ext * np.float32(theta) ** _base_exponents(head_dim))).astype(
            np.float32)
    if scaling.kind == "dynamic":
        # transformers' initial table: the base formula at the original length, in float64.
        base = theta * (scaling.factor * 1 - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
        return (np.float32(1.0) / (np.float32(base) ** _base_exponents(head_dim))).astype(
            np.float32)
    if scaling.kind == "proportional":
        rotated = int(scaling.partial_rotary_factor * head_dim // 2)
        inv = np.float32(1.0) / (np.float32(theta) ** _base_exponents(head_dim, rotated))
        inv = np.concatenate([inv.astype(np.float32),
                              np.zeros(head_dim // 2 - rotated, np.float32)])
        return (inv / factor).astype(np.float32)
    inv_freq = inverse_frequencies(head_dim, theta)
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


def call_inverse_frequencies(positions, head_dim, theta, scaling):
    """float32 ``[head_dim // 2]`` frequencies of a call with these positions: the host
    table, or for longrope and dynamic, chosen or computed from ``max(positions) + 1``
    (the length transformers reads, over the whole batch)."""
    short = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    if scaling is None or not scaling.depends_on_length:
        return short
    original = scaling.original_max_position_embeddings
    length = jnp.max(positions).astype(jnp.int32) + 1 if positions.size else jnp.int32(0)
    if scaling.kind == "longrope":
        long_ = jnp.asarray(inverse_frequencies(head_dim, theta, scaling, long=True))
        return jnp.where(length > original, long_, short)
    # dynamic NTK, in float32 in transformers' order of operations.
    seq = jnp.maximum(length, original).astype(jnp.float32)
    grown = jnp.float32(theta) * ((jnp.float32(scaling.factor) * seq / jnp.float32(original))
                                  - jnp.float32(scaling.factor - 1)) ** jnp.float32(
        head_dim / (head_dim - 2))
    scaled = jnp.float32(1.0) / (grown ** jnp.asarray(_base_exponents(head_dim)))
    return jnp.where(length > original, scaled, short)



def host_table_reason(scaling: RopeScaling | None) -> str | None:
    """Why a kernel that rotates by one host table of :func:`inverse_frequencies` alone
    (no cos/sin multiplier, no choice by length) cannot serve ``scaling``; None if it can."""
    if scaling is None or scaling.kind in ("linear", "llama3", "proportional"):
        return None
    if scaling.depends_on_length:
        return (f"{scaling.kind} RoPE frequencies follow the call's largest position; the "
                "kernel reads one host table")
    if scaling.resolved_attention_factor != 1.0:
        return (f"{scaling.kind} RoPE scales cos/sin by its attention factor "
                f"{scaling.resolved_attention_factor:.6g}; the kernel applies none")
    return None

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
    For yarn and longrope both tables are multiplied by the scaling's
    :attr:`RopeScaling.resolved_attention_factor`; for longrope and dynamic the
    frequencies follow the largest position of the call (``max(positions) + 1`` is the
    length transformers reads).

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
    inv_freq = call_inverse_frequencies(positions, head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    attention_factor = 1.0 if scaling is None else scaling.resolved_attention_factor
    if attention_factor != 1.0:
        cos, sin = cos * jnp.float32(attention_factor), sin * jnp.float32(attention_factor)
    return cos, sin


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
      scaling: optional :class:`RopeScaling` (any kind; yarn and longrope also scale
        the rotated vectors by their attention factor, as transformers' cos/sin do).
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
