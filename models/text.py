"""Moved to :mod:`forge_jax.text`: this path warns and is
removed in the next release."""

from forge_jax._moved import forward

__getattr__ = forward(__name__, "forge_jax.text")
