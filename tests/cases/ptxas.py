"""ptxas' figures for a Mosaic GPU kernel compiled for an H100 target without a device
(``fj.aot.compile``; Mosaic GPU runs ``ptxas`` for sm_90a and prints its report, which
:func:`forge_jax.pallas_kernels.gpu._mosaic.ptxas_report` collects)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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
