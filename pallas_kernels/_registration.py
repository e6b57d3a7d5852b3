"""How a kernel joins the registry: its records, built here once for both backends.

A Pallas kernel registers its wrapper ``kernel(**op_args, interpret=...)`` twice, each as one
:class:`forge_jax.registry.Implementation` holding everything about it (function,
``supports``, ``available``, priority, platforms, verification, autotuning configs):

* ``"pallas"`` on its backend's platform: ``"gpu"`` (compiled through the Triton lowering)
  or ``"tpu"`` (lowered by Mosaic). Auto selection ranks it, at :data:`PRIORITY`, only on a
  platform its ``verified`` record names (device, JAX version, date where it was compiled,
  checked and measured faster than XLA); until then it runs by name and
  :func:`forge_jax.explain` says it is not yet verified there. GPU and TPU kernels are
  ranked by the same rule.
* ``"pallas_<backend>_interpret"`` on every platform, by name only: the same kernel code in
  the interpreter (Pallas' for GPU kernels; the TPU interpreter, with race detection and
  NaN-poisoned uninitialised memory, for TPU ones), which is how CI checks them on CPU.
* Mosaic GPU kernels (``backend="mosaic_gpu"``, Hopper: compute capability 9.x) register as
  ``"mosaic_gpu"`` on GPU, above the Triton-lowered ``"pallas"`` where both are verified,
  and ``"mosaic_gpu_interpret"`` (the Mosaic GPU interpreter) by name everywhere; see
  :mod:`forge_jax.pallas_kernels.gpu._mosaic`.

The jax-triton (``"triton"``) and cuDNN (``"cudnn"``) implementations are not Pallas
kernels; their modules build their one record each and add it with :func:`add`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from forge_jax import registry
from forge_jax.ops._attention_math import extras_reason

# Above XLA (0) wherever a kernel is verified; below cuDNN's 20 on a GPU.
PRIORITY = 10
# Mosaic GPU kernels outrank the Triton-lowered ones where both are verified (Hopper).
MOSAIC_GPU_PRIORITY = 12


@dataclasses.dataclass(frozen=True)
class _Backend:
    """What differs between the backends' registrations: the platform, why a kernel of this
    backend cannot run on a platform (a ``supports`` check) or in this process
    (``available``), and the words ``forge-jax info`` adds to the kernel's description."""

    platform: str
    platform_reason: Callable[[str], str | None]
    available: Callable[[], str | None]
    compiled: str
    interpreted: str
    interpret_name: str
    name: str = "pallas"  # the compiled record's name
    priority: int = 10


def _backend(name: str) -> _Backend:
    # Imported here, not at the top: the backend packages import their kernels, which
    # import this module.
    if name == "gpu":
        from forge_jax.pallas_kernels.gpu import _common as gpu

        return _Backend("gpu", gpu.gpu_reason, lambda: gpu.gpu_reason("gpu"),
                        "Pallas, Triton lowering", "Pallas GPU kernel in interpret mode",
                        interpret_name="pallas_gpu_interpret")
    if name == "mosaic_gpu":
        from forge_jax.pallas_kernels.gpu import _mosaic

        return _Backend("gpu", _mosaic.mosaic_reason, _mosaic.available,
                        "Pallas, Mosaic GPU, Hopper",
                        "Mosaic GPU kernel in the Mosaic GPU interpreter",
                        name="mosaic_gpu", interpret_name="mosaic_gpu_interpret",
                        priority=MOSAIC_GPU_PRIORITY)
    if name == "tpu":
        from forge_jax.pallas_kernels.tpu import _common as tpu

        return _Backend("tpu", tpu.tpu_reason, tpu.tpu_available,
                        "Pallas, Mosaic TPU", "Pallas TPU kernel in the TPU interpreter",
                        interpret_name="pallas_tpu_interpret")
    raise ValueError(f"backend={name!r}: a Pallas kernel is for 'gpu', 'mosaic_gpu' or 'tpu'")


def register(
    op: str,
    kernel: Callable[..., Any],
    *,
    backend: Literal["gpu", "mosaic_gpu", "tpu"],
    supports: Callable[[Mapping[str, Any]], str | None],
    description: str,
    verified: Mapping[str, str],
    configs: registry.ConfigsFn | None = None,
    interpret_configs: registry.ConfigsFn | None = None,
    reads_folded: bool = False,
    reads_sinks: bool = False,
    reads_chunks: bool = False,
) -> tuple[registry.Implementation, registry.Implementation]:
    """Adds ``kernel`` as ``"pallas"`` on ``backend`` and ``"pallas_<backend>_interpret"``
    (any platform, by name); returns the two records.

    Args:
      op: the public op, e.g. ``"paged_attention"``.
      kernel: ``kernel(**op_args, interpret=False | True, **config)``: the jitted wrapper,
        its launch knobs keyword-only.
      backend: ``"gpu"`` (Triton lowering), ``"mosaic_gpu"`` (Mosaic GPU, Hopper) or
        ``"tpu"`` (Mosaic TPU).
      supports: ``supports(args) -> None | reason``: the contract with the real lowering
        (every case it accepts must compile there; each rejection made for a lowering
        reason is shown to fail that lowering in a test).
      description: one line for ``forge-jax info``; the backend's words are appended.
      verified: platform -> where the kernel was compiled, checked and measured faster
        than XLA (``{"gpu": "NVIDIA H100 80GB, JAX 0.11.2, 2026-..."}``); ``{}`` until then,
        and the kernel runs by name only.
      configs: ``configs(args)``: the launch configurations :func:`forge_jax.autotune`
        times on the backend's hardware besides the defaults.
      interpret_configs: a few for the interpreter.
      reads_folded: the kernel reads folded page pools (:mod:`forge_jax.ops.kv_fold`,
        passed as ``fold=``); without it, calls with a folded pool are refused.
      reads_sinks, reads_chunks: the kernel reads the attention ops' ``sinks=`` and
        ``attention_chunk_size=`` (present in the arguments only when given); without
        them, calls that give them are refused.
    """
    spec = _backend(backend)
    if not reads_folded:
        supports = _refusing_folded(supports)
    if not (reads_sinks and reads_chunks):
        supports = _refusing_extras(supports, sinks=reads_sinks, chunks=reads_chunks)
    compiled = registry.Implementation(
        op=op, name=spec.name, fn=lambda **args: kernel(**args, interpret=False),
        supports=lambda args, platform: spec.platform_reason(platform) or supports(args),
        available=spec.available, priority={spec.platform: spec.priority},
        description=f"{description} ({spec.compiled})", platforms=frozenset({spec.platform}),
        verified=dict(verified), configs=configs)
    interpreted = registry.Implementation(
        op=op, name=spec.interpret_name,
        fn=lambda **args: kernel(**args, interpret=True),
        supports=lambda args, platform: supports(args),
        description=f"{description} ({spec.interpreted})", configs=interpret_configs)
    return add(compiled), add(interpreted)


def _refusing_folded(supports):
    def refusing(args):
        if args.get("fold", 1) > 1:
            return (f"k_pages is folded ({args['fold']} tokens per 128-lane row, "
                    "forge_jax.ops.kv_fold): this kernel reads unfolded pages")
        return supports(args)
    return refusing


def _refusing_extras(supports, *, sinks, chunks):
    def refusing(args):
        return extras_reason(args, sinks=sinks, chunks=chunks) or supports(args)
    return refusing


def add(record: registry.Implementation) -> registry.Implementation:
    """Adds ``record`` to the registry (the one place dispatch, autotuning, ``explain``,
    ``forge-jax info`` and the benchmarks read it from)."""
    return registry.add(record)
