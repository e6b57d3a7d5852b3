"""chex's execution variants for pytest: an op called under ``jax.jit``, eagerly, on
committed device arrays, on host (NumPy) arrays and under ``jax.pmap``.

The same wrappers ``chex.variants`` applies (``chex._src.variants``), without
``chex.TestCase``: a test takes the ``variant`` parameter and wraps the function it calls,
``variant(fn)`` or ``variant(fn, broadcast_args_to_devices=False, reduce_fn=None)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest


def with_jit(fn, **_):
    return jax.jit(fn)


def without_jit(fn, **_):
    @functools.wraps(fn)
    def eager(*args, **kwargs):
        return fn(*args, **kwargs)

    return eager


def with_device(fn, **_):
    """Arguments committed to the default device first (``jax.device_put``)."""

    def put(x):
        try:
            return jax.device_put(x)
        except TypeError:  # not a JAX type
            return x

    @functools.wraps(fn)
    def on_device(*args, **kwargs):
        return fn(*jax.tree.map(put, args), **jax.tree.map(put, kwargs))

    return on_device


def without_device(fn, **_):
    """JAX array arguments fetched to the host first (``jax.device_get``)."""

    def get(x):
        return jax.device_get(x) if isinstance(x, jax.Array) else x

    @functools.wraps(fn)
    def on_host(*args, **kwargs):
        return fn(*jax.tree.map(get, args), **jax.tree.map(get, kwargs))

    return on_host


def with_pmap(fn, *, broadcast_args_to_devices=True, reduce_fn="first_device_output"):
    """``jax.pmap`` over every device. By default each argument is broadcast to all devices
    and the first device's output returned; ``broadcast_args_to_devices=False`` maps the
    arguments' leading axis over the devices, ``reduce_fn=None`` returns every output."""
    pmapped = jax.pmap(fn, axis_name="i")
    n = jax.device_count()

    def call(*args):
        if broadcast_args_to_devices:
            args = jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (n, *jnp.shape(x))),
                                args)
        out = pmapped(*args)
        if reduce_fn == "first_device_output":
            return jax.tree.map(lambda x: x[0], out)
        return out if reduce_fn is None else reduce_fn(out)

    return call


ALL = {"with_jit": with_jit, "without_jit": without_jit, "with_device": with_device,
       "without_device": without_device, "with_pmap": with_pmap}
WITHOUT_PMAP = {name: v for name, v in ALL.items() if name != "with_pmap"}

# @all_variants / @device_variants: the test takes ``variant`` and runs once per variant.
all_variants = pytest.mark.parametrize("variant", list(ALL.values()), ids=list(ALL))
device_variants = pytest.mark.parametrize("variant", list(WITHOUT_PMAP.values()),
                                          ids=list(WITHOUT_PMAP))
