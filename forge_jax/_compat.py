"""Version shims: every difference between the JAX releases forge_jax supports lives here.

forge_jax runs on JAX 0.10 (Python 3.11), 0.11 and 0.12 (Python 3.12+). Kernels import
what differs from this module, never from ``jax.experimental`` directly, so a new JAX
release touches one file.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def pallas():
    """``jax.experimental.pallas`` (imported lazily: it pulls in lowering machinery)."""
    from jax.experimental import pallas as pl

    return pl


def pallas_tpu():
    """``jax.experimental.pallas.tpu`` (Mosaic TPU primitives: ``roll``, async copies, VMEM)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu


def triton_compiler_params(**kwargs: Any) -> Any:
    """Compiler params that select Pallas' Triton lowering on GPU.

    Since JAX 0.9 the default GPU lowering is Mosaic GPU and from 0.11 Triton warns
    as deprecated, so kernels written for Triton must ask for it explicitly.
    """
    from jax.experimental.pallas import triton as pltriton

    cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
    return cls(**kwargs)


# JAX 0.11 warns at every lowering of a Triton-backend pallas_call (Mosaic GPU is reached
# only through plgpu.kernel there). forge_jax's GPU kernels choose Triton on purpose (it runs
# on compute capability 8.x, where Mosaic GPU does not), so the kernels filter exactly this
# message, as a DeprecationWarning, once they are first used; nothing else is silenced.
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version")


@functools.cache
def filter_triton_deprecation() -> None:
    """Ignores :data:`TRITON_DEPRECATION` (only that message, only as a DeprecationWarning).

    JAX emits it when the pallas_call is lowered, i.e. when the user's outer ``jit``
    compiles, after the kernel wrapper has returned; a ``catch_warnings`` block around
    the wrapper would not see it, so the filter is installed when a kernel is traced.
    """
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def triton_load(ref: Any, idx: Any = None, *, mask: Any = None, other: Any = None) -> Any:
    """Masked load of a Triton-lowered kernel (``pl.load`` is deprecated for it)."""
    from jax.experimental.pallas import triton as pltriton

    idx = ... if idx is None else idx
    return pltriton.load(ref.at[idx], mask=mask, other=other)


def triton_store(ref: Any, idx: Any, val: Any, *, mask: Any = None) -> None:
    """Masked store of a Triton-lowered kernel (``pl.store`` is deprecated for it)."""
    from jax.experimental.pallas import triton as pltriton

    idx = ... if idx is None else idx
    pltriton.store(ref.at[idx], val, mask=mask)


def export_for_cuda(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Lowers ``jax.jit(fn)(*args, **kwargs)`` exactly as for a CUDA GPU, on any machine.

    The Pallas-to-Triton lowering runs here and raises where a GPU would (e.g. a block
    whose size is not a power of two); only the Triton-to-PTX compile needs the device.
    Returns the ``jax.export.Exported``.
    """
    return export_for(fn, ["cuda"], *args, **kwargs)


# The GPU a CUDA lowering targets on a machine without one. The Triton lowering needs a
# compute capability: JAX 0.10 fell back to 9.0 by itself; from 0.12 it raises "No supported
# GPU devices found, please specify an abstract GPU device" unless an abstract mesh names
# the device. An H100 (compute capability 9.0) keeps 0.10's target on every release.
ABSTRACT_GPU = dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def _has_gpu() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:  # no GPU backend in this process
        return False


@contextlib.contextmanager
def gpu_lowering_target() -> Iterator[None]:
    """Within it, Pallas' Triton lowering targets :data:`ABSTRACT_GPU` when this process
    has no GPU and no abstract device is set (a compile target's, for instance); otherwise
    it changes nothing."""
    if _has_gpu() or jax.sharding.get_abstract_mesh().abstract_device is not None:
        yield
        return
    device = jax.sharding.AbstractDevice(**ABSTRACT_GPU)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                  abstract_device=device)):
        yield


def export_for(fn: Any, platforms: Any, *args: Any, **kwargs: Any) -> Any:
    """``jax.export`` of ``jax.jit(fn)(*args, **kwargs)`` for ``platforms`` (a sequence of
    lowering platforms), on any machine; Triton kernel calls are allowed in a CUDA lowering
    (as :func:`export_for_cuda`), which targets :data:`ABSTRACT_GPU` where there is no GPU.
    Returns the ``jax.export.Exported``."""
    platforms = list(platforms)
    target = contextlib.nullcontext()
    checks = []
    if "cuda" in platforms:
        checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        target = gpu_lowering_target()
    with warnings.catch_warnings(), target:
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        return jax.export.export(jax.jit(fn), platforms=platforms,
                                 disabled_checks=checks)(*args, **kwargs)


def tpu_interpret_params(**kwargs: Any) -> Any:
    """Interpret params that run Mosaic TPU kernels on CPU (the TPU interpreter).

    forge_jax's default asks for race detection and NaN-poisoned uninitialised memory,
    so a kernel that reads a buffer before writing it, or two grid steps that race,
    show up in the interpreter; ``kwargs`` override (e.g. ``detect_races=False``).
    """
    from jax.experimental.pallas import tpu as pltpu

    kwargs = {"detect_races": True, "uninitialized_memory": "nan", **kwargs}
    return pltpu.InterpretParams(**kwargs)


def reset_tpu_interpreter() -> None:
    """Clears the TPU interpreter's global state (after a kernel failed inside it)."""
    from jax.experimental.pallas import tpu as pltpu

    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def export_for_tpu(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Lowers ``jax.jit(fn)(*args, **kwargs)`` exactly as for a TPU, on any machine: the
    Mosaic lowering runs here and raises where a TPU would (e.g. a block whose last two
    dimensions are not divisible by 8 and 128). Returns the ``jax.export.Exported``."""
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args, **kwargs)


# jax-triton's releases follow JAX's: 0.3.x is built against JAX 0.10, 0.4.x against JAX 0.11
# (where ``triton_call`` renamed ``out_shape`` to ``out_type``) and requires jax>=0.11, which
# 0.12 keeps. (major, minor) of jax-triton -> the (major, minor) releases of JAX it works with.
JAX_TRITON_FOR_JAX = {(0, 3): ((0, 10),), (0, 4): ((0, 11), (0, 12))}


def _release(version: str) -> tuple[int, int]:
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return tuple(parts + [0] * (2 - len(parts)))[:2]


@functools.cache
def jax_triton_version() -> str | None:
    """The installed jax-triton's version (without importing it), or None; read once (auto
    selection asks at every trace)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("jax-triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def jax_triton_reason(jt_version: str | None = None, jax_version: str | None = None,
                      ) -> str | None:
    """``None`` if the installed jax-triton release matches this JAX, else why not (it is
    not installed, or built for another JAX). Checks versions only; importing it needs a
    GPU jaxlib."""
    from forge_jax import _install

    jt_version = jt_version or jax_triton_version()
    if jt_version is None:
        return f"jax-triton not installed ({_install.pip_install('gpu')})"
    jax_version = jax_version or jax.__version__
    wants = JAX_TRITON_FOR_JAX.get(_release(jt_version))
    have = _release(jax_version)

    def releases(pairs):
        return " or ".join(f"{c}.{d}" for c, d in pairs)

    if wants is None:
        known = ", ".join(f"{a}.{b}.x for JAX {releases(pairs)}"
                          for (a, b), pairs in JAX_TRITON_FOR_JAX.items())
        return f"jax-triton {jt_version} is not a release forge_jax supports ({known})"
    if have not in wants:
        return (f"jax-triton {jt_version} is built for JAX {releases(wants)}, this is JAX "
                f"{jax_version}: install the matching release ({_install.pip_install('gpu')})")
    return None


def triton_call(*args: Any, kernel: Any, out: Any, grid: Any, call: Any = None,
                **kwargs: Any) -> Any:
    """``jax_triton.triton_call`` with the outputs' shapes given as ``out`` (jax-triton 0.3
    calls it ``out_shape``, 0.4 ``out_type``). ``call`` replaces ``jax_triton.triton_call``
    (tests)."""
    if call is None:
        import jax_triton

        call = jax_triton.triton_call
    import inspect

    params = inspect.signature(call).parameters
    name = "out_type" if "out_type" in params else "out_shape"
    return call(*args, kernel=kernel, grid=grid, **{name: out}, **kwargs)


def module_available(name: str) -> bool:
    """Whether ``name`` is installed, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def shard_map(fn: Any, *, mesh: Any, in_specs: Any, out_specs: Any) -> Any:
    """``jax.shard_map`` without the varying-manual-axes check (named ``check_rep`` before
    JAX 0.7): per-shard bodies here are ordinary single-device code, Pallas calls included,
    which that check does not understand."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def pallas_call_name(params: Any) -> str:
    """The ``name=`` of a ``pallas_call`` equation from its params: ``name`` (JAX 0.10+),
    ``name_and_src_info.name`` (older releases), else the kernel jaxpr's function name."""
    name = params.get("name") or getattr(params.get("name_and_src_info"), "name", None)
    if not name and params.get("jaxpr") is not None:
        name = getattr(getattr(params["jaxpr"], "debug_info", None), "func_name", None)
    return str(name or "pallas_call")


def pallas_mosaic_gpu():
    """``jax.experimental.pallas.mosaic_gpu`` (``plgpu``: TMA copies, WGMMA, barriers,
    warpgroups), imported lazily."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def mosaic_gpu_interpret_params(**kwargs: Any) -> Any:
    """The Mosaic GPU interpreter's parameters (``InterpretGPUParams``: race detection,
    uninitialised-memory poisoning); public in ``pallas.mosaic_gpu`` since JAX 0.11, under
    ``jax._src`` in 0.10."""
    plgpu = pallas_mosaic_gpu()
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls(**kwargs)


def force_mosaic_gpu_interpret(params: Any) -> contextlib.AbstractContextManager:
    """A context in which every Mosaic GPU kernel (``plgpu.kernel`` and Mosaic GPU
    ``pallas_call``) traced runs in the interpreter with ``params``."""
    plgpu = pallas_mosaic_gpu()
    fn = getattr(plgpu, "force_gpu_interpret_mode", None)
    if fn is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode as fn
    return fn(params)


def mosaic_gpu_races_found() -> bool | None:
    """Whether the Mosaic GPU interpreter's race detection found a race in the last kernel
    it ran (None before any ran, or where this JAX does not expose its state)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return None
    state = getattr(gpu_callbacks, "_races", None)
    return None if state is None else bool(state.races_found)


def mosaic_gpu_interpreter_has_tmem() -> bool:
    """Whether the Mosaic GPU interpreter runs tensor memory and tcgen05 MMAs (Blackwell):
    JAX 0.12's has callbacks for them, 0.10's none."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return False
    return hasattr(gpu_callbacks, "async_load_tmem") and hasattr(gpu_callbacks, "tcgen05_mma")


def mosaic_gpu_kernel(body: Any, *, out_shape: Any, scratch_shapes: Any = (),
                      **kwargs: Any) -> Any:
    """``plgpu.kernel(body, ...)``: its ``out_shape``/``scratch_shapes`` arguments were
    renamed ``out_type``/``scratch_types`` in JAX 0.12."""
    plgpu = pallas_mosaic_gpu()
    import inspect

    params = inspect.signature(plgpu.kernel).parameters
    if "out_type" in params:
        return plgpu.kernel(body, out_type=out_shape, scratch_types=scratch_shapes, **kwargs)
    return plgpu.kernel(body, out_shape=out_shape, scratch_shapes=scratch_shapes, **kwargs)


def mosaic_gpu_mesh_kernel(body: Any, *, out_shape: Any, grid: tuple[int, ...],
                           grid_names: tuple[str, ...], cost_estimate: Any, name: str,
                           compiler_params: Any = None, interpret: Any = False,
                           **mesh_kwargs: Any) -> Any:
    """``pl.kernel(body, ...)`` over a ``plgpu.Mesh``: a Mosaic GPU kernel carrying its cost
    estimate and name (``plgpu.kernel`` passes neither). Its output argument is
    ``out_type`` from JAX 0.10 on (``out_shape`` before)."""
    import inspect

    from jax.experimental import pallas as pl

    plgpu = pallas_mosaic_gpu()
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, **mesh_kwargs)
    out = "out_type" if "out_type" in inspect.signature(pl.kernel).parameters else "out_shape"
    extra = {} if compiler_params is None else {"compiler_params": compiler_params}
    return pl.kernel(body, mesh=mesh, cost_estimate=cost_estimate, name=name,
                     interpret=interpret, **{out: out_shape}, **extra)
def mosaic_gpu_load(ref: Any, *, layout: Any) -> Any:
    """``plgpu.load`` of a whole ref into registers with ``layout``: JAX 0.10 and 0.11 take
    an index (``load(ref, (), layout=...)``), 0.12 only the ref (index it with ``.at``)."""
    plgpu = pallas_mosaic_gpu()
    import inspect

    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


