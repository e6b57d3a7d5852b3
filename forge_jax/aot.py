"""Ahead-of-time compile reports: a function compiled for a named target without the device.

``fj.aot.compile(fn, *args, target="h100")`` traces ``fn`` as on the target (inside
:func:`forge_jax.targets.use`, so dispatch, ``supports()`` and the tuning tables answer as
there), lowers it, runs the target's real compiler (XLA's GPU pipeline, Triton, the CUDA
wheel's ``ptxas``; libtpu's Mosaic and XLA TPU compilers) and returns a :class:`Report`:
whether it compiled (the compiler's message, never a traceback), how long that took,
``memory_analysis()``, one row per Pallas kernel and the copies the program makes outside
them. Needs the ``aot`` extra and JAX's backends on the CPU (``JAX_PLATFORMS=cpu`` before
JAX starts a backend; the abstract devices come from ``jax.experimental.topologies``).

Where the GPU figures come from: the compile is given ``xla_dump_to`` as a per-compile
option (``Lowered.compile(compiler_options=...)``), so nothing has to be in ``XLA_FLAGS``
before the backend starts and no subprocess is needed. The dump's thunk sequence gives each
kernel's grid, threads and dynamic shared memory; ``ptxas -v`` (the ``nvidia-cuda-nvcc``
wheel's) on its PTX gives registers and spilled bytes. Mosaic GPU kernels (``pl.kernel``
equations, ``mpmd_map``) are compiled by the CUDA plugin instead: their figures come from its
dumps where ``MOSAIC_GPU_DUMP_TO`` and ``MOSAIC_GPU_DUMP_PTXAS=1`` were set before the
process's first Mosaic GPU compile (see ``_with_mosaic_figures``), else stay empty. On a
TPU the compiled program exposes no per-kernel register or VMEM figures through JAX; its
rows carry the kernel's cost and roofline only.

Roofline: from each ``pallas_call``'s ``CostEstimate`` (flops, bytes accessed), the time
at the target's peak FLOP/s (for the dtype of its first operand) or peak HBM bandwidth,
whichever is longer. A kernel without a cost estimate is costed by its operands' and
results' bytes (marked ``io``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from forge_jax import _compat, targets


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Pallas kernel (all its calls in the program).

    Attributes:
      name: the ``pallas_call``'s ``name=``.
      calls: how many times the program launches a kernel of that name: each call site
        once (a model's layers are unrolled: one site per layer), times the trip count
        of every ``scan`` around it.
      flops, bytes_accessed: summed over the calls (the cost estimate's; without one,
        ``flops`` 0 and the operands' and results' bytes, ``costed`` False).
      roofline_seconds: summed predicted time at the target's peaks.
      registers, spilled_bytes, shared_memory, grid, threads: GPU only (None on a TPU):
        the largest over the kernel's compiled variants (``ptxas -v`` and the thunk
        sequence), the first variant's grid and threads.
    """

    name: str
    calls: int
    flops: int
    bytes_accessed: int
    costed: bool
    roofline_seconds: float
    registers: int | None = None
    spilled_bytes: int | None = None
    shared_memory: int | None = None
    grid: tuple[int, ...] | None = None
    threads: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Copy:
    """A copy (or transpose) the optimized program makes outside the kernels.

    Attributes:
      op: ``copy``, ``transpose``, or the fusion's kind (``copy_fusion``...).
      shape: the result's HLO shape (``bf16[8,1024,3,64]``).
      bytes: the result's size.
      source: what the program was doing: the traced operation the compiler names in the
        instruction's metadata (``layer_3/rms_norm/convert_element_type``), without the
        jitted function's name; ``""`` when it names none (an argument's relayout).
    """

    op: str
    shape: str
    bytes: int
    source: str = ""

    @property
    def what(self) -> str:
        """:attr:`source` with the layer's number left out (``layer_*/rms_norm/...``),
        so that one copy repeated by every layer reads as one kind."""
        return re.sub(r"\blayer_\d+\b", "layer_*", self.source) or "(no source)"


@dataclasses.dataclass(frozen=True)
class Report:
    """What compiling a function for a target gave.

    Attributes:
      target: the :class:`forge_jax.targets.Target`.
      compiled: whether the compile succeeded.
      error: the compiler's (or lowering's) message when it did not, else None.
      seconds: lowering plus compiling, wall-clock.
      memory: ``memory_analysis()``'s sizes in bytes (argument, output, alias, temp,
        generated_code); empty when it did not compile.
      kernels: one :class:`Kernel` per ``pallas_call`` name.
      copies: the :class:`Copy` instructions of the optimized program.
    """

    target: targets.Target
    compiled: bool
    error: str | None
    seconds: float
    memory: Mapping[str, int]
    kernels: tuple[Kernel, ...]
    copies: tuple[Copy, ...]

    @property
    def roofline_seconds(self) -> float:
        """The kernels' predicted time, summed."""
        return sum(k.roofline_seconds for k in self.kernels)

    def __str__(self) -> str:
        head = (f"{self.target.name} ({self.target.device_kind}): "
                + (f"compiled in {self.seconds:.1f} s" if self.compiled
                   else f"FAILED after {self.seconds:.1f} s: {self.error}"))
        out = [head]
        if self.memory:
            out.append("  memory: " + ", ".join(f"{k} {_size(v)}" for k, v in
                                                self.memory.items()))
        if self.kernels:
            gpu = self.target.platform == "gpu"
            cols = ["kernel", "calls", "roofline"] + (
                ["regs", "spill", "smem", "grid", "threads"] if gpu else [])
            rows = [cols]
            for k in self.kernels:
                row = [k.name, str(k.calls),
                       f"{k.roofline_seconds * 1e6:.2f} us" + ("" if k.costed else " io")]
                if gpu:
                    row += [_opt(k.registers), _opt(k.spilled_bytes, _size),
                            _opt(k.shared_memory, _size), _opt(k.grid, _dims),
                            _opt(k.threads, _dims)]
                rows.append(row)
            widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
            out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                    for r in rows]
            out.append(f"  kernels' roofline total: {self.roofline_seconds * 1e6:.2f} us")
        if self.copies:
            total = sum(c.bytes for c in self.copies)
            out.append(f"  copies outside kernels: {len(self.copies)}, {_size(total)}; "
                       f"the largest kinds (count x shape, what):")
            for (op, shape, what), group in sorted(
                    copy_kinds(self.copies).items(), key=lambda kv: -sum(
                        c.bytes for c in kv[1]))[:8]:
                out.append(f"    {len(group)} x {op} {shape} ({_size(group[0].bytes)} each): "
                           f"{what}")
        elif self.compiled:
            out.append("  copies outside kernels: none")
        return "\n".join(out)


def copy_kinds(copies: Sequence[Copy]) -> dict[tuple[str, str, str], list[Copy]]:
    """The copies grouped by (op, shape, :attr:`Copy.what`): one kind repeated per layer
    is one entry."""
    kinds: dict[tuple[str, str, str], list[Copy]] = {}
    for c in copies:
        kinds.setdefault((c.op, c.shape, c.what), []).append(c)
    return kinds


def _opt(value, fmt=str) -> str:
    return "-" if value is None else fmt(value)


def _dims(d) -> str:
    return "x".join(str(v) for v in d)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def abstract(tree: Any, device: Any) -> Any:
    """``tree`` with every array (or ``ShapeDtypeStruct``) leaf a ``ShapeDtypeStruct`` on
    ``device``; other leaves as they are."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x

    return jax.tree.map(leaf, tree)


def compile(fn: Callable[..., Any], *args: Any, target: str | targets.Target,
            implementation: str | None = None, **kwargs: Any) -> Report:
    """Compiles ``fn(*args, **kwargs)`` for ``target`` and reports on it.

    Args:
      fn: a function of arrays, or a ``jax.jit``-wrapped one (its static arguments are
        then passed in ``kwargs`` as for a call).
      args, kwargs: arrays or ``jax.ShapeDtypeStruct``s (any pytree; placed on the
        target's device); for a plain function, keyword arguments that are not arrays are
        bound as constants.
      target: a name of :data:`forge_jax.targets.TARGETS` or a ``Target``.
      implementation: traced inside ``fj.use_implementation(implementation)`` (e.g.
        ``"pallas"``), else auto selection as on the target.

    Returns:
      a :class:`Report`; a failed lowering or compile is ``compiled=False`` with the
      message (a target whose extra is missing raises RuntimeError instead).
    """
    from forge_jax import dispatch

    t = targets.get(target)
    device = t.device
    args, kwargs = abstract(args, device), abstract(kwargs, device)
    if not hasattr(fn, "trace"):
        consts = {k: v for k, v in kwargs.items() if not isinstance(v, jax.ShapeDtypeStruct)}
        kwargs = {k: v for k, v in kwargs.items() if k not in consts}
        fn = jax.jit(functools.partial(fn, **consts) if consts else fn)
    start = time.perf_counter()
    dump = pathlib.Path(tempfile.mkdtemp(prefix="forge_jax_aot_"))
    try:
        try:
            with targets.use(t), jax.default_device(device), \
                    dispatch.use_implementation(implementation):
                traced = fn.trace(*args, **kwargs)
                lowered = traced.lower()
            # xla_dump_emitter_re: newer XLA (JAX 0.12) writes the kernels' PTX only for
            # the emitters it names; 0.10's wrote it with xla_dump_to alone. "ptx" names the
            # PTX writer alone: ".*" also logged every MLIR pass of every fusion, which made a
            # two-layer model's compile 55 s instead of 5 s.
            # The backend's optimization level is the device's default (3), whatever
            # XLA_FLAGS asks of the host's CPU compiles: it decides registers and spills.
            options = ({"xla_dump_to": str(dump), "xla_dump_emitter_re": "ptx",
                        "xla_backend_optimization_level": 3} if t.platform == "gpu" else {})
            mosaic_before = _mosaic_dumps()
            compiled = lowered.compile(options)
        except Exception as e:  # the compiler's verdict, reported, not raised
            return Report(t, False, _message(e), time.perf_counter() - start, {}, (), ())
        kernels = _kernels(traced.jaxpr, t)
        seconds = time.perf_counter() - start
        if t.platform == "gpu":
            kernels = _with_gpu_figures(kernels, dump, t)
            kernels = _with_mosaic_figures(kernels, _mosaic_dumps() - mosaic_before, t)
        return Report(t, True, None, seconds, _memory(compiled), tuple(kernels),
                      tuple(copies(compiled.as_text())))
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def _message(e: Exception) -> str:
    """The error's own lines, without JAX's traceback notes."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()
             and not ln.startswith(("The stack trace below", "For simplicity", "------"))]
    text = " ".join(lines[:6]) or type(e).__name__
    return text if len(text) < 600 else text[:600] + "..."


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {name: int(getattr(m, f"{name}_size_in_bytes"))
            for name in ("argument", "output", "alias", "temp", "generated_code")}


def _subjaxprs(params: Mapping[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


# The equations of Pallas kernels: ``pallas_call``, and ``mpmd_map`` (``pl.kernel`` over a
# Mosaic GPU mesh, which carries the cost estimate and name ``plgpu.kernel`` does not).
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def pallas_calls(jaxpr: Any) -> Iterator[Any]:
    """Every Pallas kernel equation (:data:`KERNEL_PRIMITIVES`) of a (closed) jaxpr, nested
    ones included (outside the kernels' own bodies)."""
    for eqn, _ in kernel_launches(jaxpr):
        yield eqn


def kernel_launches(jaxpr: Any, times: int = 1) -> Iterator[tuple[Any, int]]:
    """``(equation, launches)`` for every Pallas kernel equation of a (closed) jaxpr:
    ``launches`` is how many times one run of the program launches it, the product of
    the trip counts of the ``scan`` s around it (1 outside any; a ``while`` loop's count
    is not known before it runs: counted once)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            yield eqn, times
            continue
        inner = times * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" \
            else times
        for sub in _subjaxprs(eqn.params):
            yield from kernel_launches(sub, inner)


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals
               if hasattr(a, "shape"))


def _kernels(jaxpr: Any, t: targets.Target) -> list[Kernel]:
    rows: dict[str, Kernel] = {}
    for eqn, launches in kernel_launches(jaxpr):
        name = _compat.pallas_call_name(eqn.params)
        cost = eqn.params.get("cost_estimate")
        io = _nbytes([v.aval for v in (*eqn.invars, *eqn.outvars)])
        flops, nbytes = (cost.flops, cost.bytes_accessed) if cost is not None else (0, io)
        flops, nbytes = flops * launches, nbytes * launches
        first = eqn.invars[0].aval if eqn.invars else None
        peak = t.peak(first.dtype if hasattr(first, "dtype") else np.float32)
        seconds = max(flops / peak, nbytes / t.memory_bandwidth)
        old = rows.get(name)
        rows[name] = Kernel(name, launches, flops, nbytes, cost is not None, seconds) \
            if old is None \
            else dataclasses.replace(
                old, calls=old.calls + launches, flops=old.flops + flops,
                bytes_accessed=old.bytes_accessed + nbytes,
                costed=old.costed and cost is not None,
                roofline_seconds=old.roofline_seconds + seconds)
    return list(rows.values())


_THUNK = re.compile(r"(\S+) grid: \[([^\]]*)\] threads: \[([^\]]*)\]\s+shared_memory: (\d+)")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores")


def ptxas() -> str | None:
    """The ``ptxas`` of the ``nvidia-cuda-nvcc`` wheel (or on PATH), None without one."""
    try:
        from nvidia import cuda_nvcc

        path = pathlib.Path(next(iter(cuda_nvcc.__path__))) / "bin" / "ptxas"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("ptxas")


def ptxas_figures(ptx: pathlib.Path, arch: str) -> dict[str, tuple[int, int]]:
    """``entry name -> (registers, spill-store bytes)`` from ``ptxas -v`` on one PTX file
    (empty without ptxas)."""
    exe = ptxas()
    if exe is None:
        return {}
    run = subprocess.run([exe, f"-arch={arch}", "-v", str(ptx), "-o", "/dev/null"],
                         capture_output=True, text=True, timeout=300)
    out, entry = {}, None
    for line in (run.stdout + run.stderr).splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            out[entry] = (0, 0)
        elif entry and (m := _SPILL.search(line)):
            out[entry] = (out[entry][0], int(m.group(1)))
        elif entry and (m := _REGS.search(line)):
            out[entry] = (int(m.group(1)), out[entry][1])
    return out


def _arch(t: targets.Target) -> str:
    major, minor = t.compute_capability.split(".")
    return f"sm_{major}{minor}" + ("a" if int(major) >= 9 else "")


def _with_gpu_figures(kernels: list[Kernel], dump: pathlib.Path,
                      t: targets.Target) -> list[Kernel]:
    launches: dict[str, list[tuple]] = {}
    for path in dump.glob("*thunk_sequence.txt"):
        for m in _THUNK.finditer(path.read_text()):
            launches.setdefault(m.group(1), []).append(
                (tuple(int(v) for v in m.group(2).split(",")),
                 tuple(int(v) for v in m.group(3).split(",")), int(m.group(4))))
    regs: dict[str, tuple[int, int]] = {}
    entries = tuple(f".entry {k.name}" for k in kernels)
    for ptx in dump.glob("*.ptx"):
        # ptxas only where a kernel is (newer XLA writes a PTX file per fusion).
        text = ptx.read_text() if entries else ""
        if any(e in text for e in entries):
            regs.update(ptxas_figures(ptx, _arch(t)))
    out = []
    for k in kernels:
        # Triton entries are the pallas_call's name, uniquified with a suffix when the
        # program has several variants of it.
        mine = [n for n in launches if n == k.name or re.fullmatch(
            re.escape(k.name) + r"(_\d+)?", n)]
        if not mine:
            out.append(k)
            continue
        shapes = [s for n in mine for s in launches[n]]
        figures = [regs[n] for n in mine if n in regs]
        out.append(dataclasses.replace(
            k, grid=shapes[0][0], threads=shapes[0][1],
            shared_memory=max(s[2] for s in shapes),
            registers=max((f[0] for f in figures), default=None),
            spilled_bytes=max((f[1] for f in figures), default=None)))
    return out


# Mosaic GPU kernels are compiled by the CUDA plugin's Mosaic GPU pipeline, not XLA's, and
# are in neither the thunk sequence nor XLA's PTX: their figures come from the plugin's own
# dumps (``<name>_<i>.ptx``/``.ptxas`` and ``.mlir-passes.log``), written where
# MOSAIC_GPU_DUMP_TO names (with MOSAIC_GPU_DUMP_PTXAS=1) if both are set before the
# process's first Mosaic GPU compile (the plugin reads them once); else those columns stay
# empty, as they do for a kernel identical to one compiled before in the process (the
# plugin reuses it and dumps nothing).
_LAUNCH = re.compile(
    r"gpu\.launch .*?blocks\([^)]*\) in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = "
    r"%c(\d+)\w*\) threads\([^)]*\) in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = "
    r"%c(\d+)\w*\) dynamic_shared_memory_size %c(\d+)_i32")


def _mosaic_dumps() -> set[tuple[pathlib.Path, int]]:
    """The files of the Mosaic GPU dump directory with their modification times."""
    root = os.environ.get("MOSAIC_GPU_DUMP_TO")
    if not root or not os.path.isdir(root):
        return set()
    return {(f, f.stat().st_mtime_ns) for f in pathlib.Path(root).glob("*")}


def _with_mosaic_figures(kernels: list[Kernel], written: set[tuple[pathlib.Path, int]],
                         t: targets.Target) -> list[Kernel]:
    files = {f for f, _ in written}
    out = []
    for k in kernels:
        mine = {f for f in files if re.fullmatch(re.escape(k.name) + r"_\d+\..*", f.name)}
        if k.registers is not None or not mine:
            out.append(k)
            continue
        figures, launches = [], []
        for f in sorted(mine):
            if f.suffix == ".ptxas":
                text = f.read_text()
                regs, spill = _REGS.search(text), _SPILL.search(text)
                if regs:
                    figures.append((int(regs.group(1)), int(spill.group(1)) if spill else 0))
            elif f.suffix == ".ptx" and f.with_suffix(".ptxas") not in mine:
                figures += ptxas_figures(f, _arch(t)).values()
            elif f.name.endswith(".mlir-passes.log"):
                with f.open() as log:
                    m = next((m for line in log if (m := _LAUNCH.search(line))), None)
                if m:
                    launches.append(tuple(int(v) for v in m.groups()))
        out.append(dataclasses.replace(
            k, registers=max((r for r, _ in figures), default=None),
            spilled_bytes=max((s for _, s in figures), default=None),
            grid=launches[0][:3] if launches else None,
            threads=launches[0][3:6] if launches else None,
            shared_memory=max((x[6] for x in launches), default=None)))
    return out


_INSTR = re.compile(
    r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} (copy|copy-start|transpose|fusion)\(")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _source(op_name: str) -> str:
    """An instruction's ``op_name`` without the jitted functions' names
    (``jit(prefill_step)/jit(main)/layer_3/rms_norm/...`` -> ``layer_3/rms_norm/...``)."""
    names = dict.fromkeys(  # a fused instruction's names, ";"-joined: each once
        "/".join(p for p in name.split("/") if not re.fullmatch(r"\w*jit\(.*\)", p))
        for name in op_name.split(";"))
    return "; ".join(names)


def copies(hlo_text: str) -> list[Copy]:
    """The copies and transposes of an optimized HLO module outside fusion bodies (a
    fusion counts when its name says it is one: ``copy_fusion``, ``transpose_fusion``)."""
    out, fused = [], False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header (or the module's)
            fused = line.startswith(("%fused", "fused", "%wrapped", "wrapped"))
            continue
        if fused or not (m := _INSTR.match(line)):
            continue
        name, dtype, dims, op = m.groups()
        if op == "fusion" and not re.match(r"(copy|transpose)", name):
            continue
        if dtype not in _BYTES:
            continue
        shape = [int(d) for d in dims.split(",") if d]
        source = _OP_NAME.search(line)
        out.append(Copy(op if op != "fusion" else name.split(".")[0],
                        f"{dtype}[{dims}]", int(np.prod(shape)) * _BYTES[dtype],
                        _source(source.group(1)) if source else ""))
    return out
