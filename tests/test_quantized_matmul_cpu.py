"""The CPU quantized_matmul kernel (forge_jax/ops/quantized_matmul_cpu.py, C++ through
jax.ffi), against a float64 product with the weight dequantized from its stored parts
(``cases.quant``), in the layouts the GGUF loader keeps (Q4_1, Q4_0, Q8_0: groups of 32,
float16 scales) and those ``fj.quantize`` makes (float32 scales, per channel or grouped).

Skipped where the kernel cannot be built (its reason is the skip message); what happens
then (the reason, the XLA implementation serving) is tested without building."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.quant import dequantize as dequantize_ref

import forge_jax as fj
from forge_jax.ops import quantized_matmul_cpu as cpu

# (format, group, symmetric, scale dtype, N, K): SmolLM2-135M's projections.
LAYOUTS = {
    "q4_1-gate-up": ("int4", 32, False, jnp.float16, 3072, 576),
    "q4_0-down": ("int4", 32, True, jnp.float16, 576, 1536),
    "q8_0-qkv": ("int8", 32, True, jnp.float16, 960, 576),
    "int4-g64-f32": ("int4", 64, False, jnp.float32, 256, 512),
    "int8-channel": ("int8", None, True, jnp.float32, 200, 576),
    "int8-g16-asym": ("int8", 16, False, jnp.float32, 72, 96),
    "q4_1-odd-groups": ("int4", 32, False, jnp.float16, 40, 96),  # 3 groups: a last one alone
    # 21 groups: at one row, two pairs of four-group blocks, a block alone, a group alone
    "q4_1-odd-blocks": ("int4", 32, False, jnp.float16, 48, 672),
}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    reason = cpu.available()
    if reason is not None:
        pytest.skip(f"the CPU kernel is unavailable here: {reason}")


def _weight(fmt, group, symmetric, scale_dtype, n, k, seed=0):
    gen = np.random.default_rng(seed)
    if fmt == "int8" and not symmetric:  # as GGUF's Q5_1 loads: values 0..31, minimums
        return fj.QuantizedArray(
            jnp.asarray(gen.integers(0, 32, (n, k)), jnp.int8),
            jnp.asarray(gen.uniform(1e-3, 4e-3, (n, k // group)), scale_dtype),
            jnp.asarray(gen.uniform(-0.06, 0.0, (n, k // group)), scale_dtype),
            "int8", (1, group))
    q = fj.quantize(jnp.asarray(gen.normal(0, 0.05, (n, k)), jnp.float32), fmt,
                    group_size=group, symmetric=symmetric)
    return fj.QuantizedArray(q.values, q.scales.astype(scale_dtype),
                             None if q.minimums is None else q.minimums.astype(scale_dtype),
                             q.format, q.block)


def _product(a, q, **kw):
    return jax.jit(lambda a, q: fj.matmul(a, q, trans_b=True, implementation="cpu_kernel",
                                          **kw))(a, q)


@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_matches_float64(layout, m):
    q = _weight(*layout)
    a = jnp.asarray(np.random.default_rng(1).normal(0, 1, (m, layout[-1])), jnp.float32)
    assert cpu.supports(dict(a=a, b=q, trans_b=True), "cpu") is None
    out = np.asarray(_product(a, q), np.float64)
    ref = np.asarray(a, np.float64) @ dequantize_ref(q).T
    assert np.abs(ref).max() > 0.1
    # float32 sums of K products in another order: a few ulps of the sum of magnitudes.
    bound = 1e-6 * (np.abs(np.asarray(a, np.float64)) @ np.abs(dequantize_ref(q)).T) + 1e-6
    assert out.shape == ref.shape and np.all(np.abs(out - ref) <= bound), \
        np.max(np.abs(out - ref) / bound)


def test_leading_axes_and_epilogue():
    q = _weight(*LAYOUTS["q4_1-gate-up"])
    gen = np.random.default_rng(2)
    a = jnp.asarray(gen.normal(0, 1, (2, 3, 576)), jnp.float32)
    c = jnp.asarray(gen.normal(0, 1, (2, 3, 3072)), jnp.float32)
    out = _product(a, q, alpha=0.5, beta=2.0, c=c, out_dtype=jnp.float32)
    ref = (0.5 * (np.asarray(a, np.float64) @ dequantize_ref(q).T)
           + 2.0 * np.asarray(c, np.float64))
    assert out.shape == (2, 3, 3072) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)


def test_vmap_runs_each_weight():
    qs = [_weight(*LAYOUTS["q8_0-qkv"], seed=s) for s in (3, 4)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *qs)
    a = jnp.asarray(np.random.default_rng(5).normal(0, 1, (2, 1, 576)), jnp.float32)
    out = jax.vmap(lambda a, q: fj.matmul(a, q, trans_b=True, implementation="cpu_kernel"))(
        a, stacked)
    for i, q in enumerate(qs):
        ref = np.asarray(a[i], np.float64) @ dequantize_ref(q).T
        np.testing.assert_allclose(np.asarray(out[i]), ref, rtol=1e-5, atol=1e-4)


def test_auto_picks_it_for_decode_rows_only():
    q = _weight(*LAYOUTS["q4_1-gate-up"])
    for m, want in ((1, "cpu_kernel"), (cpu.MAX_ROWS, "cpu_kernel"),
                    (cpu.MAX_ROWS + 1, "xla")):
        a = jnp.zeros((m, 576), jnp.float32)
        assert fj.explain("quantized_matmul", a, q, trans_b=True).implementation == want, m


@pytest.mark.parametrize("change, reason", [
    (dict(platform="gpu"), "a CPU kernel"),
    (dict(fmt="fp8"), "only int4 and int8"),
    (dict(fmt="int8", activations="int8"), "weight-only"),
    (dict(trans_b=False), "trans_b=True"),
    (dict(group=16), "multiple of 32"),
    (dict(rows=cpu.MAX_ROWS + 1), "XLA is faster"),
    (dict(dtype=jnp.bfloat16), "float32 activations"),
    (dict(spec=("model", None)), "split over a mesh"),
])
def test_supports_names_what_it_refuses(change, reason):
    fmt = change.get("fmt", "int4")
    w = jnp.asarray(np.random.default_rng(6).normal(0, 0.05, (64, 128)), jnp.float32)
    group = None if fmt == "fp8" or "activations" in change else change.get("group", 32)
    q = fj.quantize(w, fmt, group_size=group,
                    activations=change.get("activations"))
    if "spec" in change:
        q = fj.QuantizedArray(q.values, q.scales, q.minimums, q.format, q.block,
                              spec=change["spec"])
    a = jnp.zeros((change.get("rows", 1), 128), change.get("dtype", jnp.float32))
    args = dict(a=a, b=q, trans_b=change.get("trans_b", True))
    got = cpu.supports(args, change.get("platform", "cpu"))
    assert got is not None and reason in got, got


def test_unbuildable_is_a_reason_and_xla_serves(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    reason = cpu._load.__wrapped__()
    assert "no C++ compiler" in reason
    monkeypatch.setenv(cpu._ENV, "0")
    assert "turned off" in cpu._load.__wrapped__()
    monkeypatch.setattr(cpu, "_load", lambda: "no C++ compiler found")
    q = _weight(*LAYOUTS["q4_1-gate-up"])
    a = jnp.asarray(np.random.default_rng(7).normal(0, 1, (1, 576)), jnp.float32)
    selection = fj.explain("quantized_matmul", a, q, trans_b=True)
    assert selection.implementation == "xla"
    assert "no C++ compiler" in selection.rejected["cpu_kernel"]
    info = {(i.op, i.name): i for i in fj.backends.summary().implementations}
    assert info["quantized_matmul", "cpu_kernel"].reason == "no C++ compiler found"


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_each_instruction_set_matches_float64(isa):
    """The AVX2 and the portable code, built on this machine whatever it has, pass the
    float64 comparison above (in a fresh process: a process loads one build)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, FORGE_JAX_CPU_KERNELS=isa)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         f"{__file__}::test_matches_float64"], cwd=root, env=env, capture_output=True,
        text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
