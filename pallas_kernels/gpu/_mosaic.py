"""What every Mosaic GPU kernel shares: the hardware it needs, where it can run, and how
it runs in the Mosaic GPU interpreter.

Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``: TMA, WGMMA, tcgen05, warpgroups,
barriers) is the GPU backend JAX maintains. The backend needs compute capability 9.x or 10.x
(:func:`mosaic_reason`); which matrix unit a kernel multiplies with is its own record's
concern (:func:`mma_kind`). Most of forge_jax's Mosaic GPU kernels multiply with Hopper's
WGMMA, sm_90a only: Blackwell (10.x, sm_100a) has tcgen05 (accumulators in tensor memory)
instead, and Mosaic GPU's compile for ``b200`` refuses WGMMA ("'nvvm.wgmma.fence.aligned'
op is not supported on sm_100a", BENCHMARKS.md), so their ``supports()`` refuse 10.x with
:func:`wgmma_reason`; the kernels with a tcgen05 variant (flash attention forward, paged
decode, the int8/fp8 per-channel quantized matmul: ``*_sm100.py``) serve it.
They register as ``"mosaic_gpu"`` on GPU (ranked by auto only where a ``verified`` record
names the device) and ``"mosaic_gpu_interpret"`` by name everywhere: the same kernel code in
the Mosaic GPU interpreter (race detection, poisoned uninitialised shared memory), which is
how CI checks them on CPU (the tcgen05 variants need JAX 0.12's interpreter, the first with
tensor memory: :func:`interpreter_has_tmem`). The Triton-lowered kernels beside them
(``"pallas"``) stay the path of Ampere and Ada.
Registration: :mod:`forge_jax.pallas_kernels._registration` (``backend="mosaic_gpu"``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
from jax import lax

from forge_jax import _compat, backends
from forge_jax.pallas_kernels.gpu import _common

MIN_CAPABILITY = (9, 0)  # TMA: Hopper (sm_90a) and newer
# WGMMA lowers for sm_90a only: Blackwell (10.x, sm_100a) refuses it at compile time.
WGMMA_MAJOR = 9
TCGEN05_MAJOR = 10  # Blackwell datacenter parts (sm_100a): tcgen05 and tensor memory
MAJORS = (WGMMA_MAJOR, TCGEN05_MAJOR)
SWIZZLE = 128  # bytes: the widest shared-memory swizzle of the matrix units' operands
LOG2E = math.log2(math.e)


def mosaic_reason(platform: str) -> str | None:
    """``None`` if Mosaic GPU kernels can run on ``platform`` here (inside
    ``fj.targets.use``: on the target), else why not. Each record's ``supports()`` then
    states the matrix unit it needs (:func:`wgmma_reason`)."""
    if platform != "gpu":
        return f"a GPU kernel, not for {platform}"
    cc = backends.gpu_compute_capability()
    if cc is None:
        return "no GPU device in this process"
    if _common.capability(cc) < MIN_CAPABILITY:
        return (f"Mosaic GPU needs compute capability >= {MIN_CAPABILITY[0]}."
                f"{MIN_CAPABILITY[1]} (Hopper or newer); this GPU has {cc}")
    if _common.capability(cc)[0] not in MAJORS:
        return (f"forge_jax's Mosaic GPU kernels multiply with WGMMA (compute capability "
                f"{WGMMA_MAJOR}.x) or tcgen05 ({TCGEN05_MAJOR}.x); this GPU has {cc}")
    return None


def mma_kind() -> str:
    """The matrix unit of the GPU here (inside ``fj.targets.use``: the target's):
    ``"tcgen05"`` on compute capability 10.x (Blackwell), else ``"wgmma"`` (Hopper, and
    the interpreter's default without a GPU)."""
    cc = _common.capability(backends.gpu_compute_capability())
    return "tcgen05" if cc is not None and cc[0] == TCGEN05_MAJOR else "wgmma"


def wgmma_reason() -> str | None:
    """Why a kernel that multiplies with WGMMA cannot run on the GPU here (a Blackwell,
    whose sm_100a compile refuses WGMMA), or None. Called first by the ``supports()`` of
    every WGMMA kernel (and case) without a tcgen05 variant."""
    if mma_kind() != "tcgen05":
        return None
    return (f"this case multiplies with Hopper's WGMMA (compute capability {WGMMA_MAJOR}.x, "
            f"sm_90a); this GPU has {backends.gpu_compute_capability()} (Blackwell's "
            "sm_100a compile refuses WGMMA)")


def interpreter_has_tmem() -> bool:
    """Whether the installed JAX's Mosaic GPU interpreter runs tensor memory (TMEM) and
    tcgen05 MMAs: JAX 0.12's does, 0.10's has no rule for them."""
    return _compat.mosaic_gpu_interpreter_has_tmem()


def available() -> str | None:
    """``None`` if a Mosaic GPU kernel can be compiled in this process, else why not."""
    reason = mosaic_reason("gpu")
    if reason is not None:
        return reason
    try:
        _compat.pallas_mosaic_gpu()
    except Exception as e:  # a jaxlib without Mosaic GPU: report it, never crash
        return f"jax.experimental.pallas.mosaic_gpu is not importable: {e}"
    return None


def interpret_params(**overrides: Any) -> Any:
    """The interpreter parameters the ``"mosaic_gpu_interpret"`` records run with: races
    detected, uninitialised shared memory poisoned with NaN (the defaults of the installed
    JAX where a field differs)."""
    params = _compat.mosaic_gpu_interpret_params()
    fields = getattr(type(params), "__dataclass_fields__", {})
    wanted = {"detect_races": True, "uninitialized_memory": "nan", **overrides}
    import dataclasses

    return dataclasses.replace(params, **{k: v for k, v in wanted.items() if k in fields})


@contextlib.contextmanager
def maybe_interpret(interpret: bool) -> Iterator[None]:
    """Runs the kernel calls traced inside in the Mosaic GPU interpreter if ``interpret``
    (a Mosaic GPU kernel's wrapper: ``with maybe_interpret(interpret): return call(...)``)."""
    if not interpret:
        yield
        return
    with _compat.force_mosaic_gpu_interpret(interpret_params()):
        yield


def races_found() -> bool | None:
    """Whether the last kernel run in the Mosaic GPU interpreter raced (JAX 0.10's
    interpreter records races without raising, 0.12's raises "RACE DETECTED": tests ask
    here after each run); None if none ran."""
    return _compat.mosaic_gpu_races_found()


def kernel(body: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``plgpu.kernel`` under the installed JAX's argument names (``out_shape``,
    ``scratch_shapes`` here, renamed in JAX 0.12)."""
    return _compat.mosaic_gpu_kernel(body, **kwargs)


def mesh_kernel(body: Callable[..., Any], *, out_shape: Any, grid: tuple[int, ...],
                grid_names: tuple[str, ...], cost_estimate: Any, name: str,
                compiler_params: Any = None, interpret: bool = False,
                **mesh_kwargs: Any) -> Callable[..., Any]:
    """A Mosaic GPU kernel over ``grid`` (``lax.axis_index(grid_names[i])``) that carries a
    ``cost_estimate`` and ``name=`` into the jaxpr (``pl.kernel`` on a ``plgpu.Mesh``, an
    ``mpmd_map`` equation that :mod:`forge_jax.aot` reports on), run in the Mosaic GPU
    interpreter with :func:`interpret_params` if ``interpret``. ``body`` takes the
    inputs' and outputs' refs (scratch: ``pl.run_scoped`` inside)."""
    return _compat.mosaic_gpu_mesh_kernel(
        body, out_shape=out_shape, grid=grid, grid_names=grid_names,
        cost_estimate=cost_estimate, name=name, compiler_params=compiler_params,
        interpret=interpret_params() if interpret else False, **mesh_kwargs)


def layout_cast(x: Any, layout: Any, *, interpret: bool) -> Any:
    """``plgpu.layout_cast(x, layout)`` in a compiled kernel; ``x`` in the interpreter, which
    has no rule for it (a register layout is a lowering hint: the values are the same)."""
    return x if interpret else _compat.pallas_mosaic_gpu().layout_cast(x, layout)


def iota(dtype: Any, shape: tuple[int, ...], dimension: int, layout: Any, *,
         interpret: bool) -> Any:
    """``plgpu.broadcasted_iota`` in ``layout`` in a compiled kernel; ``lax.broadcasted_iota``
    in the interpreter."""
    if interpret:
        import jax

        return jax.lax.broadcasted_iota(dtype, shape, dimension)
    return _compat.pallas_mosaic_gpu().broadcasted_iota(dtype, shape, dimension, layout=layout)


def shared_memory_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int | None:
    """The shared memory Mosaic GPU's lowering allocates for the (one) Mosaic GPU kernel of
    ``jax.jit(fn)(*args, **kwargs)`` lowered for CUDA on this machine, scratch and alignment
    included: the figure it checks against the device's 227 KiB, read by lowering under an
    artificial limit of 0 bytes. None where this JAX has no such limit or it lowers no
    Mosaic GPU kernel."""
    import re

    try:
        from jax.experimental.mosaic.gpu import core as mgpu_core

        limit = mgpu_core.artificial_shared_memory_limit
    except (ImportError, AttributeError):
        return None
    try:
        with limit(0):
            _compat.export_for_cuda(fn, *args, **kwargs)
    except Exception as e:  # the lowering's verdict carries the figure
        if m := re.search(r"smem_bytes=(\d+)", str(e)):
            return int(m.group(1))
        raise
    return None


def transposed(ref: Any) -> Any:
    """A 2-D shared-memory ref read transposed (a WGMMA operand): ``ref.T`` where refs have
    it (``plgpu.transpose_ref`` is deprecated in JAX 0.12), else ``plgpu.transpose_ref``."""
    if hasattr(ref, "T"):
        return ref.T
    return _compat.pallas_mosaic_gpu().transpose_ref(ref, (1, 0))


def swizzle_transforms(swizzle: int, dtype: Any) -> tuple:
    """The shared-memory transforms of a matrix-unit operand: 8-row tiles one ``swizzle``
    (bytes) wide, swizzled by as much."""
    plgpu = _compat.pallas_mosaic_gpu()
    bits = jnp.dtype(dtype).itemsize * 8
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def swizzled_smem(shape: tuple[int, ...], dtype: Any) -> Any:
    """A matrix-unit operand (or a page tile) in shared memory: 8-row tiles of
    :data:`SWIZZLE` bytes, swizzled by as much (by the row's bytes where a row is
    narrower, e.g. 64 bytes for rows of 64 one-byte values)."""
    swizzle = min(SWIZZLE, shape[-1] * jnp.dtype(dtype).itemsize)
    return _compat.pallas_mosaic_gpu().SMEM(shape, dtype,
                                            transforms=swizzle_transforms(swizzle, dtype))


def online_softmax(s: Any, m_prev: Any, l_prev: Any) -> tuple[Any, Any, Any, Any]:
    """One key block of the Mosaic GPU kernels' online softmax (kernel code, float32, base 2).

    ``s [rows, keys]``: the block's logits, hidden keys ``-inf``; ``m_prev, l_prev [rows]``:
    the running max and sum. Returns ``(p, alpha, m_next, l_next)``: the block's
    unnormalised probabilities, the factor that rescales what was accumulated before, and
    the updated max and sum.
    """
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that saw nothing
    alpha = jnp.exp2((m_prev - m_safe) * LOG2E)
    p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [0])) * LOG2E)
    return p, alpha, m_next, alpha * l_prev + p.sum(axis=1)


def softmax_init(rows: int, layout: Any, *, interpret: bool) -> tuple[Any, Any]:
    """The online softmax's running max (``-inf``) and sum (0) before the first key block,
    float32 ``[rows]`` in ``layout`` (a row per thread)."""
    return (layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), layout, interpret=interpret),
            layout_cast(jnp.zeros((rows,), jnp.float32), layout, interpret=interpret))


def refill(fetch: Callable[[Any, Any], None], step: Any, slot: Any, *, stages: int,
           steps: Any) -> None:
    """Kernel code: a pipeline's ring slot ``slot``, consumed at ``step``, refilled by
    ``fetch(step + stages, slot)`` if that step is one of the ``steps``."""
    _compat.pallas().when(step + stages < steps)(lambda: fetch(step + stages, slot))


def load_tmem(ref: Any, *, interpret: bool) -> Any:
    """A tensor-memory (TMEM) tile read into registers, one row per thread (the tcgen05
    layout), complete before the values are used."""
    plgpu = _compat.pallas_mosaic_gpu()
    x = plgpu.async_load_tmem(ref, layout=None if interpret else plgpu.Layout.TCGEN05)
    plgpu.wait_load_tmem()
    return x


def rescale_tmem(o_tmem: Any, alpha: Any, *, chunk: int, interpret: bool) -> None:
    """Multiplies each row of the TMEM accumulator ``o_tmem`` by ``alpha`` (the softmax's
    correction) in place, ``chunk`` columns at a time, so that the output never holds
    registers across a kernel's loop."""
    pl, plgpu = _compat.pallas(), _compat.pallas_mosaic_gpu()
    for c in range(0, o_tmem.shape[1], chunk):
        cols = o_tmem.at[:, pl.ds(c, chunk)]
        o = load_tmem(cols, interpret=interpret)
        plgpu.async_store_tmem(cols, o * lax.broadcast_in_dim(alpha, o.shape, [0]))
    plgpu.commit_tmem()


def matmul_tiles(tile_n: int, tile_m: int, k_split: int) -> tuple[Any, ...]:
    """A transposed matmul program's indices on its grid ``("n", "m", "k")`` and its slices:
    ``(ni, mi, si, rows, cols, ks)``, the rows of ``w`` (and of ``out.T``), the rows of
    ``x`` and the K of its split."""
    pl = _compat.pallas()
    ni, mi, si = (lax.axis_index(a) for a in ("n", "m", "k"))
    return (ni, mi, si, pl.ds(ni * tile_n, tile_n), pl.ds(mi * tile_m, tile_m),
            pl.ds(si * k_split, k_split))


def check_matmul_tiles(x: Any, w: Any, *, tile_m: int, tile_n: int, tile_k: int,
                       split_k: int) -> None:
    """Raises unless ``x [M, K]`` and ``w [N, K]`` tile by ``(tile_m, tile_n, tile_k *
    split_k)``."""
    m, k = x.shape
    if m % tile_m or w.shape[0] % tile_n or k % (tile_k * split_k):
        raise ValueError(f"{x.shape=} and {w.shape=} do not tile by ({tile_m}, {tile_n}, "
                         f"{tile_k} x {split_k=})")


def matmul_cost(x: Any, w: Any, scales: Any, *, split_k: int) -> Any:
    """The cost of a quantized ``out.T = dequantize(w) @ x.T`` in ``split_k`` float32
    partial sums: ``x [M, K]``, ``w [N, K]`` stored values, float32 ``scales``."""
    m, k = x.shape
    n = w.shape[0]
    return _compat.pallas().CostEstimate(
        flops=2 * m * n * k, transcendentals=0,
        bytes_accessed=(w.size * w.dtype.itemsize + 4 * scales.size + x.size * x.dtype.itemsize
                        + 4 * split_k * n * m))


def costed_kernel(body: Callable[..., Any], *, out_shape: Any, scratch_shapes: Any = (),
                  cost_estimate: Any, name: str, compiler_params: Any = None,
                  **mesh: Any) -> Callable[..., Any]:
    """:func:`kernel` that carries a ``cost_estimate`` and a ``name`` (``plgpu.kernel``
    takes neither in JAX 0.10): ``pl.kernel`` over a ``plgpu.Mesh(**mesh)`` (``grid``,
    ``grid_names``, ``num_threads``, ``thread_name``), the scratch allocated as
    ``plgpu.kernel`` allocates it (``run_scoped``, collective over the warpgroups). The
    cost reaches XLA and :func:`forge_jax.aot.compile`'s roofline; unlike ``plgpu.kernel``
    the call has no batching rule (call it unbatched)."""
    pl = _compat.pallas()
    plgpu = _compat.pallas_mosaic_gpu()
    unwrap = not isinstance(out_shape, (tuple, list))
    out_type = (out_shape,) if unwrap else tuple(out_shape)

    def scoped_body(*refs):
        pl.run_scoped(lambda *scratch: body(*refs, *scratch), *scratch_shapes,
                      collective_axes=mesh.get("thread_name"))

    call = pl.kernel(scoped_body, out_type=out_type, mesh=plgpu.Mesh(kernel_name=name, **mesh),
                     compiler_params=compiler_params, cost_estimate=cost_estimate, name=name)

    def run(*args):
        outs = call(*args)
        return outs[0] if unwrap else outs

    return run


_PTXAS_LINE = ("Compiling entry function '", "Used ", " bytes spill stores")


@contextlib.contextmanager
def ptxas_report() -> Iterator[list[str]]:
    """Within it, the Mosaic GPU kernels compiled (a deviceless ``fj.aot.compile`` for an
    ``h100`` target included) have ptxas report their registers and spills; the lines
    (``Compiling entry function '...'``, ``... bytes spill stores ...``, ``Used N
    registers ...``) are in the list yielded, filled when the block ends. Mosaic GPU
    prints them (``MOSAIC_GPU_DUMP_PTXAS``, which needs ``MOSAIC_GPU_DUMP_PTX``) on the
    process's file descriptors 1 and 2, captured here for the block."""
    import os
    import sys
    import tempfile

    lines: list[str] = []
    names = ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_PTX")
    old_env = {n: os.environ.get(n) for n in names}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+") as sink:
        try:
            os.environ.update({n: "1" for n in names})
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for n, value in old_env.items():
                if value is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = value
            sink.seek(0)
            lines.extend(ln.strip() for ln in sink if any(s in ln for s in _PTXAS_LINE))
