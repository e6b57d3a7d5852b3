"""Compile targets: named devices to compile for without having one.

A :class:`Target` is a GPU or TPU described well enough for the real compiler to run on a
CPU machine (deviceless ahead-of-time compilation): XLA's GPU pipeline down to PTX and the
CUDA wheel's ``ptxas`` for ``h100``, ``a100``, ``l4`` and ``b200``; libtpu's Mosaic and XLA
TPU compilers for ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p`` and ``tpu-v6e``. Its devices come
from ``jax.experimental.topologies.get_topology_desc`` and need the ``aot`` extra
(``jax[cuda12]`` for GPU targets, ``jax[tpu]`` (libtpu) for TPU ones) with JAX's backends
kept on the CPU (``JAX_PLATFORMS=cpu`` set before JAX starts a backend).

``with fj.targets.use("h100"):`` makes everything forge_jax decides from the device answer
as on that device: the platform dispatch selects for, ``supports()`` (compute capability,
availability), the rows of the kernels' tuning tables (device kind), the autotune cache's
key and :func:`forge_jax.explain`. Every such question goes through :func:`platform`,
:func:`device_kind`, :func:`compute_capability` and :func:`has_platform` here, which answer
for the target inside the block and for this process's devices outside it.
:func:`forge_jax.aot.compile` compiles a function for a target and reports on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from forge_jax import _compat, _install


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to compile for.

    Attributes:
      name: e.g. ``"h100"`` or ``"tpu-v5e"``.
      platform: ``"gpu"`` or ``"tpu"`` (as dispatch names platforms).
      device_kind: ``jax.Device.device_kind`` of the real device, e.g. "NVIDIA H100 80GB
        HBM3" or "TPU v5 lite" (the kernels' tuning tables are keyed by it).
      compute_capability: ``"9.0"`` for a GPU, None for a TPU.
      memory_bandwidth: peak HBM bandwidth, bytes/s (the roofline's memory roof).
      peak_flops: dtype name -> peak dense FLOP/s (the roofline's compute roof; matmul
        units for 16-bit types and int8 (ops/s), vector units for float32 on GPUs).
      memory_bytes: HBM per device.
      gpu: the GPU's figures for XLA's ``GpuTargetConfigProto`` (:func:`gpu_target_config`),
        None for a TPU.
      tpu_topology: the arguments of ``get_topology_desc`` for a TPU, None for a GPU.
    """

    name: str
    platform: str
    device_kind: str
    compute_capability: str | None
    memory_bandwidth: float
    peak_flops: Mapping[str, float]
    memory_bytes: int
    gpu: Mapping[str, Any] | None = None
    tpu_topology: Mapping[str, Any] | None = None

    @property
    def devices(self) -> tuple[Any, ...]:
        """The target's (abstract) devices; needs the ``aot`` extra. Built once."""
        return _devices(self.name)

    @property
    def device(self) -> Any:
        """The first of :attr:`devices`: what a single-device program is compiled for."""
        return self.devices[0]

    def peak(self, dtype: Any) -> float:
        """Peak FLOP/s for arithmetic in ``dtype`` (the float32 figure for other dtypes)."""
        name = jax.numpy.dtype(dtype).name
        return self.peak_flops.get(name, self.peak_flops["float32"])

    def __str__(self) -> str:
        cc = f", compute capability {self.compute_capability}" if self.compute_capability else ""
        return (f"{self.name}: {self.device_kind} ({self.platform}{cc}, "
                f"{self.memory_bandwidth / 1e12:.2f} TB/s, "
                f"{self.peak('bfloat16') / 1e12:.0f} bf16 TFLOP/s)")


def _gpu(name, kind, cc, *, sms, smem_per_sm, smem_optin, l2, clock_ghz, memory, bandwidth,
         threads_per_sm, fpus_per_sm, bf16_tflops, f32_tflops, int8_tops) -> Target:
    figures = dict(core_count=sms, shared_memory_per_core=smem_per_sm,
                   shared_memory_per_block_optin=smem_optin, l2_cache_size=l2,
                   clock_rate_ghz=clock_ghz, device_memory_size=memory,
                   memory_bandwidth=bandwidth, threads_per_core_limit=threads_per_sm,
                   fpus_per_core=fpus_per_sm)
    return Target(name, "gpu", kind, cc, bandwidth,
                  {"bfloat16": bf16_tflops * 1e12, "float16": bf16_tflops * 1e12,
                   "float32": f32_tflops * 1e12, "int8": int8_tops * 1e12}, memory,
                  gpu=figures)


def _tpu(name, kind, topology, chip_config, bounds, *, memory, bandwidth, bf16_tflops,
         int8_tops) -> Target:
    return Target(name, "tpu", kind, None, bandwidth,
                  # TPUs multiply float32 on the MXU in bfloat16 passes; 1/3 of the peak
                  # is what XLA's default (highest-precision, 3-pass) float32 dot reaches.
                  {"bfloat16": bf16_tflops * 1e12, "float32": bf16_tflops * 1e12 / 3,
                   "int8": int8_tops * 1e12},
                  memory, tpu_topology=dict(topology_name=topology, chip_config_name=chip_config,
                                            chips_per_host_bounds=bounds))


# The devices' published figures (NVIDIA's data sheets, dense tensor-core FLOP/s and int8
# ops/s; Google Cloud's TPU pages: v4 multiplies int8 at its bfloat16 rate), SMs and shared
# memory as CUDA's device query reports them.
TARGETS: Mapping[str, Target] = {t.name: t for t in (
    _gpu("h100", "NVIDIA H100 80GB HBM3", "9.0", sms=132, smem_per_sm=233472,
         smem_optin=232448, l2=52428800, clock_ghz=1.98, memory=84942979072,
         bandwidth=3.35e12, threads_per_sm=2048, fpus_per_sm=128, bf16_tflops=989,
         f32_tflops=67, int8_tops=1979),
    _gpu("a100", "NVIDIA A100-SXM4-80GB", "8.0", sms=108, smem_per_sm=167936,
         smem_optin=166912, l2=41943040, clock_ghz=1.41, memory=85100068864,
         bandwidth=2.039e12, threads_per_sm=2048, fpus_per_sm=64, bf16_tflops=312,
         f32_tflops=19.5, int8_tops=624),
    _gpu("l4", "NVIDIA L4", "8.9", sms=58, smem_per_sm=102400, smem_optin=101376,
         l2=50331648, clock_ghz=2.04, memory=23580639232, bandwidth=300e9,
         threads_per_sm=1536, fpus_per_sm=128, bf16_tflops=121, f32_tflops=30.3,
         int8_tops=242),
    _gpu("b200", "NVIDIA B200", "10.0", sms=148, smem_per_sm=233472, smem_optin=232448,
         l2=132644864, clock_ghz=1.965, memory=191514411008, bandwidth=8e12,
         threads_per_sm=2048, fpus_per_sm=128, bf16_tflops=2250, f32_tflops=80,
         int8_tops=4500),
    _tpu("tpu-v4", "TPU v4", "v4:2x2x1", "megacore", (2, 2, 1), memory=32 * 2**30,
         bandwidth=1.2e12, bf16_tflops=275, int8_tops=275),
    _tpu("tpu-v5e", "TPU v5 lite", "v5e:1x1", "default", (1, 1, 1), memory=16 * 2**30,
         bandwidth=819e9, bf16_tflops=197, int8_tops=394),
    _tpu("tpu-v5p", "TPU v5", "v5:2x2x1", "megacore", (2, 2, 1), memory=95 * 2**30,
         bandwidth=2.765e12, bf16_tflops=459, int8_tops=918),
    _tpu("tpu-v6e", "TPU v6 lite", "v6e:1x1", "default", (1, 1, 1), memory=32 * 2**30,
         bandwidth=1.64e12, bf16_tflops=918, int8_tops=1836),
)}


def get(target: str | Target) -> Target:
    """The target named ``target`` (a :class:`Target` is returned as is)."""
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    return TARGETS[target]


def gpu_target_config(target: str | Target) -> str:
    """XLA's ``GpuTargetConfigProto`` (text format) for a GPU target: what
    ``get_topology_desc(platform="cuda", target_config=...)`` compiles against."""
    t = get(target)
    if t.gpu is None:
        raise ValueError(f"{t.name!r} is a {t.platform} target; a GPU target config is for "
                         f"{', '.join(n for n, x in TARGETS.items() if x.gpu)}")
    major, minor = t.compute_capability.split(".")
    fields = dict(threads_per_block_limit=1024, threads_per_warp=32,
                  shared_memory_per_block=49152, block_dim_limit_x=2147483647,
                  block_dim_limit_y=65535, block_dim_limit_z=65535,
                  registers_per_core_limit=65536, registers_per_block_limit=65536,
                  **{k: (int(v) if k != "clock_rate_ghz" else v) for k, v in t.gpu.items()})
    body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: 9 minor: 8 }}\n"
            f'device_description_str: "{t.device_kind}"\n')


_TOPOLOGY_LOCK = threading.Lock()


@functools.cache
def _devices(name: str) -> tuple[Any, ...]:
    from jax.experimental import topologies

    t = get(name)
    reason = missing(t)
    if reason is not None:
        raise RuntimeError(f"cannot compile for {t.name}: {reason}")
    with _TOPOLOGY_LOCK:
        if t.platform == "gpu":
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=gpu_target_config(t), topology="1x1x1")
        else:
            topology = topologies.get_topology_desc(
                platform="tpu", num_slices=1, wrap=(False, False, False), **t.tpu_topology)
    return tuple(topology.devices)


def missing(target: str | Target) -> str | None:
    """``None`` if this environment can compile for ``target``, else why not (the ``aot``
    extra's wheel for its platform is not installed)."""
    import shutil

    # module_available, not find_spec: a dotted name whose parent package is absent
    # (no jax_plugins or nvidia namespace at all) raises instead of returning None.
    available = _compat.module_available
    t = get(target)
    if t.platform == "gpu":
        if not available("jax_plugins.xla_cuda12"):
            return (f"the CUDA plugin (jax[cuda12-local]) is not installed: "
                    f"{_install.pip_install('aot')}")
        if not available("nvidia.cuda_nvcc") and not shutil.which("ptxas"):
            return (f"ptxas (nvidia-cuda-nvcc-cu12) is not installed: "
                    f"{_install.pip_install('aot')}")
        return None
    if not available("libtpu"):
        return f"libtpu (jax[tpu]) is not installed: {_install.pip_install('aot')}"
    return None


_LOCAL = threading.local()


def _stack() -> list[Target]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def use(target: str | Target | None) -> Iterator[Target | None]:
    """Context manager: forge_jax answers as on ``target`` inside (dispatch's platform,
    ``supports()``, tuning tables, the autotune cache, ``explain``); ``None`` restores this
    process's devices. Ops choose when traced, so it applies to functions traced inside.
    Yields the :class:`Target`. The devices are not built here: ``explain`` needs no
    extra; compiling does (:attr:`Target.devices`)."""
    t = None if target is None else get(target)
    stack = _stack()
    stack.append(t)
    try:
        yield t
    finally:
        stack.pop()


def current() -> Target | None:
    """The target of the innermost :func:`use` block, None outside one."""
    stack = _stack()
    return stack[-1] if stack else None


def platform() -> str:
    """The platform forge_jax decides for: the target's inside :func:`use`, else JAX's
    default backend."""
    t = current()
    return t.platform if t is not None else jax.default_backend()


def has_platform(name: str) -> bool:
    """Whether ``name`` has devices: the target's platform inside :func:`use` (and no
    other), else whether JAX sees any here."""
    t = current()
    if t is not None:
        return t.platform == name
    try:
        return bool(jax.devices(name))
    except RuntimeError:
        return False


def device_kind(name: str | None = None) -> str | None:
    """The device kind of platform ``name`` (default: :func:`platform`): the target's inside
    :func:`use`, else that of this process's first device there; None where there is none."""
    t = current()
    name = name or platform()
    if t is not None:
        return t.device_kind if t.platform == name else None
    try:
        return jax.devices(name)[0].device_kind
    except RuntimeError:
        return None


def compute_capability() -> str | None:
    """The GPU's compute capability (e.g. "9.0"): the target's inside :func:`use`, else
    that of this process's first GPU; None without one."""
    t = current()
    if t is not None:
        return t.compute_capability
    if not has_platform("gpu"):
        return None
    cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    return str(cc) if cc else None
