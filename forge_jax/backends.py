"""Backend discovery: what JAX sees here and which implementations can run."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from forge_jax import _compat, registry, targets

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    id: int
    platform: str
    device_kind: str
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    compute_capability: str | None


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    name: str
    devices: tuple[DeviceInfo, ...]
    error: str | None  # why JAX cannot see this platform, when it cannot


@dataclasses.dataclass(frozen=True)
class ImplementationInfo:
    op: str
    name: str
    available: bool
    reason: str | None
    auto_on: tuple[str, ...]  # platforms where auto selection considers it
    description: str
    platforms: tuple[str, ...] | None = None  # None: every platform
    unverified_on: tuple[str, ...] = ()  # ranked there once verified on that hardware


@dataclasses.dataclass(frozen=True)
class ToolchainInfo:
    name: str
    available: bool
    reason: str | None


@dataclasses.dataclass(frozen=True)
class Summary:
    jax_version: str
    jaxlib_version: str
    default_backend: str
    platforms: tuple[PlatformInfo, ...]
    toolchains: tuple[ToolchainInfo, ...]
    implementations: tuple[ImplementationInfo, ...]
    gpu_paths: tuple[str, ...] = ()

    def devices(self) -> tuple[DeviceInfo, ...]:
        return tuple(d for p in self.platforms for d in p.devices)

    def __str__(self) -> str:
        out = [f"forge_jax on JAX {self.jax_version} (jaxlib {self.jaxlib_version}), "
               f"default backend: {self.default_backend}", "", "Platforms:"]
        for p in self.platforms:
            if not p.devices:  # the whole reason, its later lines indented
                error = str(p.error).replace("\n", "\n    ")
                out.append(f"  {p.name}: none ({error})")
                continue
            out.append(f"  {p.name}: {len(p.devices)} device(s)")
            for d in p.devices:
                extra = []
                if d.memory_total_bytes is not None:
                    extra.append(f"memory {_gib(d.memory_total_bytes)} total")
                if d.memory_free_bytes is not None:
                    extra.append(f"{_gib(d.memory_free_bytes)} free")
                if d.compute_capability:
                    extra.append(f"compute capability {d.compute_capability}")
                tail = f" ({', '.join(extra)})" if extra else ""
                out.append(f"    [{d.id}] {d.device_kind}{tail}")
        out += ["", "Toolchains:"]
        for t in self.toolchains:
            out.append(f"  {t.name}: {'yes' if t.available else 'no, ' + str(t.reason)}")
        if self.gpu_paths:
            out += ["", "GPU kernel paths:"] + [f"  {line}" for line in self.gpu_paths]
        out += ["", "Implementations (op: name -> status):"]
        for i in self.implementations:
            status = "available" if i.available else f"unavailable: {i.reason}"
            auto = f"auto on {', '.join(i.auto_on)}" if i.auto_on else "by name only"
            if i.unverified_on:
                auto += f"; not yet verified on {', '.join(i.unverified_on)}"
            where = f" ({', '.join(i.platforms)})" if i.platforms is not None else ""
            out.append(f"  {i.op}: {i.name}{where} -> {status} [{auto}]")
        return "\n".join(out)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _device_info(d: Any) -> DeviceInfo:
    total = free = None
    try:
        stats = d.memory_stats() or {}
    except Exception:  # Not every backend implements memory_stats().
        stats = {}
    if "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        free = total - int(stats.get("bytes_in_use", 0))
    cc = getattr(d, "compute_capability", None)
    return DeviceInfo(id=d.id, platform=d.platform, device_kind=d.device_kind,
                      memory_total_bytes=total, memory_free_bytes=free,
                      compute_capability=str(cc) if cc else None)


def _platform_info(name: str) -> PlatformInfo:
    try:
        devices = jax.devices(name)
    except RuntimeError as e:
        return PlatformInfo(name, (), str(e).strip())
    return PlatformInfo(name, tuple(_device_info(d) for d in devices), None)


def has_platform(name: str) -> bool:
    """Whether platform ``name`` has devices (inside ``fj.targets.use``: the target's)."""
    return targets.has_platform(name)


def gpu_compute_capability() -> str | None:
    """The compute capability of the first GPU (e.g. "9.0"), or None (inside
    ``fj.targets.use``: the target's)."""
    return targets.compute_capability()


def toolchains() -> tuple[ToolchainInfo, ...]:
    """Whether each kernel toolchain can run in this process, and if not, why."""
    gpu, tpu = has_platform("gpu"), has_platform("tpu")
    try:
        _compat.pallas()
        pallas = None
    except Exception as e:  # Pallas itself failed to import: report it, do not crash.
        pallas = f"jax.experimental.pallas not importable: {e}"
    rows = [ToolchainInfo("Pallas interpret mode (any platform)", pallas is None, pallas)]
    rows.append(ToolchainInfo(
        "Pallas Triton (GPU)", pallas is None and gpu,
        pallas or (None if gpu else "no GPU device")))
    cc = gpu_compute_capability()
    mosaic_gpu = None if cc and 9.0 <= float(cc) < 11.0 else (
        f"needs compute capability 9.x (Hopper's WGMMA) or 10.x (Blackwell's tcgen05), GPU "
        f"has {cc}" if cc else "no GPU device")
    rows.append(ToolchainInfo("Pallas Mosaic GPU (Hopper, Blackwell)",
                              pallas is None and mosaic_gpu is None, pallas or mosaic_gpu))
    rows.append(ToolchainInfo("Pallas Mosaic TPU", pallas is None and tpu,
                              pallas or (None if tpu else "no TPU device")))
    jt = _compat.jax_triton_reason() or (
        None if gpu else "jax-triton not importable: needs a GPU jaxlib and a GPU")
    rows.append(ToolchainInfo("jax-triton", jt is None, jt))
    cudnn = None if cc and float(cc) >= 8.0 else (
        f"cuDNN flash attention needs compute capability >= 8.0, GPU has {cc}" if cc
        else "no GPU device")
    rows.append(ToolchainInfo("cuDNN flash attention (Ampere+)", cudnn is None, cudnn))
    return tuple(rows)


def gpu_paths() -> tuple[str, ...]:
    """Which kernels serve which GPUs, one line each (``forge-jax info``): Mosaic GPU kernels
    (``"mosaic_gpu"``: TMA and WGMMA) on Hopper; on Blackwell the Mosaic GPU kernels with a
    tcgen05 variant (flash attention, paged decode, int8/fp8 quantized matmul) and the
    Triton-lowered ones
    (``"pallas"``) for the rest; Triton on Ampere/Ada; and, with a GPU (or inside
    ``fj.targets.use``), the path of this one. Auto selection ranks a kernel only where its
    ``verified`` record names the platform; others run by name."""
    def ops_of(name: str) -> str:
        ops = sorted({i.op for op in registry.ops() for i in registry.registrations(op)
                      if i.name == name and "gpu" in (i.platforms or ())})
        return ", ".join(ops) or "none"

    lines = [f"Hopper (compute capability 9.x): Mosaic GPU kernels "
             f"('mosaic_gpu': {ops_of('mosaic_gpu')}); Triton-lowered kernels ('pallas') "
             "for the other ops",
             f"Ampere and Ada (compute capability 8.x): Triton-lowered kernels ('pallas': "
             f"{ops_of('pallas')})",
             "Blackwell (compute capability 10.x): Mosaic GPU kernels with tcgen05 "
             "('mosaic_gpu': attention forward, paged_attention decode, quantized_matmul "
             "int8/fp8 per channel; "
             "the other Mosaic GPU kernels use Hopper's WGMMA, which sm_100a refuses); "
             "Triton-lowered kernels ('pallas') for the rest"]
    cc = gpu_compute_capability()
    if cc:
        path = "Mosaic GPU and Triton" if 9.0 <= float(cc) < 11.0 else "Triton"
        lines.append(f"this GPU (compute capability {cc}): the {path} path")
    return tuple(lines)


def summary() -> Summary:
    """A structured report of versions, devices, toolchains and implementations.

    ``print(fj.backends.summary())`` or ``forge-jax info`` shows it as text.
    """
    impls = []
    for op in registry.ops():
        for impl in registry.registrations(op):
            name = impl.name
            try:
                reason = impl.available()
            except Exception as e:  # A broken availability probe is a reason, not a crash.
                reason = f"availability check failed: {e}"
            unverified = tuple(sorted(p for p in impl.priority if impl.unverified(p)))
            impls.append(ImplementationInfo(
                op, name, reason is None, reason,
                tuple(sorted(p for p in impl.priority if p not in unverified)),
                impl.description,
                None if impl.platforms is None else tuple(sorted(impl.platforms)), unverified))
    return Summary(
        jax_version=jax.__version__,
        jaxlib_version=jax.lib.__version__ if hasattr(jax.lib, "__version__") else _jaxlib(),
        default_backend=jax.default_backend(),
        platforms=tuple(_platform_info(p) for p in PLATFORMS),
        toolchains=toolchains(),
        implementations=tuple(impls),
        gpu_paths=gpu_paths(),
    )


def _jaxlib() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", "unknown")
