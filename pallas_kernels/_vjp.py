"""The backward pass of every kernel here: the VJP of the op's XLA implementation.

A ``pallas_call`` (or a jax-triton launch, or cuDNN through ``jax.nn``) has no derivative
that forge_jax trusts, and no backward kernel has been written and checked: a kernel's
gradients are those of its reference, the op's XLA implementation, evaluated at the same
inputs. :func:`with_reference_vjp` turns a kernel's forward function into such a
``jax.custom_vjp`` once, instead of a hand-written ``fwd``/``bwd`` pair per kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax.ops.norm import rms_norm_xla


def with_reference_vjp(forward: Callable[..., Any], reference: Callable[..., Any], *,
                       static: Sequence[str] = ()) -> Callable[..., Any]:
    """``fn(*operands, **options)``: ``forward(*operands, **options)``, differentiable with
    the VJP of ``reference``.

    Args:
      forward: the kernel: ``forward(*operands, **options)``.
      reference: the op's XLA implementation over the same operands:
        ``reference(*operands, **{name: options[name] for name in static})``. Its VJP at
        the forward's inputs is the backward pass, so whatever the reference keeps out of
        its gradients (the attention references: NaN/inf in K/V slots a query does not
        see) stays out of the kernel's too.
      static: the options ``reference`` takes as well (the op's static arguments: ``eps``,
        ``scale``, ...); the other options (launch knobs, ``interpret``) are the kernel's
        alone.

    ``operands`` are positional arrays or ``None`` (an absent optional input): floating
    ones are differentiated, integer ones (positions, lengths) get float0 zero cotangents,
    ``None`` stays ``None``. ``options`` are keywords, hashable, never differentiated.
    """
    static = frozenset(static)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def differentiable(options, *operands):
        return forward(*operands, **dict(options))

    def fwd(options, *operands):
        return differentiable(options, *operands), operands

    def bwd(options, operands, cotangent):
        kept = {name: value for name, value in options if name in static}
        wrt = [i for i, x in enumerate(operands)
               if x is not None and jnp.issubdtype(x.dtype, jnp.inexact)]

        def at(*arrays):
            full = list(operands)
            for i, x in zip(wrt, arrays, strict=True):
                full[i] = x
            return reference(*full, **kept)

        _, vjp = jax.vjp(at, *(operands[i] for i in wrt))
        grads = dict(zip(wrt, vjp(cotangent), strict=True))
        # Integer operands have no tangent space: their cotangent is float0 zeros.
        return tuple(grads[i] if i in grads
                     else None if x is None else np.zeros(np.shape(x), jax.dtypes.float0)
                     for i, x in enumerate(operands))

    differentiable.defvjp(fwd, bwd)

    def fn(*operands, **options):
        return differentiable(tuple(sorted(options.items())), *operands)

    return fn


def rms_norm_reference(x, weight, residual, *, eps):
    """:func:`forge_jax.ops.norm.rms_norm_xla` with ``residual`` an operand (positional), as
    the rms_norm kernels' forward functions take it."""
    return rms_norm_xla(x, weight, eps=eps, residual=residual)
