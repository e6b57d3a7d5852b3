"""Version shims: every difference between the JAX releases forge_jax supports lives here.

forge_jax runs on JAX 0.10 (CPU machines, Python 3.11) and 0.11 (the GPU machine,
Python 3.12). Kernels import what differs from this module, never from
``jax.experimental`` directly, so a new JAX release touches one file.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def pallas():
    """``jax.experimental.pallas`` (imported lazily: it pulls in lowering machinery)."""
    from jax.experimental import pallas as pl

    return pl


def triton_compiler_params(**kwargs: Any) -> Any:
    """Compiler params that select Pallas' Triton lowering on GPU.

    Since JAX 0.9 the default GPU lowering is Mosaic GPU and from 0.11 Triton warns
    as deprecated, so kernels written for Triton must ask for it explicitly.
    """
    from jax.experimental.pallas import triton as pltriton

    cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
    return cls(**kwargs)


def tpu_interpret_params() -> Any:
    """Interpret params that run Mosaic TPU kernels on CPU (the TPU interpreter)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def module_available(name: str) -> bool:
    """Whether ``name`` is installed, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
