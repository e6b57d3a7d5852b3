"""Generation: a model's jitted prefill and decode steps (explicit KV cache in and out),
token sampling, the generate loop and its statistics, and exported programs.

The runtime's lowest package: it imports the kernel library and :mod:`forge_jax.models`,
never :mod:`forge_jax.text`, :mod:`forge_jax.serving` or the CLI. The names below load on
first use, so that :mod:`forge_jax.generation.exported` runs a program without importing the
model code (or Flax).

Modules: :mod:`~forge_jax.generation.steps` (prefill and decode steps),
:mod:`~forge_jax.generation.sampling` (:class:`SamplingParams`, sampling on device),
:mod:`~forge_jax.generation.settings` (a checkpoint's defaults merged with the caller's),
:mod:`~forge_jax.generation.loop` (:func:`generate`, :func:`generate_with_stats`),
:mod:`~forge_jax.generation.stats`, :mod:`~forge_jax.generation.abstract_steps` (the steps
on abstract arguments, for deviceless compiles), :mod:`~forge_jax.generation.export` (writes
exported programs), :mod:`~forge_jax.generation.exported` (loads and runs them) and
:mod:`~forge_jax.generation.op_shapes` (the ops a model calls, for ``forge-jax tune``).
"""

import importlib

# Public name -> the module that defines it (imported on first use).
_EXPORTS = {
    "check_generation_fits": "loop", "check_sequence_length": "loop", "generate": "loop",
    "generate_with_stats": "loop", "SamplingParams": "sampling",
    "sampling_params": "settings", "GenerationStats": "stats", "decode_step": "steps",
    "prefill_step": "steps",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
