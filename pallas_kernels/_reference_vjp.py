"""The backward passes of the elementwise kernels: the VJP of the op's XLA implementation.

Every hand-written forward kernel of rms_norm, silu_mul and rope (Pallas GPU, Pallas TPU,
jax-triton) is a ``jax.custom_vjp`` whose backward is the reference's VJP, not a kernel.
They share these functions, shaped as ``custom_vjp`` backward rules: the static
(non-differentiable) arguments first, the kernel's launch knobs (unused here), then the
saved residuals and the cotangent.
"""

from __future__ import annotations

import jax
import numpy as np

from forge_jax.ops.activation import silu_mul_xla
from forge_jax.ops.norm import rms_norm_xla
from forge_jax.ops.rope import rope_xla


def rms_norm_bwd(eps, knobs, saved, cotangent):
    """``saved = (x, weight, residual)``; ``cotangent`` matches the forward's output."""
    del knobs
    _, vjp = jax.vjp(lambda x, w, r: rms_norm_xla(x, w, eps=eps, residual=r), *saved)
    return vjp(cotangent)


def silu_mul_bwd(knobs, saved, cotangent):
    """``saved = (gate, up)``."""
    del knobs
    return jax.vjp(silu_mul_xla, *saved)[1](cotangent)


def rope_bwd(static, knobs, saved, cotangent):
    """``static = (theta, scaling, interleaved)``, ``saved = (x, positions)``."""
    del knobs
    theta, scaling, interleaved = static
    x, positions = saved
    _, vjp = jax.vjp(lambda x: rope_xla(x, positions, theta=theta, scaling=scaling,
                                        interleaved=interleaved), x)
    # Integer positions have no tangent space: their cotangent is float0 zeros.
    return (*vjp(cotangent), np.zeros(positions.shape, jax.dtypes.float0))
