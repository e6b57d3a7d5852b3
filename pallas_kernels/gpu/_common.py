"""What every Pallas GPU (Triton-lowered) kernel shares: where it can run, and how it
registers with the dispatch registry.

Each kernel registers twice under the same wrapper:

* ``"pallas"`` on the ``"gpu"`` platform, compiled through the Triton lowering. Auto
  selection ranks it above XLA only once the module's ``VERIFIED`` record names a GPU
  (device, JAX version, date) where it was compiled, checked and measured faster;
  until then it runs by name and ``fj.explain`` says it is not yet verified.
* ``"pallas_gpu_interpret"`` on every platform, by name only: the same kernel code in
  Pallas' interpreter (how CI checks it on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import autotuning, backends, dispatch
from forge_jax.pallas_kernels._attention_common import POS_LIMIT  # noqa: F401

# The Triton lowering supports compute capability 8.0 and up (A100, L4, H100); XLA refuses
# it on a T4 (7.5), the most common free Colab GPU.
MIN_CAPABILITY = (8, 0)
GPU_PRIORITY = 10
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton dots need every dimension >= 16


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
    in interpret mode or without a usable GPU (the tables' defaults then apply)."""
    if interpret or gpu_reason("gpu") is not None:
        return None
    return jax.devices("gpu")[0].device_kind


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton blocks must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def register(
    op: str,
    kernel: Callable[..., Any],
    *,
    supports: Callable[[Mapping[str, Any]], str | None],
    description: str,
    verified: Mapping[str, str],
    configs: autotuning.ConfigsFn | None = None,
    interpret_configs: autotuning.ConfigsFn | None = None,
) -> None:
    """Registers ``kernel(**op_args, interpret=...)`` as ``"pallas"`` (GPU) and
    ``"pallas_gpu_interpret"`` (any platform, by name).

    ``supports(args)`` returns ``None`` or why the kernel cannot serve ``args``; it is
    the contract with the real lowering (every case it accepts must compile for CUDA).
    ``verified``: ``{"gpu": "NVIDIA H100 80GB, JAX 0.11.2, 2026-..."}`` once the kernel
    was compiled, checked and measured faster than XLA there; ``{}`` until then.
    ``configs(args)``: the launch configurations :func:`forge_jax.autotune` times on a GPU
    besides the table's defaults; ``interpret_configs(args)``: a few for the interpreter.
    """
    dispatch.register(
        op, "pallas", platforms=("gpu",), priority={"gpu": GPU_PRIORITY}, verified=verified,
        supports=lambda args, platform: gpu_reason(platform) or supports(args),
        available=lambda: gpu_reason("gpu"),
        description=f"{description} (Pallas, Triton lowering)",
    )(lambda **args: kernel(**args, interpret=False))
    dispatch.register(
        op, "pallas_gpu_interpret",
        supports=lambda args, platform: supports(args),
        description=f"{description} (Pallas GPU kernel in interpret mode)",
    )(lambda **args: kernel(**args, interpret=True))
    if configs is not None:
        autotuning.register_configs(op, "pallas", configs)
    if interpret_configs is not None:
        autotuning.register_configs(op, "pallas_gpu_interpret", interpret_configs)
