"""The benchmark scripts keep running: each in its ``--quick`` smoke mode (tiny shapes,
seconds). Nothing here is timed; the figures live in BENCHMARKS.md."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_decode_cpu_quick_prints_the_table():
    pytest.importorskip("torch", reason="the benchmark compares with transformers on torch")
    pytest.importorskip("transformers", reason="the benchmark compares with transformers")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_cpu.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    for row in ("memory bandwidth", "weights read per token", "limit (weights / bandwidth)",
                "forge_jax, paged cache", "forge_jax, contiguous cache",
                "forge_jax, bf16 checkpoint", "HF transformers eager"):
        assert row in out, out
    assert "% of limit" in out and "x HF" in out, out


def test_deepseek_cpu_quick_prints_the_bytes_and_the_table():
    pytest.importorskip("torch", reason="the benchmark compares with transformers on torch")
    transformers = pytest.importorskip("transformers", reason="compares with transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepSeek-V3")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "deepseek_cpu.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    # DeepSeek-V3's shape: 61 x 576 bfloat16 values against 61 x 128 x (192 + 128).
    assert "latent 70,272 (measured pool: 70,272), expanded K/V 4,997,120" in out, out
    for row in ("forge_jax, paged latent cache", "forge_jax, contiguous latent cache",
                "transformers eager"):
        assert row in out, out


def test_decode_cpu_prefill_quick_prints_the_table():
    pytest.importorskip("torch", reason="the benchmark compares with transformers on torch")
    pytest.importorskip("transformers", reason="the benchmark compares with transformers")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_cpu.py"), "--prefill", "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    for row in ("forge_jax forward (all logits)", "forge_jax generate prefill, paged",
                "forge_jax generate prefill, contiguous", "HF transformers forward (all logits)",
                "HF transformers forward (last logits)", "8 tokens", "32 tokens", "tok/s",
                "first call"):
        assert row in out, out
    assert "HF forward's speed" in out and "target (" in out, out


def test_serve_cpu_quick_prints_the_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_cpu.py"), "--quick",
         "--concurrency", "1", "4", "--sequential-requests", "1", "--new-tokens", "4",
         "--phases"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    for row in ("memory-bandwidth probe", "sequential generate:", "| on | on | 1 |",
                "| on | on | 4 |", "| off | on | 4 |", "seconds per phase", "device"):
        assert row in out, out


def test_grouped_matmul_cpu_quick_prints_the_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "grouped_matmul_cpu.py"), "--quick",
         "--iters", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    for name in ("xla (visit loop)", "ragged_dot", "loop over groups"):
        assert name in result.stdout, result.stdout


def test_speculative_cpu_quick_prints_the_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "speculative_cpu.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = result.stdout
    for row in ("| code edit | 24 | off |", "| free text | 24 | n-gram, K=4 |"):
        assert row in out, out
    assert "| NO |" not in out, out  # greedy speculation gave the plain decode's tokens
