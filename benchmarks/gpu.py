"""GPU kernels: check each Pallas kernel against XLA and time it against XLA, cuDNN and the
device's measured peaks, in one run.

For every kernel (rms_norm with residual, silu_mul, rope, attention, paged_attention) at
its benchmark shape, on fresh random data (the seed is printed):

* **check**: the kernel (implementation ``"pallas"``, compiled for the GPU) against the
  XLA implementation on the same inputs: ``|out - xla| <= atol + rtol * |xla|`` elementwise,
  with the tolerances of ``forge_jax.tolerances`` for the kernel and for XLA summed (each
  bounds its distance to the exact result). NaN fails. cuDNN's attention is checked the same way.
* **time**: each implementation jitted, warmed up, then ``--iters`` samples; a sample
  times enough back-to-back calls (one ``block_until_ready`` at the end) to last a few
  milliseconds, so that host dispatch hides behind the GPU; the median sample is reported.
  None of these ops writes in place, so the same inputs serve every call.
* **work**: the bytes a perfect kernel must read and write (e.g. rms_norm with residual
  reads x, residual and weight, writes y and h), or for attention the FLOPs,
  ``4 * batch * heads * seq**2 * head_dim / 2`` causal.
* **peaks**, measured in the same run on random data (Hopper compresses zeros): the copy
  bandwidth, best of ``x + 1`` and ``jnp.copy`` over a 1 GiB bfloat16 array (bytes read +
  written / time), and the bfloat16 matmul rate of an 8192^3 product (2*M*N*K / time).

Targets (H100): rms_norm, silu_mul, rope >= 80% of the copy bandwidth; paged decode
attention >= 70%; flash attention forward >= 350 TFLOP/s. Mosaic GPU kernels
(implementation ``"mosaic_gpu"``, Hopper; ``"mosaic_gpu_interpret"`` in ``--quick`` on
CPU where :data:`MOSAIC_ON_CPU` lists them) are timed beside them: flash attention forward
>= 650 TFLOP/s; paged decode >= 85% of the copy bandwidth; the int8-weight decode matmul
(``quantized_matmul``, Llama-3 8B's 4096 -> 14336 for one token) >= 80% of the copy
bandwidth for its bytes (weight values and scales, x, output). cuDNN attention
(``fj.attention``'s ``"cudnn"`` implementation, i.e. ``jax.nn.dot_product_attention``)
and the jax-triton kernels (``"triton"``: rms_norm, silu_mul, rope) run where their
``supports()`` accept the case; otherwise their row says why they were skipped. The
``"auto"`` row times what auto selection picks (its note names it), the figure the
"auto is never more than 5% slower than the fastest" goal is read from.

The result is a markdown table on stdout and a JSON file (``--json``). Exit status: 0 when
every check passed and nothing raised; 1 when a check failed or an implementation raised
(the row says which); 2 without a GPU outside ``--quick``. A kernel not yet registered is
reported as such and does not change the status.

Usage::

    python benchmarks/gpu.py                       # H100 shapes (a few minutes)
    python benchmarks/gpu.py --only rms_norm,attention --iters 50
    python benchmarks/gpu.py --quick               # tiny shapes; on CPU the kernels run
                                                   # in Pallas' interpreter (a smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import forge_jax as fj  # noqa: E402
from forge_jax import dispatch, tolerances  # noqa: E402

KERNELS = ("rms_norm", "silu_mul", "rope", "attention", "paged_attention", "quantized_matmul")
CUDNN = "cudnn"
# Library implementations timed beside the Pallas kernel where they exist: jax-triton
# kernels, cuDNN attention. Each row says why it was skipped where it cannot run.
LIBRARY = {"rms_norm": ("triton",), "silu_mul": ("triton",), "rope": ("triton",),
           "attention": (CUDNN,)}
# Targets of other implementations than the case's: the Mosaic GPU kernels'.
TARGETS = {("paged_attention", "mosaic_gpu"): 0.85, ("attention", "mosaic_gpu"): 650.0}
MOSAIC_ON_CPU = ("quantized_matmul",)  # checked in their interpreter on CPU (--quick)
AUTO = "auto"  # implementation=None: what auto selection picks (the row's note names it)
SAMPLE_S = 0.005  # a timed sample lasts about this long (back-to-back calls)
MAX_CALLS = 200  # calls per sample at most


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel at one shape.

    ``make(key)`` returns the input arrays; ``run(implementation, *inputs)`` calls the op
    (traced under jit); ``work`` is bytes (``unit`` "GB/s") or FLOPs ("TFLOP/s");
    ``target`` is a fraction of the copy bandwidth for bytes, TFLOP/s for FLOPs.
    """

    kernel: str
    shape: str
    make: Callable[[jax.Array], tuple[jax.Array, ...]]
    run: Callable[..., Any]
    work: int
    unit: str
    target: float


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def rms_norm_case(rows, dim, dtype):
    def make(key):
        kx, kr, kw = jax.random.split(key, 3)
        return (_normal(kx, (rows, dim), dtype), _normal(kr, (rows, dim), dtype),
                1 + 0.1 * _normal(kw, (dim,), jnp.float32).astype(dtype))

    def run(impl, x, residual, weight):
        return fj.rms_norm(x, weight, residual=residual, eps=1e-6, implementation=impl)

    size = jnp.dtype(dtype).itemsize
    # Read x, residual and weight; write y and h.
    return Case("rms_norm", f"[{rows}, {dim}] {jnp.dtype(dtype).name} + residual", make, run,
                work=(4 * rows * dim + dim) * size, unit="GB/s", target=0.80)


def silu_mul_case(rows, dim, dtype):
    def make(key):
        kg, ku = jax.random.split(key)
        return _normal(kg, (rows, dim), dtype), _normal(ku, (rows, dim), dtype)

    def run(impl, gate, up):
        return fj.silu_mul(gate, up, implementation=impl)

    return Case("silu_mul", f"[{rows}, {dim}] {jnp.dtype(dtype).name}", make, run,
                work=3 * rows * dim * jnp.dtype(dtype).itemsize, unit="GB/s", target=0.80)


def rope_case(batch, seq, heads, head_dim, dtype):
    def make(key):
        x = _normal(key, (batch, seq, heads, head_dim), dtype)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        return x, positions

    def run(impl, x, positions):
        return fj.rope(x, positions, implementation=impl)

    # Read x and the positions, write the rotated x; a perfect kernel computes cos/sin.
    size = batch * seq * heads * head_dim * jnp.dtype(dtype).itemsize
    return Case("rope", f"[{batch}, {seq}, {heads}, {head_dim}] {jnp.dtype(dtype).name}", make,
                run, work=2 * size + 4 * batch * seq, unit="GB/s", target=0.80)


def attention_case(batch, seq, q_heads, kv_heads, head_dim, dtype):
    def make(key):
        kq, kk, kv = jax.random.split(key, 3)
        return (_normal(kq, (batch, seq, q_heads, head_dim), dtype),
                _normal(kk, (batch, seq, kv_heads, head_dim), dtype),
                _normal(kv, (batch, seq, kv_heads, head_dim), dtype))

    def run(impl, q, k, v):
        return fj.attention(q, k, v, causal=True, implementation=impl)

    # Causal FLOPs: two matmuls of 2 * seq**2 * head_dim each per head, half of them masked.
    flops = 4 * batch * q_heads * seq * seq * head_dim // 2
    return Case("attention", f"b{batch} s{seq} h{q_heads}/{kv_heads} d{head_dim} causal "
                f"{jnp.dtype(dtype).name}", make, run, work=flops, unit="TFLOP/s",
                target=350.0)


def paged_attention_case(batch, context, q_heads, kv_heads, head_dim, page, dtype):
    pages_per_seq = -(-context // page)
    num_pages = batch * pages_per_seq

    def make(key):
        kq, kk, kv, kt = jax.random.split(key, 4)
        q = _normal(kq, (batch, q_heads, head_dim), dtype)
        k_pages = _normal(kk, (kv_heads, num_pages, page, head_dim), dtype)
        v_pages = _normal(kv, (kv_heads, num_pages, page, head_dim), dtype)
        # Each sequence owns pages scattered over the pool, as after a while of serving.
        tables = jax.random.permutation(kt, num_pages).astype(jnp.int32)
        tables = tables.reshape(batch, pages_per_seq)
        lengths = jnp.full((batch,), context, jnp.int32)
        return q, k_pages, v_pages, tables, lengths

    def run(impl, q, k_pages, v_pages, tables, lengths):
        return fj.paged_attention(q, k_pages, v_pages, tables, lengths, implementation=impl)

    size = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * batch * context * kv_heads * head_dim * size
    # The K/V of every sequence's context, q and out, the block tables and lengths.
    work = kv_bytes + 2 * batch * q_heads * head_dim * size + 4 * batch * (pages_per_seq + 1)
    return Case("paged_attention", f"b{batch} ctx{context} h{q_heads}/{kv_heads} d{head_dim} "
                f"page{page} {jnp.dtype(dtype).name}", make, run, work=work, unit="GB/s",
                target=0.70)


def quantized_matmul_case(rows, n, k, dtype):
    """``fj.matmul(x, q, trans_b=True)``, ``q`` int8 ``[n, k]`` per channel (bytes: q, x, out)."""
    def make(key):
        kx, kw = jax.random.split(key)
        q = fj.quantize(_normal(kw, (n, k), jnp.float32), "int8")
        return _normal(kx, (rows, k), dtype), q

    def run(impl, x, q):
        return fj.matmul(x, q, trans_b=True, implementation=impl)

    itemsize = jnp.dtype(dtype).itemsize
    work = n * k + 4 * n + rows * k * itemsize + rows * n * itemsize
    return Case("quantized_matmul", f"int8 [{n}, {k}], {rows} rows {jnp.dtype(dtype).name}",
                make, run, work, "GB/s", 0.8)


def cases(quick: bool) -> dict[str, Case]:
    bf16 = jnp.bfloat16
    if quick:
        built = (rms_norm_case(64, 256, bf16), silu_mul_case(64, 256, bf16),
                 rope_case(1, 64, 4, 64, bf16),
                 attention_case(1, 128, 4, 2, 64, bf16),
                 paged_attention_case(4, 64, 4, 2, 64, 16, bf16),
                 quantized_matmul_case(1, 128, 256, bf16))
    else:
        built = (rms_norm_case(4096, 4096, bf16), silu_mul_case(4096, 4096, bf16),
                 rope_case(1, 4096, 32, 128, bf16),
                 attention_case(2, 4096, 32, 8, 128, bf16),
                 paged_attention_case(32, 4096, 32, 8, 128, 16, bf16),
                 quantized_matmul_case(1, 14336, 4096, bf16))  # Llama-3 8B's gate/up
    return {case.kernel: case for case in built}


# ---------------------------------------------------------------------------------------
# Timing and checking


def time_call(fn: Callable[..., Any], inputs, *, iters: int, warmup: int,
              sample_s: float = SAMPLE_S) -> list[float]:
    """Seconds per call of the jitted ``fn(*inputs)``: ``iters`` samples, each of enough
    back-to-back calls to last ``sample_s`` (compilation and ``warmup`` calls excluded)."""
    jax.block_until_ready(fn(*inputs))
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    single = time.perf_counter() - start
    calls = max(1, min(MAX_CALLS, int(sample_s / max(single, 1e-9))))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*inputs)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
        del out
    return samples


@jax.jit
def _errors(out, ref, atol, rtol):
    """(all within ``atol + rtol * |ref|``, max |out - ref|, max error / allowed), float32."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = jnp.abs(out - ref)
    allowed = atol + rtol * jnp.abs(ref)
    return jnp.all(err <= allowed), jnp.max(err), jnp.max(err / allowed)  # NaN fails


def compare(out, ref, implementation: str) -> tuple[bool, float, float]:
    """``(passed, max |out - ref|, worst error / allowed)`` over every output array."""
    passed, max_err, worst = True, 0.0, 0.0
    out_leaves, ref_leaves = jax.tree.leaves(out), jax.tree.leaves(ref)
    if len(out_leaves) != len(ref_leaves):
        return False, math.inf, math.inf
    for o, r in zip(out_leaves, ref_leaves, strict=True):
        if o.shape != r.shape or o.dtype != r.dtype:
            return False, math.inf, math.inf
        tol_k, tol_x = tolerances.tolerance(r.dtype, implementation), tolerances.tolerance(r.dtype)
        ok, err, ratio = _errors(o, r, tol_k.atol + tol_x.atol, tol_k.rtol + tol_x.rtol)
        passed &= bool(ok)
        max_err, worst = max(max_err, float(err)), max(worst, float(ratio))
    return passed, max_err, worst


def measure_peaks(quick: bool, iters: int, warmup: int, key) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written / s) and bfloat16 matmul FLOP/s."""
    n = (4 << 20 if quick else 1 << 30) // 2  # bfloat16 elements
    x = jax.jit(_normal, static_argnums=(1, 2))(key, (n // 4096, 4096), jnp.bfloat16)
    copies = {"x + 1": jax.jit(lambda x: x + 1), "jnp.copy": jax.jit(jnp.copy)}
    copy_gbs = {name: 2 * x.nbytes / statistics.median(
        time_call(fn, (x,), iters=iters, warmup=warmup)) / 1e9 for name, fn in copies.items()}
    del x
    m = 256 if quick else 8192
    ka, kb = jax.random.split(jax.random.fold_in(key, 1))
    normal = jax.jit(_normal, static_argnums=(1, 2))
    a, b = normal(ka, (m, m), jnp.bfloat16), normal(kb, (m, m), jnp.bfloat16)
    matmul_s = statistics.median(time_call(jax.jit(jnp.matmul), (a, b), iters=iters,
                                           warmup=warmup))
    return {
        "copy_gb_s": max(copy_gbs.values()),
        "copy_gb_s_by_method": copy_gbs,
        "copy_bytes": 2 * n * 2,
        "matmul_tflop_s": 2 * m**3 / matmul_s / 1e12,
        "matmul_shape": f"[{m}, {m}] @ [{m}, {m}] bfloat16",
    }


@dataclasses.dataclass
class Row:
    kernel: str
    shape: str
    implementation: str
    status: str  # "ok", "not registered", "skipped", "error"
    check: str = ""  # "PASS", "FAIL", "reference", ""
    max_err: float | None = None
    err_ratio: float | None = None  # worst |out - xla| / allowed; <= 1 passes
    seconds: float | None = None
    samples_s: list[float] = dataclasses.field(default_factory=list)
    throughput: float | None = None  # GB/s or TFLOP/s
    unit: str = ""
    fraction_of_peak: float | None = None
    target: str = ""
    met: bool | None = None
    vs_xla: float | None = None  # xla seconds / these seconds
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "error" or self.check == "FAIL"


def registered(kernel: str, implementation: str, platform: str) -> bool:
    return implementation in dispatch.implementations(kernel, platform)


def library_skip(case: Case, name: str, platform: str, inputs) -> str:
    """Why implementation ``name`` cannot run ``case`` here ("" when it can): not
    registered on this platform, unavailable (no GPU, jax-triton missing), or its
    ``supports()`` rejects the arguments."""
    impls = dispatch.implementations(case.kernel, platform)
    if name not in impls:
        regs = [i for i in dispatch.registrations(case.kernel) if i.name == name]
        if not regs:
            return f"{name!r} is not registered"
        served = sorted(p for i in regs for p in (i.platforms or ()))
        reason = next((r for i in regs if (r := i.available())), None)
        return (f"{name!r} runs on {', '.join(served)}, this run is on {platform}"
                + (f" ({reason})" if reason else ""))
    try:
        jax.eval_shape(lambda *a: case.run(name, *a), *inputs)
    except dispatch.ImplementationError as e:
        return str(e).split(": ", 1)[-1]
    return ""


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def bench_case(case: Case, kernel_impl: str, platform: str, peaks: dict[str, Any], *,
               iters: int, warmup: int, key) -> list[Row]:
    inputs = jax.jit(case.make)(key)  # one compilation, not one per eager op
    contenders: list[tuple[str, Callable[..., Any] | None, str]] = [
        ("xla", jax.jit(lambda *a: case.run("xla", *a)), "")]
    if registered(case.kernel, kernel_impl, platform):
        contenders.append((kernel_impl, jax.jit(lambda *a: case.run(kernel_impl, *a)), ""))
    else:
        contenders.append((kernel_impl, None, "not registered"))
    for name in LIBRARY.get(case.kernel, ()):
        skip = library_skip(case, name, platform, inputs)
        contenders.append((name, None if skip else jax.jit(
            lambda *a, name=name: case.run(name, *a)), skip and f"skipped: {skip}"))
    contenders += mosaic_contenders(case, platform, inputs)
    contenders.append((AUTO, jax.jit(lambda *a: case.run(None, *a)), ""))

    rows, reference = [], None
    for name, fn, skip in contenders:
        row = Row(case.kernel, case.shape, name, "ok", unit=case.unit)
        rows.append(row)
        if fn is None:
            row.status = "not registered" if skip == "not registered" else "skipped"
            row.note = skip
            continue
        try:
            out = fn(*inputs)
            jax.block_until_ready(out)
            if name == AUTO:
                chosen = dispatch.last_selection(case.kernel)
                row.note = f"auto chose {chosen.implementation!r}" if chosen else ""
            if name == "xla":
                reference, row.check = out, "reference"
            elif reference is None:
                row.check, row.note = "FAIL", "no XLA reference to check against"
            else:
                passed, row.max_err, row.err_ratio = compare(out, reference, name)
                row.check = "PASS" if passed else "FAIL"
            del out
            row.samples_s = time_call(fn, inputs, iters=iters, warmup=warmup)
        except Exception as e:  # the row reports it; the exit status says it failed
            row.status, row.note = "error", _error(e)
            continue
        row.seconds = statistics.median(row.samples_s)
        if case.unit == "GB/s":
            target = TARGETS.get((case.kernel, name), case.target)
            row.throughput = case.work / row.seconds / 1e9
            row.fraction_of_peak = row.throughput / peaks["copy_gb_s"]
            row.target = f">= {target:.0%} of copy"
            row.met = row.fraction_of_peak >= target
        else:
            target = TARGETS.get((case.kernel, name), case.target)
            row.throughput = case.work / row.seconds / 1e12
            row.fraction_of_peak = row.throughput / peaks["matmul_tflop_s"]
            row.target = f">= {target:g} TFLOP/s"
            row.met = row.throughput >= target
    xla = rows[0].seconds
    for row in rows[1:]:
        if xla and row.seconds:
            row.vs_xla = xla / row.seconds
    return rows


def mosaic_contenders(case: Case, platform: str, inputs) -> list[tuple]:
    """The Mosaic GPU kernel of ``case``'s op, where one is registered, beside
    the others: ``"mosaic_gpu"`` where a Hopper GPU runs it and its ``supports()`` accepts
    the case, else a row saying why not. On CPU, the kernels of :data:`MOSAIC_ON_CPU` run in
    the Mosaic GPU interpreter (a check of their results at the ``--quick`` shapes; its
    times say nothing of a GPU); the others' interpreters are too slow for this script."""
    if not any(i.name == "mosaic_gpu" for i in dispatch.registrations(case.kernel)):
        return []
    name = "mosaic_gpu"
    if platform != "gpu" and case.kernel in MOSAIC_ON_CPU:
        name = "mosaic_gpu_interpret"
    skip = library_skip(case, name, platform, inputs)
    return [(name, None if skip else jax.jit(
        lambda *a: case.run(name, *a)), skip and f"skipped: {skip}")]


def auto_vs_fastest(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Per kernel: the fastest implementation whose check passed (or XLA, the reference) and
    the ``"auto"`` row's time over its time (1.0: auto picked the fastest)."""
    out = {}
    for kernel in dict.fromkeys(r.kernel for r in rows):
        timed = [r for r in rows if r.kernel == kernel and r.seconds and r.status == "ok"
                 and r.check in ("PASS", "reference")]
        auto = next((r for r in timed if r.implementation == AUTO), None)
        others = [r for r in timed if r.implementation != AUTO]
        if auto and others:
            best = min(others, key=lambda r: r.seconds)
            out[kernel] = {"fastest": best.implementation, "ratio": auto.seconds / best.seconds}
    return out


# ---------------------------------------------------------------------------------------
# Report


def _fmt(value, spec, suffix=""):
    return "" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[Row]) -> str:
    header = ("kernel", "shape", "implementation", "check", "max err", "time (us)",
              "throughput", "% of peak", "target", "met", "vs xla")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        check = r.check if r.status == "ok" else r.status.upper() if r.status == "error" \
            else r.status
        if r.status == "skipped":
            check = r.note
        met = "" if r.met is None else "yes" if r.met else "no"
        cells = (r.kernel, r.shape, r.implementation, check, _fmt(r.max_err, ".2e"),
                 _fmt(None if r.seconds is None else 1e6 * r.seconds, ".1f"),
                 _fmt(r.throughput, ".1f", f" {r.unit}"), _fmt(r.fraction_of_peak, ".1%"),
                 r.target, met, _fmt(r.vs_xla, ".2f", "x"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finite(value):
    """``value`` with every NaN or infinity replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=pathlib.Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", "--smoke", action="store_true",
                        help="tiny shapes, few iterations; without a GPU the kernels run in "
                             "Pallas' interpreter and cuDNN is skipped (a smoke test)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated kernels to run (default all: {','.join(KERNELS)})")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed samples per implementation (default 30; 3 with --quick)")
    parser.add_argument("--json", default="gpu_bench.json", help="where to write the JSON")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    args = parser.parse_args(argv)
    known = KERNELS
    kernels = known if args.only is None else tuple(
        k.strip() for k in args.only.split(",") if k.strip())
    unknown = sorted(set(kernels) - set(known))
    if unknown or not kernels:
        parser.error(f"--only takes kernels among {', '.join(known)}; got {args.only!r}")
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    iters = args.iters or (3 if args.quick else 30)
    warmup = 1 if args.quick else 3

    platform = jax.default_backend()
    gpu = platform == "gpu"
    if not gpu and not args.quick:
        print(f"benchmarks/gpu.py needs a GPU: JAX's default backend here is {platform!r}. "
              "Run it on a GPU machine, or use --quick for a smoke test of the script on CPU "
              "(the kernels in Pallas' interpreter; its figures are not GPU figures).",
              file=sys.stderr)
        return 2
    kernel_impl = "pallas" if gpu else "pallas_gpu_interpret"
    seed = args.seed if args.seed is not None else time.time_ns() % 2**31
    key = jax.random.key(seed)
    device = jax.devices()[0]
    now = datetime.datetime.now(datetime.UTC)
    versions = {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
                "python": sys.version.split()[0]}
    print(f"# benchmarks/gpu.py {'--quick ' if args.quick else ''}| {now:%Y-%m-%d %H:%M} UTC | "
          f"{device.device_kind} ({platform}) | jax {versions['jax']}, jaxlib "
          f"{versions['jaxlib']} | commit {_git_commit()} | seed {seed}")
    if not gpu:
        print(f"# NOT GPU FIGURES: this run is on {platform}, with the kernels in Pallas' "
              "interpreter and no cuDNN; it checks the script and the kernels' results, and its "
              "times say nothing about a GPU.")
    print(f"# kernel implementation {kernel_impl!r}; {iters} samples per implementation, "
          f"median; check: |out - xla| <= atol + rtol * |xla| (forge_jax.tolerances, kernel "
          f"and XLA budgets summed)")

    peaks = measure_peaks(args.quick, iters, warmup, jax.random.fold_in(key, 0))
    print(f"# peaks: copy {peaks['copy_gb_s']:.1f} GB/s (best of "
          + ", ".join(f"{k} {v:.1f}" for k, v in peaks["copy_gb_s_by_method"].items())
          + f"; {peaks['copy_bytes'] / 2**30:.3g} GiB moved), matmul "
          f"{peaks['matmul_tflop_s']:.1f} TFLOP/s ({peaks['matmul_shape']})")

    all_cases = cases(args.quick)
    rows: list[Row] = []
    for i, kernel in enumerate(k for k in kernels if k in all_cases):
        rows += bench_case(all_cases[kernel], kernel_impl, platform, peaks, iters=iters,
                           warmup=warmup, key=jax.random.fold_in(key, 1 + i))
    print()
    print(table(rows))
    print()
    failed = [r for r in rows if r.failed]
    for r in rows:
        if r.status == "error" or (r.note and r.status == "ok"):
            print(f"{r.kernel} / {r.implementation}: {r.note}")
    missing = [r.kernel for r in rows if r.status == "not registered"]
    if missing:
        print(f"not registered as {kernel_impl!r}: {', '.join(missing)}")
    ours = [r for r in rows if r.status == "ok" and r.implementation in (
        kernel_impl, "mosaic_gpu", "mosaic_gpu_interpret")]
    if ours:
        print("targets met by our kernels: "
              + ", ".join(f"{r.kernel} {'yes' if r.met else 'no'}" for r in ours))
    auto = auto_vs_fastest(rows)
    if auto:
        print("auto vs the fastest passing implementation (goal: <= 1.05x): " + ", ".join(
            f"{k} {v['ratio']:.2f}x ({v['fastest']})" for k, v in auto.items()))
    print("all checks passed" if not failed else "FAILED: " + ", ".join(
        f"{r.kernel}/{r.implementation} ({'check' if r.check == 'FAIL' else 'error'})"
        for r in failed))

    result = {
        "device": device.device_kind, "platform": platform, "gpu": gpu,
        "note": "" if gpu else "not GPU figures: CPU run, kernels in Pallas' interpreter",
        "kernel_implementation": kernel_impl, "quick": args.quick, "iters": iters,
        "seed": seed, "date": now.isoformat(timespec="seconds"), "commit": _git_commit(),
        "command": " ".join(["benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)]),
        **versions, "peaks": peaks, "rows": [dataclasses.asdict(r) for r in rows],
        "auto_vs_fastest": auto, "passed": not failed,
    }
    path = pathlib.Path(args.json)
    path.write_text(json.dumps(_finite(result), indent=2, allow_nan=False, default=str) + "\n")
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
