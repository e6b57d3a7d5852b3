"""The ``cost_estimate`` every ``pallas_call`` carries: flops, transcendentals and bytes of
HBM traffic, so that XLA's cost analysis, its scheduler and :func:`forge_jax.aot.compile`'s
roofline see a kernel's real cost instead of nothing. Estimates of the useful work (not of
masked-out blocks a kernel skips or pads)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from forge_jax import _compat


def nbytes(*arrays: Any) -> int:
    """The bytes of arrays (anything with ``shape`` and ``dtype``)."""
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)


def elementwise(size: int, *, flops: int, transcendentals: int = 0, io: tuple = ()) -> Any:
    """``size`` elements, each costing ``flops`` and ``transcendentals``; ``io``: the arrays
    read and written (their bytes are the traffic)."""
    return _compat.pallas().CostEstimate(
        flops=int(size * flops), transcendentals=int(size * transcendentals),
        bytes_accessed=int(nbytes(*io)))


def attention(*, queries: int, keys: int, head_dim: int, causal: bool = False,
              io: tuple = (), kv_bytes: int = 0) -> Any:
    """Attention of ``queries`` (query, head) rows over ``keys`` keys each: two products of
    ``2 * head_dim`` flops and one exp per (row, key); half of that when ``causal`` (a
    square causal mask). ``io``: the arrays read and written whole; ``kv_bytes``: the K/V
    bytes read besides (a paged kernel reads a sequence's pages, not the pool)."""
    pairs = queries * keys // (2 if causal else 1)
    return _compat.pallas().CostEstimate(
        flops=int(4 * pairs * head_dim), transcendentals=int(pairs),
        bytes_accessed=int(nbytes(*io) + kv_bytes))
