"""General matrix multiply: ``alpha * op(a) @ op(b) + beta * c``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks, dispatch
from forge_jax.ops.quantized_matmul import quantized_matmul, scale_and_add
from forge_jax.quant import QuantizedArray


def _matmul_args(a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None,
                 out_dtype=None):
    _checks.array("a", a, min_ndim=2)
    _checks.array("b", b, min_ndim=2)
    for name, flag in (("trans_a", trans_a), ("trans_b", trans_b)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {name}={flag!r}")
    alpha = _checks.number("alpha", alpha)
    beta = _checks.number("beta", beta)
    k_a = a.shape[-2] if trans_a else a.shape[-1]
    k_b = b.shape[-1] if trans_b else b.shape[-2]
    if k_a != k_b:
        raise ValueError(
            f"contracting dimensions disagree: {a.shape=} ({trans_a=}) has K={k_a}, "
            f"{b.shape=} ({trans_b=}) has K={k_b}")
    try:
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"batch dimensions do not broadcast: {a.shape=} and {b.shape=}") from None
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    out_shape = (*batch, m, n)
    _checks.same_dtype(("a", a), ("b", b), hint="; out_dtype sets only the result's dtype")
    out_dtype = _checks.product_output(out_dtype, a.dtype, c, beta, out_shape)
    return dict(a=a, b=b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, c=c,
                out_dtype=out_dtype)


def matmul(a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None,
           out_dtype=None, implementation=None):
    """General matrix multiply with float32 accumulation.

    Computes ``alpha * op(a) @ op(b) + beta * c`` where ``op(x)`` swaps the last
    two axes of ``x`` when the matching ``trans_*`` flag is set. Leading (batch)
    dimensions broadcast as in ``jnp.matmul``. Products accumulate in float32 (or
    float64 for float64 inputs); ``alpha``, ``beta`` and ``c`` are applied in that
    precision and the result is cast once to ``out_dtype``.

    Args:
      a: ``[..., M, K]`` (``[..., K, M]`` if ``trans_a``), float32/float16/bfloat16.
      b: ``[..., K, N]`` (``[..., N, K]`` if ``trans_b``), ``a``'s dtype (the dtype rule of
        :mod:`forge_jax.ops`: a mix raises TypeError, even with ``out_dtype``); or a 2-D
        :class:`forge_jax.QuantizedArray` (a weight, storage: dequantized to ``a``'s dtype
        inside the product, op ``"quantized_matmul"``, see
        :func:`forge_jax.ops.quantized_matmul.quantized_matmul`).
      trans_a, trans_b: transpose the last two axes of ``a`` / ``b``.
      alpha, beta: scalars (Python numbers or scalar arrays).
      c: optional array broadcastable to ``[..., M, N]``, any float dtype (a parameter,
        added at the accumulation precision); required when ``beta != 0``.
      out_dtype: result dtype; defaults to the dtype of ``a`` and ``b``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[..., M, N]`` in ``out_dtype``.
    """
    if isinstance(b, QuantizedArray):
        return quantized_matmul(a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                                c=c, out_dtype=out_dtype, implementation=implementation)
    args = _matmul_args(a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, c=c,
                        out_dtype=out_dtype)
    return dispatch.call("matmul", args, implementation)


dispatch.define("matmul", _matmul_args)


# float32 operands at full precision: GPUs default to TF32 and TPUs to bfloat16 passes for
# float32 dots, which would miss the float32 tolerance. Free on CPU; bfloat16 and float16
# operands are unaffected (their products are exact in float32).
_FULL = jax.lax.Precision.HIGHEST


def _acc_dtype(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def _dot_2d(a, b, dims, *, trans_a: bool, acc):
    """``dot_general`` of 2-D operands; on CPU a bfloat16 single row is computed as two.

    XLA on CPU multiplies a bfloat16 ``[1, K]`` row by a matrix in a slow loop (one decode
    token of SmolLM2-135M's vocabulary product: 28 ms, float32 2.5 ms) but ``[2, K]`` and up
    in a fast kernel (1.9 ms; ``[16, K]`` 2.0 ms; BENCHMARKS.md): the row is padded to two
    and the product's first row kept. (float16 is slow there at any row count, two rows
    slower than one: left as it is.)"""
    def dot(a, b):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=acc, precision=_FULL)

    m_axis = 1 if trans_a else 0
    if a.shape[m_axis] != 1 or a.dtype != jnp.bfloat16:
        return dot(a, b)

    def two_rows(a, b):
        pad = [(0, 0), (0, 0)]
        pad[m_axis] = (0, 1)
        return dot(jnp.pad(a, pad), b)[:1]

    return jax.lax.platform_dependent(a, b, cpu=two_rows, default=dot)


@dispatch.register("matmul", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp.matmul with float32 accumulation")
def matmul_xla(a, b, *, trans_a, trans_b, alpha, beta, c, out_dtype):
    acc = _acc_dtype(a.dtype, b.dtype)
    with jax.named_scope("matmul"):
        if a.ndim == 2 and b.ndim == 2:
            # The transposes as contracting dimensions, not as transpose ops: XLA on CPU
            # then reads a [N, K] weight in place (no transposed copy in the fusion).
            dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
            out = _dot_2d(a, b, dims, trans_a=trans_a, acc=acc)
        else:
            if trans_a:
                a = jnp.swapaxes(a, -1, -2)
            if trans_b:
                b = jnp.swapaxes(b, -1, -2)
            out = jnp.matmul(a, b, preferred_element_type=acc, precision=_FULL)
        return scale_and_add(out, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype)
