"""What every Pallas TPU (Mosaic) kernel shares: the hardware facts it is built against
(dtypes, lanes, sublane tiles) and where it can run. How it registers (``"pallas"`` on TPU,
by name until verified there; ``"pallas_tpu_interpret"`` by name everywhere) is
:mod:`forge_jax.pallas_kernels._registration`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from forge_jax import _compat, backends, targets

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LANES = 128  # the lane width of a vreg: the last dimension of a lane-dense block


# The TPU generations the kernels' tables (each kernel module's ``TUNED``) have rows for, as
# ``jax.Device.device_kind`` names them (matched exactly: "TPU v5" is v5p, "TPU v5 lite"
# v5e, "TPU v6 lite" v6e), and their default scoped VMEM in MiB, what the rows are sized
# against. In a table, "default" serves any other kind and "interpret" (where a table has
# it) the TPU interpreter.
SCOPED_VMEM_MIB: Mapping[str, int] = {
    "TPU v4": 16, "TPU v5 lite": 16, "TPU v5": 32, "TPU v5p": 32, "TPU v6 lite": 32,
}
GENERATIONS = tuple(SCOPED_VMEM_MIB)
# Whether the generation's MXU multiplies int8 in a Mosaic kernel (int32 accumulation), by
# device kind, as libtpu's compiler settles it (libtpu 0.0.42.1, deviceless, 2026-11-25):
# v5e, v5p and v6e compile an int8 x int8 -> int32 ``tpu.matmul`` (JAX's
# ``pallas/mosaic/tpu_info.py`` gives them twice their bfloat16 rate); v4 refuses it
# ("CompileTimeMosaicUnsupportedRhsType: Unsupported matmul RHS type on target:
# vector<128x128xi8>", though Google Cloud's v4 page lists int8 at the bfloat16 rate);
# TPU7x (Ironwood) multiplies fp8, not int8 (tpu_info lists no int8 rate for it).
INT8_MXU: Mapping[str, bool] = {
    "TPU v4": False, "TPU v5 lite": True, "TPU v5": True, "TPU v5p": True, "TPU v6 lite": True,
    "TPU7x": False,
}


def per_generation(*, v4_v5e: Mapping[str, int], v5p: Mapping[str, int],
                   v6e: Mapping[str, int], default: Mapping[str, int],
                   interpret: Mapping[str, int] | None = None) -> dict[str, Mapping[str, int]]:
    """A kernel's ``TUNED`` table: its launch knobs per TPU generation (``jax.Device.
    device_kind``, :data:`GENERATIONS`), sized against each one's default scoped VMEM
    (:data:`SCOPED_VMEM_MIB`: 16 MiB on v4 and v5e, which share a row; 32 MiB on v5p,
    named "TPU v5" and "TPU v5p", and on v6e). "default" serves any other kind, and the
    interpreter unless ``interpret`` gives its row."""
    table = {"TPU v4": v4_v5e, "TPU v5 lite": v4_v5e, "TPU v5": v5p, "TPU v5p": v5p,
             "TPU v6 lite": v6e}
    if interpret is not None:
        table["interpret"] = interpret
    return {**table, "default": default}


def tuned(table: Mapping[str, Mapping[str, int]], device_kind: str | None) -> dict[str, int]:
    """The entry of ``device_kind`` in a kernel's ``TUNED`` table, its "default" entry for
    None or a kind the table has no row for."""
    return dict(table.get(device_kind or "default", table["default"]))


def sublane_tile(dtype) -> int:
    """Rows of one (8, 128) vreg tile of ``dtype``: 8 for 32-bit, 16 for packed 16-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """An elementwise kernel's launch parameter: elements per block (of each array); its
    wrapper's rows per block are ``block_elements`` over a row's width, rounded down to the
    sublane tile (:func:`block_rows`)."""

    block_elements: int


def block_config(table: Mapping[str, Mapping[str, int]]
                 ) -> Callable[[Mapping[str, Any], str | None], BlockConfig]:
    """The ``default_config(args, device_kind=None)`` of an elementwise kernel whose
    ``TUNED`` table is ``table``: the tuned launch parameter on ``device_kind``, the same
    for any arguments."""
    def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> BlockConfig:
        del args
        return BlockConfig(**tuned(table, device_kind))

    return default_config


def block_rows(block_elements: int, width: int, dtype) -> int:
    """Rows of ``width`` elements of ``dtype`` in a block of ``block_elements``: a multiple
    of the sublane tile, at least one."""
    tile = sublane_tile(dtype)
    return max(tile, block_elements // width // tile * tile)


def page_buffers(k_pages, k_scales, v_scales, *, pages: int, page_size: int):
    """The paged kernels' pool scratch: ``(buf, scales, scales_buf)``, a VMEM double
    buffer of ``pages`` pages as the pool stores them, the pools' scales in float32 (none
    for unquantized pools) and a VMEM double buffer of their ``page_size`` scales a page."""
    pltpu = _compat.pallas_tpu()
    buf = pltpu.VMEM((2, pages) + k_pages.shape[2:], k_pages.dtype)
    scales = () if k_scales is None else (k_scales.astype(jnp.float32),
                                          v_scales.astype(jnp.float32))
    return buf, scales, pltpu.VMEM((2, pages, page_size, 1), jnp.float32)


def device_kind(interpret: bool = False) -> str | None:
    """The row of the per-generation tables: the TPU's device kind (e.g. "TPU v5 lite"),
    "interpret" in the TPU interpreter, None off a TPU (the tables' defaults then apply).
    Inside ``fj.targets.use``, the target's."""
    if interpret:
        return "interpret"
    if targets.platform() != "tpu":
        return None
    return targets.device_kind("tpu")


def tpu_reason(platform: str) -> str | None:
    """``None`` if Mosaic-lowered kernels are for ``platform``, else why not."""
    return None if platform == "tpu" else f"a TPU kernel, not for {platform}"


def tpu_available() -> str | None:
    """``None`` if this process has a TPU to run Mosaic-lowered kernels on, else why not."""
    return None if backends.has_platform("tpu") else "no TPU device in this process"
