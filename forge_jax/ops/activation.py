"""Elementwise activations and softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding


def _silu_mul_args(gate, up):
    _checks.array("gate", gate)
    _checks.array("up", up)
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"gate and up must have the same shape: {gate.shape=}, {up.shape=}")
    _checks.same_dtype(("gate", gate), ("up", up))
    return dict(gate=gate, up=up)


def silu_mul(gate, up, *, implementation=None):
    """The gated-linear-unit activation of Llama's MLP: ``silu(gate) * up``.

    ``silu(g) = g * sigmoid(g)``, computed in float32.

    Args:
      gate, up: arrays of the same shape and the same float dtype (the dtype rule of
        :mod:`forge_jax.ops`: a mix raises TypeError).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``silu(gate) * up`` in the inputs' dtype.
    """
    return dispatch.call("silu_mul", _silu_mul_args(gate, up), implementation)


def _silu_mul_partition(args, config):
    """How ``silu_mul`` splits over a mesh (:mod:`forge_jax.sharding`)."""
    gate = args["gate"]
    lead = sharding.divisible(config, config.dp_name, gate.shape[0]) if gate.ndim >= 2 else None
    last = sharding.divisible(config, config.tp_name, gate.shape[-1])
    spec = P(*([lead] if gate.ndim >= 2 else []), *([None] * (gate.ndim - 2)), last)
    return {"gate": spec, "up": spec}, spec


dispatch.define("silu_mul", _silu_mul_args, partition=_silu_mul_partition)


@dispatch.register("silu_mul", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math")
def silu_mul_xla(gate, up):
    return _gated_xla("silu_mul", jax.nn.silu, gate, up)


def _gated_xla(name, activation, gate, up):
    """``activation(gate) * up`` in float32, back in the inputs' dtype."""
    with jax.named_scope(name):
        g = gate.astype(jnp.float32)
        return (activation(g) * up.astype(jnp.float32)).astype(gate.dtype)


def gelu_tanh_mul(gate, up, *, implementation=None):
    """The gated-linear-unit activation of Gemma's MLP (GeGLU): ``gelu_tanh(gate) * up``.

    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))``, the tanh
    approximation of GELU (PyTorch's ``gelu(approximate="tanh")``, Hugging Face's
    ``gelu_pytorch_tanh``), computed in float32. The arguments are :func:`silu_mul`'s.

    Returns:
      ``gelu_tanh(gate) * up`` in the inputs' dtype.
    """
    return dispatch.call("gelu_tanh_mul", _silu_mul_args(gate, up), implementation)


dispatch.define("gelu_tanh_mul", _silu_mul_args, partition=_silu_mul_partition)


@dispatch.register("gelu_tanh_mul", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math")
def gelu_tanh_mul_xla(gate, up):
    return _gated_xla("gelu_tanh_mul", functools.partial(jax.nn.gelu, approximate=True), gate, up)


def _softmax_args(x, *, axis=-1, where=None):
    _checks.array("x", x, min_ndim=1)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be an int in [-{x.ndim}, {x.ndim}), got {axis=!r}")
    if where is not None:
        _checks.array("where", where, kind="bool")
        try:
            shape = np.broadcast_shapes(tuple(where.shape), tuple(x.shape))
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(f"where must broadcast to x's shape: {where.shape=}, {x.shape=}")
    return dict(x=x, axis=axis % x.ndim, where=where)


def softmax(x, *, axis=-1, where=None, implementation=None):
    """Numerically safe softmax along ``axis``, with an optional mask.

    ``softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m)`` over the entries where
    ``where`` is true (all entries if ``where`` is None), with ``m`` the row's
    maximum; masked entries get 0. Math in float32. Non-finite logits:

    * ``-inf`` means "invisible": the entry gets 0, as a masked one does. A row with no
      valid entry (all masked, or all ``-inf``) returns zeros, never NaN, and so does
      its gradient.
    * ``+inf`` takes all the probability: the ``+inf`` entries of a row share it equally
      (the limit of the softmax as they grow) and the others get 0, so
      ``softmax([inf, 1]) == [1, 0]``.
    * NaN in a valid (unmasked) entry makes its whole row NaN: it is data, not a mask.

    Args:
      x: any-rank float array.
      axis: the axis to normalise over.
      where: optional boolean mask broadcastable to ``x.shape``; True = valid.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      An array like ``x`` (shape and dtype).
    """
    return dispatch.call("softmax", _softmax_args(x, axis=axis, where=where), implementation)


dispatch.define("softmax", _softmax_args)


def safe_softmax_f32(x, axis, where, *, posinf_wins: bool = True):
    """float32 softmax: zeros (and zero gradients) for fully masked rows, +inf entries share
    their row, NaN in a valid entry propagates (see :func:`softmax`).

    ``posinf_wins=False`` is for callers whose logits hold no +inf (attention turns one into
    NaN first): the +inf branch, two more passes over ``x``, is left out."""
    x = x.astype(jnp.float32)
    # Masked entries become -inf, as -inf entries are: exp(-inf) = 0 and so is its
    # derivative, and the where hands a masked NaN neither a value nor a gradient. A valid
    # NaN stays, so that it reaches the row's max and sum.
    if where is not None:
        x = jnp.where(jnp.broadcast_to(where, x.shape), x, -jnp.inf)
    # initial=-inf: an empty axis (e.g. attention over zero keys) is a fully masked row.
    m = jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf)
    shifted = x - jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    if not posinf_wins:
        e = jnp.exp(shifted)
    else:  # A +inf logit takes all the probability, shared with any other +inf of its row.
        top = jnp.isposinf(m)
        e = jnp.where(top, jnp.isposinf(x).astype(jnp.float32),
                      jnp.exp(jnp.where(top, -jnp.inf, shifted)))
    s = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(s == 0, 1.0, s)  # (a NaN sum stays NaN)


@dispatch.register("softmax", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math, zero rows when fully masked")
def softmax_xla(x, *, axis, where):
    with jax.named_scope("softmax"):
        return safe_softmax_f32(x, axis, where).astype(x.dtype)
