"""ptxas' figures for a Mosaic GPU kernel compiled for an H100 target without a device
(``fj.aot.compile``; Mosaic GPU runs ``ptxas`` for sm_90a and prints its report, which
:func:`forge_jax.pallas_kernels.gpu._mosaic.ptxas_report` collects)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import _mosaic

# The deviceless H100 compile needs the CUDA 12 wheels (the ``aot`` extra).
NEEDS_H100 = pytest.mark.target("h100")


def compile_in_subprocess(script: str, cases, target: str, dump_dir) -> dict:
    """Runs ``script`` (Python source: it reads ``cases`` as JSON from ``sys.argv[1]`` and
    prints ``RESULT`` and its JSON findings) in a fresh CPU process whose Mosaic GPU compiles
    dump their PTX and ptxas' report into ``dump_dir``, and returns the findings; skips
    without the CUDA plugin ``target``'s deviceless compile needs."""
    missing = fj.targets.missing(target)
    if missing is not None:
        pytest.skip(missing)
    env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=str(dump_dir),
               MOSAIC_GPU_DUMP_PTXAS="1")
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)],
                         env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, run.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def compile_rows(script: str, cases: dict) -> dict[str, dict]:
    """Runs ``script`` (Python source that compiles ``cases`` and prints one JSON row per
    case, with its ``name``) in a fresh process; returns the rows by name, one per case."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(rows) == sorted(cases), done.stdout
    return rows


def compile_h100(fn, *args, **kwargs):
    """``fj.aot.compile(fn, *args, target="h100", **kwargs)``, and ptxas' spill stores
    (bytes) and registers, one entry per kernel ptxas compiled."""
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fn, *args, target="h100", **kwargs)
    spills = [int(n) for ln in lines if "stack frame" in ln
              for n in re.findall(r"(\d+) bytes spill stores", ln)]
    registers = [int(n) for ln in lines for n in re.findall(r"Used (\d+) registers", ln)]
    return report, spills, registers


def assert_one_kernel_without_spills(result: dict, kernel: str, *, flops: int, min_bytes: int,
                                     smem_limit: int) -> None:
    """One case of :func:`compile_in_subprocess`'s findings: accepted and compiled into the one
    ``kernel``, costed at ``flops`` and more than ``min_bytes``, in registers ptxas reported
    (at most 255), without spills, in at most ``smem_limit`` bytes of shared memory."""
    assert result["reason"] is None and result["compiled"], result
    [k] = result["kernels"]
    assert k["name"] == kernel and k["costed"], k
    assert k["flops"] == flops and k["bytes"] > min_bytes, k
    assert k["registers"] is not None and k["registers"] <= 255, k  # ptxas ran
    assert k["spilled"] == 0, k
    assert 0 < k["smem"] <= smem_limit, k


# The start of a compile_in_subprocess script for the Mosaic GPU quantized matmul:
# ``compile_case(target, m, n, k, fmt, dtype, **quantize)`` compiles ``[m, k] @ [n, k]^T``
# (the weight quantized to ``fmt``) through ``fj.matmul`` for ``target`` and returns what
# supports() said and the compiled kernels' figures.
QUANTIZED_MATMUL_PRELUDE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    import forge_jax as fj
    from forge_jax.pallas_kernels.gpu import mosaic_quantized_matmul as mq
    S = jax.ShapeDtypeStruct

    def compile_case(target, m, n, k, fmt, dtype, **quantize):
        q = jax.eval_shape(lambda w: fj.quantize(w, fmt, **quantize), S((n, k), jnp.float32))
        a = S((m, k), jnp.dtype(dtype))
        with fj.targets.use(target):
            reason = mq.supports(fj.dispatch.bind("quantized_matmul", a, q, trans_b=True))
        r = fj.aot.compile(lambda a, q: fj.matmul(a, q, trans_b=True), a, q, target=target,
                           implementation="mosaic_gpu")
        return dict(reason=reason, compiled=r.compiled, error=r.error, kernels=[
            dict(name=x.name, registers=x.registers, spilled=x.spilled_bytes,
                 smem=x.shared_memory, costed=x.costed, flops=x.flops,
                 bytes=x.bytes_accessed, roofline_us=x.roofline_seconds * 1e6)
            for x in r.kernels])
""")


def compiled_fixture(script: str, cases: dict, target: str):
    """A module-scoped fixture holding :func:`compile_in_subprocess`'s findings for
    ``cases`` (compiled once per test module, their Mosaic dumps in a temporary folder)."""

    @pytest.fixture(scope="module")
    def compiled(tmp_path_factory):
        return compile_in_subprocess(script, cases, target, tmp_path_factory.mktemp("mosaic_dump"))

    return compiled
