"""What every Pallas GPU (Triton-lowered) kernel shares: the hardware facts it is built
against (dtypes, dot sizes, compute capability, the device kinds its tables know), where
it can run, the lookup of its ``TUNED`` table (:func:`tuned`), and small helpers
(:func:`dot_size`, :func:`next_pow2`, :func:`with_knobs`, :func:`online_softmax_step`).
How it registers (``"pallas"`` on GPU, by name until verified there;
``"pallas_gpu_interpret"`` by name everywhere) is
:mod:`forge_jax.pallas_kernels._registration`."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from forge_jax import _compat, backends, targets

# The Triton lowering supports compute capability 8.0 and up (A100, L4, H100); XLA refuses
# it on a T4 (7.5), the most common free Colab GPU.
MIN_CAPABILITY = (8, 0)
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton dots need every dimension >= 16


# The GPUs the kernels' tables (each kernel module's ``TUNED``) have rows for, matched as
# words of ``jax.Device.device_kind`` ("H100" matches "NVIDIA H100 80GB HBM3", "L4" matches
# "NVIDIA L4" but not "NVIDIA L40S"); "default" serves every other kind and the interpreter.
# What the per-kind rows are sized against: shared memory per SM (H100 228 KiB, A100
# 164 KiB, L4 100 KiB) and SMs (132, 108, 58; B200: 148, a row of the Mosaic GPU
# quantized matmul's table only).
DEVICE_KINDS = ("H100", "B200", "A100", "L4")


def kind_row(device_kind: str | None, kinds: Sequence[str] = DEVICE_KINDS) -> str:
    """The row of ``device_kind`` among ``kinds`` (e.g. "NVIDIA A100-SXM4-80GB" -> "A100"),
    "default" for None or an unlisted kind."""
    if device_kind:
        for kind in kinds:
            if re.search(rf"\b{re.escape(kind)}\b", device_kind):
                return kind
    return "default"


def tuned(table: Mapping[str, Any], device_kind: str | None,
          size: int | None = None) -> dict[str, int]:
    """The entry of ``device_kind`` in a kernel's ``TUNED`` table (its "default" row when the
    table has none for that kind). A bucketed table (padded size -> knobs) gives the
    entry of the smallest bucket >= ``size`` (the largest bucket past the table)."""
    entry = table[kind_row(device_kind, [kind for kind in DEVICE_KINDS if kind in table])]
    if size is None:
        return dict(entry)
    return dict(entry[min((b for b in entry if b >= size), default=max(entry))])


def triton_call(kernel: Any, *, num_warps: int, num_stages: int, **kwargs: Any) -> Any:
    """``pl.pallas_call(kernel, **kwargs)`` lowered by Triton with ``num_warps`` warps and
    ``num_stages`` pipeline stages."""
    return _compat.pallas().pallas_call(
        kernel, compiler_params=_compat.triton_compiler_params(num_warps=num_warps,
                                                              num_stages=num_stages),
        **kwargs)


def with_knobs(config: Any, **knobs: int | None) -> Any:
    """``config`` (a kernel's ``Config``) with the wrapper's knobs that are not None in place
    of its own."""
    return dataclasses.replace(config, **{k: v for k, v in knobs.items() if v is not None})


def check_dot_blocks(**blocks: int) -> None:
    """Raises unless every block size (by its argument's name) is a power of two that is
    one Triton dot wide (>= :data:`MIN_DOT`)."""
    for name, b in blocks.items():
        if b < MIN_DOT or next_pow2(b) != b:
            raise ValueError(f"{name}={b} must be a power of two >= {MIN_DOT}")


def dot_size(n: int) -> int:
    """The smallest power of two >= ``n`` that is one Triton dot wide (>= :data:`MIN_DOT`):
    the padded head dim of the attention kernels (the bucket of their tables), their row
    and key blocks."""
    return max(MIN_DOT, next_pow2(n))


def online_softmax_step(s, m, l_sum):
    """One key block of the GPU kernels' online softmax (kernel code, float32).

    ``s [rows, keys]``: the block's logits, hidden keys ``-inf``; ``m, l_sum [rows]``: the
    running max and sum. Returns ``(p, correction, m_next, l_sum_next)``: the block's
    unnormalised probabilities, the factor that rescales what was accumulated before, and
    the updated max and sum.
    """
    m_next = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
    p = jnp.exp(s - m_safe[:, None])
    correction = jnp.exp(m - m_safe)
    return p, correction, m_next, correction * l_sum + p.sum(axis=-1)


def capability(cc: str | None) -> tuple[int, int] | None:
    """``"9.0"`` -> ``(9, 0)``."""
    if not cc:
        return None
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def gpu_reason(platform: str) -> str | None:
    """``None`` if Triton-lowered kernels can run on ``platform`` here, else why not."""
    if platform != "gpu":
        return f"a GPU kernel, not for {platform}"
    cc = backends.gpu_compute_capability()
    if cc is None:
        return "no GPU device in this process"
    if capability(cc) < MIN_CAPABILITY:
        return (f"the Pallas Triton lowering needs compute capability >= "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; this GPU has {cc}")
    return None


def device_kind(interpret: bool = False) -> str | None:
    """The GPU's device kind (e.g. "NVIDIA H100 80GB HBM3") for the launch tables, or None
    in interpret mode or without a usable GPU (the tables' defaults then apply). Inside
    ``fj.targets.use``, the target's."""
    if interpret or gpu_reason("gpu") is not None:
        return None
    return targets.device_kind("gpu")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton blocks must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

