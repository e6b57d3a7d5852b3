"""Moved to :mod:`forge_jax.serving.engine`: this path warns and is
removed in the next release."""

from forge_jax._moved import forward

__getattr__ = forward(__name__, "forge_jax.serving.engine")
