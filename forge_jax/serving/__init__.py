"""Serving: the continuous-batching :class:`Engine` (scheduler and ragged batch step over a
paged KV cache with prefix sharing), its requests and statistics, and the OpenAI-compatible
HTTP app (:mod:`forge_jax.serving.http`, imported only by ``forge-jax serve``: it needs the
``serve`` extra).

The runtime's top package: it may import the kernel library, :mod:`forge_jax.models`,
:mod:`forge_jax.generation` and :mod:`forge_jax.text`, never the CLI.
"""

from forge_jax.serving.config import EngineConfig
from forge_jax.serving.engine import Engine
from forge_jax.serving.requests import (
    FINISH_REASONS,
    EngineStats,
    Output,
    QueueFull,
    RequestParams,
    RequestRefused,
    RequestStream,
)

__all__ = ["FINISH_REASONS", "Engine", "EngineConfig", "EngineStats", "Output", "QueueFull",
           "RequestParams", "RequestRefused", "RequestStream"]
