"""benchmarks/gpu.py on CPU: its ``--quick`` path (the kernels in Pallas' interpreter), the
check column against XLA, rows for kernels that are missing or raise, and the exit status.
Nothing here is timed; GPU figures come from running the script on a GPU."""

import contextlib
import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import pytest

import forge_jax as fj
from forge_jax import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
KERNELS = ("rms_norm", "silu_mul", "rope", "attention", "paged_attention")
INTERPRET = "pallas_gpu_interpret"

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu",
                                reason="the CPU path of the script (a GPU runs the real thing)")


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _replaced(op, name, fn=None):
    """Registers ``fn`` as ``op``'s implementation ``name`` (``None``: unregisters it), and
    puts back whatever was registered under that name afterwards."""
    saved = [impl for impl in dispatch.registrations(op) if impl.name == name]
    try:
        if saved:
            dispatch.unregister(op, name)
        if fn is not None:
            dispatch.register(op, name)(fn)
        yield
    finally:
        if any(impl.name == name for impl in dispatch.registrations(op)):
            dispatch.unregister(op, name)
        for impl in saved:
            dispatch.register(
                op, name, priority=impl.priority, supports=impl.supports,
                available=impl.available, description=impl.description,
                platforms=None if impl.platforms is None else tuple(impl.platforms),
                verified=impl.verified, replace=True)(impl.fn)


def _rows(result):
    return {(r["kernel"], r["implementation"]): r for r in result["rows"]}


def test_quick_run_checks_every_kernel_against_xla(tmp_path):
    out_json = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--iters", "2", "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "NOT GPU FIGURES" in out, out
    result = json.loads(out_json.read_text())
    assert result["gpu"] is False and result["kernel_implementation"] == INTERPRET
    assert result["jax"] == jax.__version__ and result["device"] and result["date"]
    assert result["peaks"]["copy_gb_s"] > 0 and result["peaks"]["matmul_tflop_s"] > 0
    rows = _rows(result)
    for kernel in KERNELS:
        assert f"| {kernel} |" in out, out
        assert rows[(kernel, "xla")]["check"] == "reference", rows[(kernel, "xla")]
        assert rows[(kernel, "xla")]["seconds"] > 0
        ours = rows[(kernel, INTERPRET)]
        assert ours["status"] in ("ok", "not registered", "error"), ours
        if ours["status"] == "ok":
            assert ours["check"] in ("PASS", "FAIL") and ours["max_err"] is not None, ours
            assert ours["target"] and ours["met"] in (True, False), ours
    assert rows[("attention", "cudnn")]["status"] == "skipped", rows[("attention", "cudnn")]
    assert "GPU" in rows[("attention", "cudnn")]["note"]
    mosaic = rows[("attention", "mosaic_gpu")]
    assert mosaic["status"] == "skipped" and "runs on gpu" in mosaic["note"], mosaic
    for kernel in ("rms_norm", "silu_mul", "rope"):
        triton = rows[(kernel, "triton")]
        assert triton["status"] == "skipped" and "jax-triton" in triton["note"], triton
    for kernel in KERNELS:
        auto = rows[(kernel, "auto")]
        assert auto["check"] == "PASS" and auto["note"] == "auto chose 'xla'", auto
        ratio = result["auto_vs_fastest"][kernel]
        assert ratio["ratio"] > 0 and ratio["fastest"] in ("xla", INTERPRET), ratio
    assert "auto vs the fastest passing implementation (goal: <= 1.05x): rms_norm " in out
    failed = [r for r in result["rows"] if r["status"] == "error" or r["check"] == "FAIL"]
    assert run.returncode == (1 if failed else 0), (failed, out)
    assert result["passed"] is not bool(failed)


def test_failing_check_missing_and_raising_kernels_show_in_the_table(tmp_path, capsys):
    gpu = _load_script()

    def wrong_rms_norm(x, weight, *, eps, residual):
        out = fj.rms_norm(x, weight, eps=eps, residual=residual, implementation="xla")
        return jax.tree.map(lambda t: t * 1.1, out)

    def raising_silu_mul(gate, up):
        raise RuntimeError("deliberately broken")

    out_json = tmp_path / "bench.json"
    with (_replaced("rms_norm", INTERPRET, wrong_rms_norm),
          _replaced("silu_mul", INTERPRET, raising_silu_mul),
          _replaced("rope", INTERPRET, None)):
        status = gpu.main(["--quick", "--iters", "1", "--only", "rms_norm,silu_mul,rope",
                           "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 1, out
    rows = _rows(json.loads(out_json.read_text()))
    assert rows[("rms_norm", INTERPRET)]["check"] == "FAIL", out
    assert rows[("rms_norm", INTERPRET)]["err_ratio"] > 1
    assert rows[("silu_mul", INTERPRET)]["status"] == "error", out
    assert "deliberately broken" in rows[("silu_mul", INTERPRET)]["note"]
    assert rows[("rope", INTERPRET)]["status"] == "not registered", out
    assert f"| rms_norm | {rows[('rms_norm', 'xla')]['shape']} | {INTERPRET} | FAIL |" in out
    assert "| ERROR |" in out and "| not registered |" in out, out
    assert "FAILED: rms_norm/pallas_gpu_interpret (check), silu_mul/pallas_gpu_interpret " \
        "(error)" in out, out
    # The registrations are back as they were.
    for op in ("rms_norm", "silu_mul"):
        impls = dispatch.implementations(op, "cpu")
        assert INTERPRET not in impls or impls[INTERPRET].fn not in (
            wrong_rms_norm, raising_silu_mul)


def test_without_a_gpu_it_asks_for_one(tmp_path, capsys):
    gpu = _load_script()
    assert gpu.main(["--json", str(tmp_path / "x.json")]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        gpu.main(["--quick", "--only", "rms_norm,flash"])
