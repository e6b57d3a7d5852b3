"""Pallas TPU kernel (Mosaic): the grouped matrix multiply ``out[r] = x[r] @ w[group of r]``.

The megablox pattern (JAX's ``pallas/ops/tpu/megablox/gmm.py``): the rows are cut into
tiles of ``block_m``, and a schedule computed from the group sizes in XLA
(:func:`forge_jax.ops.grouped_matmul.tile_schedule`) lists the (row tile, group) visits:
each non-empty group visits every tile its rows touch, a tile shared by several groups is
visited once per group, one after the other. The schedule is scalar-prefetched, so the
block index maps read it: grid ``(n tiles, visits, k tiles)``, step ``s`` multiplies the
``[block_m, block_k]`` tile of ``x`` by the ``[block_k, block_n]`` block of its group's
``w``, accumulates in a float32 VMEM scratch, and at the last ``k`` tile writes the rows of
the tile that belong to its group (a select, so rows of other groups, and NaN padding rows,
never leak). The grid has the static upper bound ``cdiv(m, block_m) + groups - 1`` of
visits; steps past the real count repeat the last visit's blocks and compute nothing.
Rows of no group are set to zero in XLA afterwards. Empty groups are never visited.

Groups are the bounds the op binds (``group_starts``, ``group_ends``), so the kernel also
serves one shard's groups when the partition rule splits them over a mesh.

The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.grouped_matmul.grouped_matmul`; reference: its XLA implementation
:func:`forge_jax.ops.grouped_matmul.grouped_matmul_xla`. Tests:
``tests/test_pallas_tpu_grouped_matmul.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.grouped_matmul import cdiv, grouped_matmul_xla, tile_schedule
from forge_jax.pallas_kernels import _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.tpu import _common
from forge_jax.quant import QuantizedArray

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes: rows per tile (a multiple of 16, or all the rows), and the ``k`` and
    ``n`` blocks (multiples of 128, or the whole dimension)."""

    block_m: int
    block_k: int
    block_n: int


# The defaults per TPU generation (``jax.Device.device_kind``; "default" serves any other
# kind, "interpret" the TPU interpreter). A step holds an x tile, a w block (double
# buffered) and a float32 accumulator: 512 x 512 blocks in bfloat16 stay near 2 MiB.
# Untuned, pending measurements on TPU hardware.
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_m=128, block_k=512, block_n=512),
    v5p=dict(block_m=256, block_k=512, block_n=512),
    v6e=dict(block_m=256, block_k=512, block_n=1024),
    interpret=dict(block_m=128, block_k=128, block_n=128),
    default=dict(block_m=128, block_k=512, block_n=512))


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The tile sizes on ``device_kind`` from :data:`TUNED` (the same for any arguments)."""
    del args
    return Config(**_common.tuned(TUNED, device_kind))


def block_sizes(m: int, k: int, n: int, config: Config) -> tuple[int, int, int]:
    """``(tm, tk, tn)`` for an ``[m, k] @ [k, n]`` problem: a dimension no larger than its
    block is one block; ``tk`` divides ``k`` (a partial ``k`` block would add garbage
    products to every row), the largest multiple of 128 up to ``block_k`` that does."""
    tm = m if m <= config.block_m else config.block_m
    tk = k if k <= config.block_k else next(
        (b for b in range(config.block_k // 128 * 128, 0, -128) if k % b == 0), k)
    tn = n if n <= config.block_n else config.block_n
    return tm, tk, tn


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.grouped_matmul` arguments, else
    why not."""
    x, w = args["x"], args["w"]
    if isinstance(w, QuantizedArray):
        return (f"a quantized w ({w.format}): the kernel reads float w; in-kernel "
                "dequantization is not written yet (the XLA implementation dequantizes one "
                "group at a time)")
    if args.get("trans_w", False):
        return ("trans_w=True: the kernel reads w as [groups, k, n] blocks (the XLA "
                "implementation serves [groups, n, k])")
    if jnp.dtype(x.dtype) not in _common.FLOAT_DTYPES:
        return (f"x.dtype={jnp.dtype(x.dtype).name}; the kernel is built and tested for "
                "float32/bfloat16, the TPU inference dtypes")
    k, n = w.shape[1], w.shape[2]
    if k % _common.LANES or n % _common.LANES:
        return (f"k={k} and n={n} must be multiples of {_common.LANES}: the kernel is built "
                "for lane-dense x and w blocks (a policy: whole unaligned dimensions pass the "
                "Mosaic lowering but no TPU has compiled them)")
    return None


def _kernel(group_ids_ref, tile_ids_ref, starts_ref, ends_ref, visits_ref,  # prefetched
            x_ref, w_ref, out_ref, acc_ref, *, tiles_k):
    # x_ref [tm, tk]: this visit's row tile; w_ref [tk, tn]: its group's block;
    # out_ref [tm, tn]; acc_ref [tm, tn] float32.
    s, k_i = pl.program_id(1), pl.program_id(2)
    real = s < visits_ref[0]

    @pl.when(k_i == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(real)
    def _accumulate():
        acc_ref[...] += jax.lax.dot_general(
            x_ref[...], w_ref[...], (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    @pl.when(real & (k_i == tiles_k - 1))
    def _store():
        tm, tn = out_ref.shape
        group = group_ids_ref[s]
        rows = tile_ids_ref[s] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (rows >= starts_ref[group]) & (rows < ends_ref[group])
        # A select, not a blend: the other rows keep what earlier visits wrote (or
        # garbage, zeroed in XLA), and NaN in rows of no group stays out.
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "interpret"))
def grouped_matmul_forward(x, w, group_starts, group_ends, *, block_m, block_k, block_n,
                           interpret=False):
    """The kernel alone (no VJP).

    Args:
      x: ``[m, k]``; w: ``[groups, k, n]``, one dtype (float32/bfloat16).
      group_starts, group_ends: int32 ``[groups]``, consecutive row ranges (as the op binds
        them).
      block_m, block_k, block_n: see :class:`Config` (:func:`block_sizes` fits them).
      interpret: run in the TPU interpreter (any platform).
    """
    m, k = x.shape
    groups, _, n = w.shape
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    tm, tk, tn = block_sizes(m, k, n, Config(block_m, block_k, block_n))
    tiles_k = k // tk
    group_ids, tile_ids, visits = tile_schedule(group_starts, group_ends, m, tm)
    steps = group_ids.shape[0]

    def x_map(n_i, s, k_i, gid, tid, *_):
        return tid[s], k_i

    def w_map(n_i, s, k_i, gid, tid, *_):
        return gid[s], k_i, n_i

    def out_map(n_i, s, k_i, gid, tid, *_):
        return tid[s], n_i

    pltpu = _compat.pallas_tpu()
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m * k * n, transcendentals=0,
        bytes_accessed=itemsize * (m * k * cdiv(n, tn) + groups * k * n + m * n))
    out = pl.pallas_call(
        functools.partial(_kernel, tiles_k=tiles_k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(cdiv(n, tn), steps, tiles_k),
            in_specs=[pl.BlockSpec((tm, tk), x_map), pl.BlockSpec((None, tk, tn), w_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_grouped_matmul",
    )(group_ids, tile_ids, group_starts, group_ends, visits[None], x, w)
    # Rows of no group were never written (or hold another visit's garbage): zeros.
    rows = jnp.arange(m, dtype=jnp.int32)[:, None]
    covered = (rows >= group_starts[0]) & (rows < group_ends[-1])
    return jnp.where(covered, out, jnp.zeros((), out.dtype))


def _reference(x, w, group_starts, group_ends):
    return grouped_matmul_xla(x, w, group_starts=group_starts, group_ends=group_ends)


_grouped_matmul = with_reference_vjp(grouped_matmul_forward, _reference)


def grouped_matmul(x, w, *, group_starts, group_ends, trans_w=False, block_m=None, block_k=None,
                   block_n=None, interpret=False):
    """:func:`forge_jax.grouped_matmul` through the kernel; differentiable (the XLA
    implementation's VJP).

    Args:
      x, w, group_starts, group_ends, trans_w: as the op binds them (float ``w``,
        ``trans_w=False``: :func:`supports` refuses the others).
      block_m, block_k, block_n: override :data:`TUNED`'s entry.
      interpret: run in the TPU interpreter (any platform).
    """
    reason = supports(dict(x=x, w=w, trans_w=trans_w))
    if reason is not None and (trans_w or isinstance(w, QuantizedArray)):
        raise ValueError(f"the TPU grouped_matmul kernel cannot serve this: {reason}")
    config = default_config({}, _common.device_kind(interpret))
    config = dataclasses.replace(config, **{name: v for name, v in (
        ("block_m", block_m), ("block_k", block_k), ("block_n", block_n)) if v is not None})
    return _grouped_matmul(x, w, group_starts, group_ends, interpret=interpret,
                           **dataclasses.asdict(config))


_registration.register(
    "grouped_matmul", grouped_matmul, backend="tpu", supports=supports, verified=VERIFIED,
    description="megablox schedule of (row tile, group) visits, scalar-prefetched")
