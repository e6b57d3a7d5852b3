"""The CPU implementation of ``quantized_matmul`` for decode-sized products: a C++ kernel
called through ``jax.ffi`` (``quantized_matmul_cpu.cc`` beside this module).

What it computes: ``a [M, K] @ dequantize(b).T`` for a weight ``b`` ``[N, K]``
(``trans_b``) in the int4 format (GGUF's Q4_0, Q4_1, Q4_K as the loader keeps them:
groups of 32 or more, symmetric or with minimums) or the int8 format (Q8_0, Q5_*, Q6_K,
per-channel int8: groups of 16 or more), float16 or float32 scales, for 1 to
:data:`MAX_ROWS` rows of float32 activations.
The weight is expanded to float32 in vector registers, never in memory, and multiplied
with the float32 activations (no activation quantization, unlike llama.cpp's kernels:
the result is the float32 product of the dequantized weight, summed in another order, so
logits keep matching transformers' GGUF loading within the GGUF tests' tolerance). The
weight's rows are split over XLA:CPU's intra-op thread pool.

llama.cpp's numerics (activations quantized to int8 per block of 32, integer dot
products) are not offered: on SmolLM2-135M's Q4_1 GGUF, layer 0's q/k/v and gate/up
products and the Q8_0 head of real token activations miss the float64 product by
0.5-1.3% of the largest output with them, against 6e-7 to 1e-6 in float32, where the GGUF
test against transformers allows 1e-4 of the logits.

Why C++ and not an XLA formulation (measured on this repository's 2-core AVX-512 host,
JAX 0.10.2, one row of activations, SmolLM2-135M's shapes, best of 30 jitted calls):

====================  =========  ====================  ==========================
weight [N, K]         float32    XLA, int4 block-wise  XLA multiply-and-reduce
====================  =========  ====================  ==========================
3072 x 576            0.100 ms   0.317 ms              1.17 ms
576 x 1536            0.095 ms   0.171 ms              0.43 ms
49152 x 576           4.76 ms    6.50 ms               189 ms
====================  =========  ====================  ==========================

XLA:CPU cannot fuse a dequantization into its dot (the dot is a library call on a
materialised operand), so the block-wise form (the ``"xla"`` implementation) writes and
reads a float32 block of the weight for every block, slower than reading float32 weights
outright; written as a multiply-and-reduce the dequantization fuses, but XLA:CPU's
reductions are not vectorised along the contracted axis (40x slower). XLA's int8 x int8
dot needs quantized activations (another computation) and is slower than float32 too
(``benchmarks/quant_cpu.py``). The kernel reads 4.5 (int4 with float16 scales and
minimums: 5) bits a weight: BENCHMARKS.md has its figures (``benchmarks/quant_cpu.py``,
``benchmarks/cpu_vs_llamacpp.py``).

Built at first use with the machine's C++ compiler (``$CXX``, else ``c++``/``g++``/
``clang++``; ``-O3 -march=native``: AVX-512 or AVX2 intrinsics where the CPU has them, a
portable scalar loop otherwise) into ``$XDG_CACHE_HOME/forge_jax/cpu_kernels`` (a file
per source, compiler, jaxlib version and CPU), against the XLA FFI headers jaxlib ships.
Where it cannot be built (no compiler, no headers) the implementation is unavailable with
the reason (``forge-jax info`` shows it) and the XLA implementation serves;
``FORGE_JAX_CPU_KERNELS=0`` turns it off (``=avx2`` or ``=portable`` builds the AVX2 or the
scalar code on a machine with more).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from forge_jax import dispatch
from forge_jax.ops.quantized_matmul import scale_and_add

logger = logging.getLogger("forge_jax.ops.quantized_matmul_cpu")

MAX_ROWS = 8  # above this, XLA's blocked dot is as fast or faster (module docstring)
_SOURCE = pathlib.Path(__file__).with_name("quantized_matmul_cpu.cc")
_TARGET = "forge_jax_quantized_matmul_cpu"
_ENV = "FORGE_JAX_CPU_KERNELS"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor()


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "forge_jax" / "cpu_kernels"


# FORGE_JAX_CPU_KERNELS=avx2 or =portable builds for fewer instructions than the machine
# has (each code path can be tested on one machine).
_ISA_FLAGS = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2"]}


def _build() -> pathlib.Path:
    """The kernel's shared library, built now if this machine has none yet."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    include = pathlib.Path(jax.ffi.include_dir())
    if not (include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib ships no XLA FFI headers under {include}")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=False).stdout
    flags = ["-O3", "-march=native", *_ISA_FLAGS.get(os.environ.get(_ENV, ""), []),
             "-std=c++17", "-shared", "-fPIC", f"-I{include}"]
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), cxx, version, *flags, jax.__version__,
                                    jax.lib.__version__, _cpu_flags()]).encode()).hexdigest()
    out = _cache_dir() / f"quantized_matmul_cpu-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU quantized-matmul kernel with %s (once per machine)", cxx)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = pathlib.Path(tmp) / out.name
        cmd = [cxx, *flags, str(_SOURCE), "-o", str(part)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {last}")
        os.replace(part, out)  # atomic: a concurrent build writes the same bytes
    return out


@functools.cache
def _load() -> str | None:
    """Builds (once) and registers the kernel; ``None``, or why it is unavailable."""
    if os.environ.get(_ENV, "1") == "0":
        return f"turned off ({_ENV}=0)"
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"no build for this CPU ({platform.machine()})"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(
            _TARGET, jax.ffi.pycapsule(library.ForgeJaxQuantizedMatmulCpu), platform="cpu")
    except Exception as e:  # any failure to build or load is a reason, not a crash
        logger.info("the CPU quantized-matmul kernel is unavailable: %s", e)
        return f"the C++ kernel could not be built or loaded: {e}"
    return None


def available() -> str | None:
    return _load()


def supports(args, platform: str) -> str | None:
    a, b = args["a"], args["b"]
    if platform != "cpu":
        return f"a CPU kernel; platform is {platform}"
    if b.format not in ("int4", "int8"):
        return f"only int4 and int8 weights (b.format={b.format!r})"
    if b.activations is not None:
        return f"weight-only products (b.activations={b.activations!r})"
    if not args["trans_b"]:
        return "needs the [out, in] weight layout (trans_b=True)"
    if b.spec and any(s is not None for s in b.spec):
        return f"a weight split over a mesh (b.spec={b.spec})"
    rows_per_scale, group = b.full_block()
    k = b.shape[1]
    step = 32 if b.format == "int4" else 16
    if rows_per_scale != 1 or group % step or k % group:
        return (f"needs one scale per row and groups of a multiple of {step} along K "
                f"(b.block={b.block}, b.shape={b.shape})")
    if a.dtype != jnp.float32:
        # (the op dequantizes to a's dtype: a bfloat16 product rounds the weight to bfloat16)
        return f"float32 activations (a.dtype={jnp.dtype(a.dtype).name})"
    if b.scales.dtype not in (jnp.float16, jnp.float32) or (
            b.minimums is not None and b.minimums.dtype != b.scales.dtype):
        return (f"float16 or float32 scales (and minimums of the same dtype): "
                f"b.scales.dtype={jnp.dtype(b.scales.dtype).name}")
    m = 1
    for d in a.shape[:-1]:
        m *= d
    if m > MAX_ROWS:
        return f"decode-sized products of at most {MAX_ROWS} rows ({m} rows: XLA is faster)"
    return None


def quantized_matmul_cpu(a, b, *, trans_b, alpha, beta, c, out_dtype):
    del trans_b  # always True (supports)
    lead, k = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, k)  # [M, K] float32
    _, group = b.full_block()
    scales = b.scales
    minimums = b.minimums if b.minimums is not None else scales  # (unread when symmetric)
    call = jax.ffi.ffi_call(
        _TARGET, jax.ShapeDtypeStruct((a2.shape[0], b.shape[0]), jnp.float32),
        vmap_method="sequential")
    with jax.named_scope("quantized_matmul_cpu"):
        out = call(a2, b.values, scales, minimums,
                   group=int(group), int4=b.format == "int4", symmetric=b.minimums is None)
    return scale_and_add(out.reshape(*lead, out.shape[-1]), alpha=alpha, beta=beta, c=c,
                         out_dtype=out_dtype)


dispatch.register(
    "quantized_matmul", "cpu_kernel", priority={"cpu": 10}, platforms=("cpu",),
    supports=supports, available=available,
    verified={"cpu": "x86-64 with AVX-512 (2 cores), JAX 0.10.2, 2026-11-28: faster than "
                     "float32 and the XLA implementation at 1-32 rows (BENCHMARKS.md)"},
    description="C++ kernel through jax.ffi, the weight expanded in registers (1-32 rows of "
                "int4/int8; built at first use with the machine's compiler)",
)(quantized_matmul_cpu)
