"""What every Pallas TPU (Mosaic) kernel shares: how it registers with the dispatch registry.

Each kernel registers twice under the same wrapper:

* ``"pallas"`` on the ``"tpu"`` platform, lowered by Mosaic, and ranked above XLA there by
  auto selection. The kernels are verified in the TPU interpreter on CPU and their Mosaic
  lowering runs here (``jax.export`` for ``platforms=["tpu"]``), but none has run on TPU
  hardware yet: ``INTERPRETER_ONLY`` says so beside the priority, and the README states it.
* ``"pallas_tpu_interpret"`` on every platform, by name only: the same kernel code in the
  TPU interpreter (``pltpu.InterpretParams``: race detection, NaN-poisoned uninitialised
  memory), which is how CI checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import backends, dispatch

TPU_PRIORITY = 10
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LANES = 128  # the lane width of a vreg: the last dimension of a lane-dense block
# Where the TPU kernels were verified. Auto selection ranks them on a TPU (as the TPU issue
# asks) although this record names no TPU hardware yet.
INTERPRETER_ONLY = "TPU interpreter on CPU and Mosaic lowering via jax.export; no TPU hardware"


# Launch defaults of every TPU kernel per TPU generation, in one table:
# ``jax.Device.device_kind`` -> op -> keyword knobs. "default" serves any other kind, and
# the interpreter (where "interpret" rows, when an op has one, come first). Untuned: sized
# against each generation's default scoped VMEM (16 MiB on v4/v5e, 32 MiB on v5p/v6e),
# pending measurements on TPU hardware.
#   rms_norm, silu_mul, rope: elements per block of each array (rows = elements // width,
#     rounded down to the sublane tile);
#   attention: query rows and keys per block; paged_attention: keys per K/V block;
#   ragged_paged_attention: query rows per block and keys per K/V block.
_SMALL_VMEM = {  # 16 MiB of scoped VMEM: v4, v5e
    "rms_norm": dict(block_elements=128 * 1024),
    "silu_mul": dict(block_elements=256 * 1024),
    "rope": dict(block_elements=256 * 1024),
    "attention": dict(block_q=256, block_k=512),
    "paged_attention": dict(block_k=256),
    "ragged_paged_attention": dict(block_q=32, kv_block=256),
}
_LARGE_VMEM = {  # 32 MiB of scoped VMEM: v5p
    "rms_norm": dict(block_elements=256 * 1024),
    "silu_mul": dict(block_elements=512 * 1024),
    "rope": dict(block_elements=512 * 1024),
    "attention": dict(block_q=512, block_k=512),
    "paged_attention": dict(block_k=512),
    "ragged_paged_attention": dict(block_q=32, kv_block=512),
}
TUNING: Mapping[str, Mapping[str, Mapping[str, int]]] = {
    "TPU v4": _SMALL_VMEM,
    "TPU v5 lite": _SMALL_VMEM,  # v5e
    "TPU v5": _LARGE_VMEM,       # v5p, as jax names it
    "TPU v5p": _LARGE_VMEM,
    "TPU v6 lite": {             # v6e: 32 MiB, and a faster MXU for bigger attention blocks
        **_LARGE_VMEM,
        "attention": dict(block_q=512, block_k=1024),
        "ragged_paged_attention": dict(block_q=64, kv_block=512),
    },
    "interpret": {
        # Small blocks keep the interpreter's per-step work (and the tests) short.
        "ragged_paged_attention": dict(block_q=16, kv_block=32),
    },
    "default": {**_SMALL_VMEM, "attention": dict(block_q=128, block_k=128)},
}
GENERATIONS = ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v5p", "TPU v6 lite")


def tuning(op: str, device_kind: str | None = None) -> Mapping[str, int]:
    """The launch defaults of ``op`` on ``device_kind`` (None: the defaults) from
    :data:`TUNING`."""
    row = TUNING.get(device_kind or "default", {})
    return row.get(op, TUNING["default"][op])


def sublane_tile(dtype) -> int:
    """Rows of one (8, 128) vreg tile of ``dtype``: 8 for 32-bit, 16 for packed 16-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def device_kind(interpret: bool = False) -> str | None:
    """The TPU's device kind (e.g. "TPU v5 lite") for the per-generation tables, or None
    in the interpreter or off a TPU (the tables' defaults then apply)."""
    if interpret or jax.default_backend() != "tpu":
        return None
    return jax.devices()[0].device_kind


def register(
    op: str,
    kernel: Callable[..., Any],
    *,
    supports: Callable[[Mapping[str, Any]], str | None],
    description: str,
) -> None:
    """Registers ``kernel(**op_args, interpret=...)`` as ``"pallas"`` (TPU, auto-ranked) and
    ``"pallas_tpu_interpret"`` (any platform, by name).

    ``supports(args)`` returns ``None`` or why the kernel cannot serve ``args``: the contract
    with the Mosaic lowering (every case it accepts must lower for TPU, and each rejection
    made for a lowering reason is shown to fail that lowering in a test). ``interpret`` is
    ``False`` or ``True`` (the wrapper turns ``True`` into the forge_jax interpret params).
    """
    dispatch.register(
        op, "pallas", platforms=("tpu",), priority={"tpu": TPU_PRIORITY},
        supports=lambda args, platform: supports(args),
        available=lambda: None if backends.has_platform("tpu") else "no TPU device in this process",
        description=f"{description} (Pallas, Mosaic TPU; {INTERPRETER_ONLY})",
    )(lambda **args: kernel(**args, interpret=False))
    dispatch.register(
        op, "pallas_tpu_interpret",
        supports=lambda args, platform: supports(args),
        description=f"{description} (Pallas TPU kernel in the TPU interpreter)",
    )(lambda **args: kernel(**args, interpret=True))
