"""Generation: a model's jitted prefill and decode steps (explicit KV cache in and out),
token sampling, the generate loop and its statistics, and exported programs.

The runtime's lowest package: it imports the kernel library and :mod:`forge_jax.models`,
never :mod:`forge_jax.text`, :mod:`forge_jax.serving` or the CLI.

Modules: :mod:`~forge_jax.generation.steps` (prefill and decode steps),
:mod:`~forge_jax.generation.sampling` (:class:`SamplingParams`, sampling on device),
:mod:`~forge_jax.generation.settings` (the front door: a checkpoint's defaults merged with
the caller's values, :func:`stopping` for the eos ids and the token limit),
:mod:`~forge_jax.generation.prompts` (:func:`encode_prompt`, the BOS decision),
:mod:`~forge_jax.generation.loop` (:func:`generate`, :func:`generate_with_stats`),
:mod:`~forge_jax.generation.stats`, :mod:`~forge_jax.generation.abstract_steps` (the steps
on abstract arguments, for deviceless compiles), :mod:`~forge_jax.generation.export` (writes
exported programs), :mod:`~forge_jax.generation.exported` (loads and runs them) and
:mod:`~forge_jax.generation.op_shapes` (the ops a model calls, for ``forge-jax tune``).

The names below load their module on first use, so that importing
:mod:`~forge_jax.generation.exported` (JAX, NumPy and safetensors alone) does not pull in
the model code and Flax.
"""

from __future__ import annotations

import importlib

_HOMES = {
    **dict.fromkeys(("check_generation_fits", "check_sequence_length", "generate",
                     "generate_with_stats"), "forge_jax.generation.loop"),
    "SamplingParams": "forge_jax.generation.sampling",
    "encode_prompt": "forge_jax.generation.prompts",
    "SpeculativeConfig": "forge_jax.generation.speculative",
    **dict.fromkeys(("DEFAULT_MAX_NEW_TOKENS", "Callbacks", "Stopping", "sampling_params",
                     "stopping"), "forge_jax.generation.settings"),
    "GenerationStats": "forge_jax.generation.stats",
    **dict.fromkeys(("decode_step", "prefill_step"), "forge_jax.generation.steps"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_HOMES})
