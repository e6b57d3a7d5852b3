"""A model's prefill and decode steps with abstract arguments: what ``forge-jax compile``
and :func:`forge_jax.aot.compile` compile for a target without weights or a device.

The weights are ``jax.ShapeDtypeStruct``s (``nnx.eval_shape`` of the model), the KV cache a
paged cache of ShapeDtypeStructs sized as :func:`forge_jax.generation.loop.generate` sizes
it, so a model of any size is compiled on a small machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import steps
from forge_jax.generation.loop import cache_plan
from forge_jax.generation.sampling import SamplingParams
from forge_jax.kv_cache import PagedKVCache
from forge_jax.models.llama_model import Llama, LlamaConfig


@dataclasses.dataclass(frozen=True)
class Step:
    """One step to compile: ``fn(*args, **statics)`` (``fn`` jitted, statics static)."""

    name: str
    fn: Any
    args: tuple[Any, ...]
    statics: dict[str, Any]


def abstract_steps(config: LlamaConfig, *, batch: int, context: int, dtype: Any,
                   page_size: int = 16, new_tokens: int = 1) -> tuple[Step, Step]:
    """The prefill of a ``context``-token prompt (bucketed as generate buckets it) into a
    paged cache with room for it and ``new_tokens`` more, and the decode step on that
    cache, with abstract weights and cache (float ``dtype`` for both).

    The prefill is the one :func:`~forge_jax.generation.loop.generate` runs: into a new
    cache (``empty_cache=True``), the prompt attending to itself, so that nothing it does
    grows with the cache's capacity.

    Call it inside ``fj.use_implementation(...)`` to compile the steps with that
    preference (it is part of the steps' static arguments).
    """
    for name, value in (("batch", batch), ("context", context), ("page_size", page_size),
                        ("new_tokens", new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
    dtype = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=dtype,
                                         param_dtype=dtype))
    graphdef, state = nnx.split(model)
    padded, bucket, _, max_pages = cache_plan(batch, context, new_tokens, "paged", page_size)
    cache = jax.eval_shape(lambda: PagedKVCache.create(
        num_layers=config.num_hidden_layers, num_pages=padded * max_pages,
        page_size=page_size, kv_heads=model.kv_heads, head_dim=config.head_dim, dtype=dtype,
        block_tables=np.zeros((padded, max_pages), np.int32)))
    sampling = SamplingParams()
    statics = steps.step_statics(graphdef, sampling.greedy)
    params = {k: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))
              for k, v in sampling.arrays().items()}
    key = jax.eval_shape(lambda: jax.random.key(0))
    seen = jax.ShapeDtypeStruct((padded, config.vocab_size), jnp.bool_)
    rows = jax.ShapeDtypeStruct((padded,), jnp.int32)
    prefill = Step("prefill", steps.prefill_step,
                   (state, cache, jax.ShapeDtypeStruct((padded, bucket), jnp.int32), rows,
                    key, params, seen), {**statics, "empty_cache": True})
    decode = Step("decode", steps.decode_step,
                  (state, cache, rows, jax.ShapeDtypeStruct((padded,), jnp.bool_), key,
                   jax.ShapeDtypeStruct((), jnp.int32), params, seen), statics)
    return prefill, decode


def pool_bytes(step: Step) -> int:
    """The bytes of the step's KV page pool (K and V, every layer)."""
    cache = step.args[1]
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves((cache.k_pages, cache.v_pages)))
