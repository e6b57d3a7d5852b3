"""RMSNorm, optionally fused with the residual add of a pre-norm block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding


def _rms_norm_args(x, weight, *, eps=1e-6, residual=None):
    _checks.array("x", x, min_ndim=1)
    _checks.array("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape (x.shape[-1],): {weight.shape=}, {x.shape=}")
    eps = _checks.positive_float("eps", eps)
    if residual is not None:
        _checks.array("residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual must have x's shape: {residual.shape=}, {x.shape=}")
        # h = x + residual is rounded to x.dtype: a residual of another dtype would be
        # rounded silently (the dtype rule of forge_jax.ops).
        _checks.same_dtype(("x", x), ("residual", residual))
    return dict(x=x, weight=weight, eps=eps, residual=residual)


def rms_norm(x, weight, *, eps=1e-6, residual=None, implementation=None):
    """Root-mean-square normalisation, with an optional fused residual add.

    ``h = x + residual`` (or ``h = x``), rounded to ``x.dtype``; then
    ``y = weight * h / sqrt(mean(h * h, axis=-1) + eps)`` with all math in float32.
    Normalising the rounded ``h`` makes ``rms_norm(x, w, residual=r)`` equal to
    ``(rms_norm(h, w), h)``: the residual stream a model carries forward is exactly
    what was normalised.

    Args:
      x: ``[..., dim]`` float32/float16/bfloat16.
      weight: ``[dim]``, any float dtype: a parameter, read in float32 (e.g. float32
        weights with bfloat16 activations, a model's ``param_dtype``).
      eps: added to the mean square, a positive float.
      residual: optional ``[..., dim]``, ``x``'s shape and dtype (the dtype rule of
        :mod:`forge_jax.ops`: another dtype raises TypeError rather than being rounded).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``y`` in ``x.dtype``; with ``residual``, the pair ``(y, h)``, both ``x.dtype``.
    """
    args = _rms_norm_args(x, weight, eps=eps, residual=residual)
    return dispatch.call("rms_norm", args, implementation)


def _rms_norm_partition(args, config):
    """How ``rms_norm`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    x = args["x"]
    lead = sharding.divisible(config, config.dp_name, x.shape[0]) if x.ndim >= 2 else None
    spec = P(lead, *([None] * (x.ndim - 1)))
    specs = {"x": spec, "weight": P()}
    if args["residual"] is not None:
        specs["residual"] = spec
    return specs, spec


dispatch.define("rms_norm", _rms_norm_args, partition=_rms_norm_partition)


@dispatch.register("rms_norm", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math")
def rms_norm_xla(x, weight, *, eps, residual):
    with jax.named_scope("rms_norm"):
        h = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32)
                                        ).astype(x.dtype)
        # Mean square in float32: bfloat16 sums of thousands of squares lose most bits.
        h32 = h.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
        y = (h32 * inv * weight.astype(jnp.float32)).astype(x.dtype)
        return y if residual is None else (y, h)
