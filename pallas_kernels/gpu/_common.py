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

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import backends, dispatch, registry
from forge_jax.pallas_kernels._attention_common import POS_LIMIT  # noqa: F401

# The Triton lowering supports compute capability 8.0 and up (A100, L4, H100); XLA refuses
# it on a T4 (7.5), the most common free Colab GPU.
MIN_CAPABILITY = (8, 0)
GPU_PRIORITY = 10
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_DOT = 16  # Triton dots need every dimension >= 16


# Launch defaults of every GPU kernel per device kind, in one table: a kind (matched as a
# word of ``jax.Device.device_kind``: "H100" matches "NVIDIA H100 80GB HBM3", "L4" matches
# "NVIDIA L4" but not "NVIDIA L40S") -> op -> knobs. "default" serves every other kind, the
# interpreter, and any op a kind leaves out. Bucketed ops map the padded size that selects
# the launch (hidden size for rms_norm, head dim for rope and attention) to the knobs of the
# smallest bucket >= it:
#   rms_norm: rows per program (block_rows) and warps;
#   silu_mul: elements per program (block_size) and warps;
#   rope: tokens and heads per program (block_tokens, block_heads) and warps;
#   attention: query rows and keys per program step (block_q, block_k), warps, stages;
#   paged_attention: keys per compute block (block_k), the most programs one sequence's
#     keys are split over (max_splits), query rows per program (block_rows), warps, stages;
#   triton_rms_norm, triton_silu_mul, triton_rope: the jax-triton kernels' equivalents.
# None of these is measured yet (no GPU has run the kernels): "default" holds the ranges of
# JAX's own Pallas kernels and Triton's tutorials; the per-kind rows only size the attention
# tiles and split counts to each device (shared memory per SM: H100 228 KiB, A100 164 KiB,
# L4 100 KiB; SMs: 132, 108, 58). fj.autotune measures, per shape, what these guess.
_ELEMENTWISE = {
    "rms_norm": {
        256: dict(block_rows=16, num_warps=4),
        1024: dict(block_rows=8, num_warps=4),
        2048: dict(block_rows=4, num_warps=8),
        4096: dict(block_rows=2, num_warps=8),
        8192: dict(block_rows=1, num_warps=8),
        32768: dict(block_rows=1, num_warps=16),
    },
    # 16 elements, two 16-byte bf16 vectors, per thread.
    "silu_mul": dict(block_size=4096, num_warps=8),
    "rope": {
        64: dict(block_tokens=8, block_heads=16, num_warps=4),
        128: dict(block_tokens=4, block_heads=16, num_warps=4),
        256: dict(block_tokens=2, block_heads=16, num_warps=4),
        512: dict(block_tokens=1, block_heads=16, num_warps=8),
    },
    "triton_rms_norm": {
        1024: dict(num_warps=4),
        4096: dict(num_warps=8),
        32768: dict(num_warps=16),
    },
    "triton_silu_mul": dict(block_size=4096, num_warps=8),
    "triton_rope": {  # heads per program (one token each)
        64: dict(block_heads=16, num_warps=2),
        128: dict(block_heads=16, num_warps=4),
        256: dict(block_heads=8, num_warps=4),
        512: dict(block_heads=4, num_warps=4),
    },
}
TUNING: Mapping[str, Mapping[str, Any]] = {
    "default": {
        **_ELEMENTWISE,
        "attention": {
            64: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
            128: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
            256: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        },
        "paged_attention": {
            64: dict(block_k=64, max_splits=16, block_rows=64, num_warps=4, num_stages=2),
            128: dict(block_k=64, max_splits=16, block_rows=64, num_warps=4, num_stages=2),
            256: dict(block_k=32, max_splits=16, block_rows=32, num_warps=8, num_stages=2),
        },
    },
    "H100": {
        "attention": {
            64: dict(block_q=128, block_k=64, num_warps=4, num_stages=3),
            128: dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
            256: dict(block_q=64, block_k=32, num_warps=8, num_stages=2),
        },
        "paged_attention": {
            64: dict(block_k=64, max_splits=32, block_rows=64, num_warps=4, num_stages=3),
            128: dict(block_k=64, max_splits=32, block_rows=64, num_warps=4, num_stages=3),
            256: dict(block_k=32, max_splits=32, block_rows=32, num_warps=8, num_stages=2),
        },
    },
    "A100": {
        "attention": {
            64: dict(block_q=128, block_k=64, num_warps=4, num_stages=2),
            128: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
            256: dict(block_q=32, block_k=32, num_warps=8, num_stages=2),
        },
    },
    "L4": {
        "attention": {
            64: dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
            128: dict(block_q=64, block_k=32, num_warps=4, num_stages=2),
            256: dict(block_q=32, block_k=32, num_warps=4, num_stages=1),
        },
        "paged_attention": {
            64: dict(block_k=64, max_splits=8, block_rows=64, num_warps=4, num_stages=2),
            128: dict(block_k=32, max_splits=8, block_rows=32, num_warps=4, num_stages=2),
            256: dict(block_k=16, max_splits=8, block_rows=16, num_warps=4, num_stages=1),
        },
    },
}
DEVICE_KINDS = ("H100", "A100", "L4")


def kind_row(device_kind: str | None) -> str:
    """The :data:`TUNING` row of ``device_kind`` (e.g. "NVIDIA A100-SXM4-80GB" -> "A100"),
    "default" for None or an unlisted kind."""
    if device_kind:
        for kind in DEVICE_KINDS:
            if re.search(rf"\b{re.escape(kind)}\b", device_kind):
                return kind
    return "default"


def tuning(op: str, device_kind: str | None = None, size: int | None = None) -> dict[str, int]:
    """The launch defaults of ``op`` on ``device_kind`` from :data:`TUNING`; for a bucketed
    op, those of the smallest bucket >= ``size`` (the largest bucket past the table)."""
    entry = TUNING[kind_row(device_kind)].get(op, TUNING["default"][op])
    if size is None:
        return dict(entry)
    return dict(entry[min((b for b in entry if b >= size), default=max(entry))])


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
    configs: registry.ConfigsFn | None = None,
    interpret_configs: registry.ConfigsFn | None = None,
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
        available=lambda: gpu_reason("gpu"), configs=configs,
        description=f"{description} (Pallas, Triton lowering)",
    )(lambda **args: kernel(**args, interpret=False))
    dispatch.register(
        op, "pallas_gpu_interpret",
        supports=lambda args, platform: supports(args), configs=interpret_configs,
        description=f"{description} (Pallas GPU kernel in interpret mode)",
    )(lambda **args: kernel(**args, interpret=True))
