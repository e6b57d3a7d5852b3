"""Generation: a model's jitted prefill and decode steps (explicit KV cache in and out),
token sampling, the generate loop and its statistics, and exported programs.

The runtime's lowest package: it imports the kernel library and :mod:`forge_jax.models`,
never :mod:`forge_jax.text`, :mod:`forge_jax.serving` or the CLI.

Modules: :mod:`~forge_jax.generation.steps` (prefill and decode steps),
:mod:`~forge_jax.generation.sampling` (:class:`SamplingParams`, sampling on device),
:mod:`~forge_jax.generation.settings` (the front door: a checkpoint's defaults merged with
the caller's values, :func:`stopping` for the eos ids and the token limit),
:mod:`~forge_jax.generation.loop` (:func:`generate`, :func:`generate_with_stats`),
:mod:`~forge_jax.generation.stats`, :mod:`~forge_jax.generation.abstract_steps` (the steps
on abstract arguments, for deviceless compiles), :mod:`~forge_jax.generation.export` (writes
exported programs), :mod:`~forge_jax.generation.exported` (loads and runs them) and
:mod:`~forge_jax.generation.op_shapes` (the ops a model calls, for ``forge-jax tune``).
"""

from forge_jax.generation.loop import (
    check_generation_fits,
    check_sequence_length,
    generate,
    generate_with_stats,
)
from forge_jax.generation.sampling import SamplingParams
from forge_jax.generation.settings import (
    DEFAULT_MAX_NEW_TOKENS,
    Callbacks,
    Stopping,
    sampling_params,
    stopping,
)
from forge_jax.generation.stats import GenerationStats
from forge_jax.generation.steps import decode_step, prefill_step

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "Callbacks", "GenerationStats", "SamplingParams", "Stopping",
    "check_generation_fits", "check_sequence_length", "decode_step", "generate",
    "generate_with_stats", "prefill_step", "sampling_params", "stopping",
]
