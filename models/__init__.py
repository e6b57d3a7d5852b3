"""Flax NNX models composed only of forge_jax ops."""
