"""The model a checkpoint loads into, as shapes only (``nnx.eval_shape``), built fast.

A loader overwrites every parameter, so the model's random initialisation is never used;
only its shapes and structure are. Built with ``nnx.Rngs`` under ``nnx.eval_shape``, each
draw updates the Rngs' counter, a traced value whose ``sharding`` flax checks; JAX builds
the error message for that (the tracer's origin) by walking the whole trace so far, so the
cost grows with the square of the model: seconds for a 30-layer model at every start
(5 s of SmolLM2-135M's 2-core load). The keys below are drawn without a counter.
"""

from __future__ import annotations

import jax
from flax import nnx

from forge_jax.models.llama_model import Llama, LlamaConfig


class ShapeOnlyRngs:
    """Stands for ``nnx.Rngs`` where only the shapes of the draws matter: every draw uses
    one key (the model code draws from ``rngs.params()`` only)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_llama(config: LlamaConfig, **kwargs) -> Llama:
    """``Llama(config, **kwargs)`` with ``jax.ShapeDtypeStruct`` parameters."""
    return nnx.eval_shape(lambda: Llama(config, rngs=ShapeOnlyRngs(), **kwargs))
