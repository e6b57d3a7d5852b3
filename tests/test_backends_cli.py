"""Backend discovery (``fj.backends.summary()``) and the ``forge-jax info`` / ``demo`` commands."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re

import jax
import pytest

import forge_jax as fj
from forge_jax import backends, cli, dispatch, registry

CORE_OPS = ("matmul", "rms_norm", "silu_mul", "softmax", "rope", "attention", "embedding")


@pytest.fixture
def registered():
    """``registered(op, name, **register_kw)`` adds a throwaway implementation, removed after."""
    added = []

    def add(op, name, **kw):
        dispatch.register(op, name, **kw)(lambda **args: None)
        added.append((op, name))

    yield add
    for op, name in added:
        dispatch.unregister(op, name)


def test_summary_structure():
    s = backends.summary()
    assert isinstance(s, backends.Summary)
    assert s.jax_version == jax.__version__ and s.jaxlib_version
    assert s.default_backend == jax.default_backend()
    assert [p.name for p in s.platforms] == ["cpu", "gpu", "tpu"]
    platforms = {p.name: p for p in s.platforms}
    cpu = platforms["cpu"]
    assert len(cpu.devices) == 8 and cpu.error is None  # conftest's 8 CPU devices
    for d in cpu.devices:
        assert isinstance(d, backends.DeviceInfo)
        assert d.platform == "cpu" and isinstance(d.device_kind, str) and d.device_kind
        assert d.compute_capability is None
    assert [d.id for d in cpu.devices] == [d.id for d in jax.devices("cpu")]
    for name in ("gpu", "tpu"):  # what JAX sees; when absent, JAX's reason
        p = platforms[name]
        if backends.has_platform(name):
            assert len(p.devices) == len(jax.devices(name)) and p.error is None
        else:
            assert p.devices == () and p.error
    assert set(s.devices()) >= set(cpu.devices)
    toolchains = {t.name: t for t in s.toolchains}
    assert toolchains["Pallas interpret mode (any platform)"].available
    if not backends.has_platform("tpu"):
        assert not toolchains["Pallas Mosaic TPU"].available
        assert toolchains["Pallas Mosaic TPU"].reason == "no TPU device"
    triton = toolchains["jax-triton"]
    assert triton.available or "jax-triton" in triton.reason
    cudnn = toolchains["cuDNN flash attention (Ampere+)"]
    if backends.gpu_compute_capability() is None:
        assert not cudnn.available and cudnn.reason == "no GPU device"
    impls = {(i.op, i.name): i for i in s.implementations}
    for op in CORE_OPS:
        info = impls[(op, "xla")]
        assert info.available and info.reason is None
        assert set(info.auto_on) == {"cpu", "gpu", "tpu"} and info.description
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.default_backend = "gpu"


def test_summary_reports_unavailable_and_by_name_only_implementations(registered):
    registered("rms_norm", "test_gpu_only", priority={"gpu": 5},
               available=lambda: "jax-triton not importable: needs a GPU jaxlib")
    registered("rms_norm", "test_by_name", description="interpret mode")

    def broken():
        raise RuntimeError("probe exploded")

    registered("softmax", "test_broken", priority={"cpu": -1}, available=broken)
    s = backends.summary()
    impls = {(i.op, i.name): i for i in s.implementations}
    gpu_only = impls[("rms_norm", "test_gpu_only")]
    assert not gpu_only.available and "needs a GPU jaxlib" in gpu_only.reason
    assert gpu_only.auto_on == ("gpu",)
    assert impls[("rms_norm", "test_by_name")].auto_on == ()
    broken_info = impls[("softmax", "test_broken")]
    assert not broken_info.available and "probe exploded" in broken_info.reason
    text = str(s)
    assert ("rms_norm: test_gpu_only -> unavailable: jax-triton not importable: needs a GPU "
            "jaxlib [auto on gpu]") in text
    assert "rms_norm: test_by_name -> available [by name only]" in text
    assert "availability check failed: probe exploded" in text


def test_summary_text():
    text = str(backends.summary())
    assert text.startswith(f"forge_jax on JAX {jax.__version__} (jaxlib ")
    assert f"default backend: {jax.default_backend()}" in text
    assert "  cpu: 8 device(s)" in text
    for name in ("gpu", "tpu"):
        if not backends.has_platform(name):
            assert re.search(rf"^  {name}: none \(.+\)$", text, re.M)
    for header in ("Platforms:", "Toolchains:", "Implementations (op: name -> status):"):
        assert header in text
    for op in CORE_OPS:
        assert f"  {op}: xla -> available [auto on cpu, gpu, tpu]" in text
    assert "jax-triton: " in text


def test_device_memory_and_compute_capability():
    class FakeGpu:
        id, platform, device_kind, compute_capability = 0, "gpu", "NVIDIA H100", "9.0"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 20 * 2**30}

    class NoStats:
        id, platform, device_kind = 1, "cpu", "cpu"

        def memory_stats(self):
            raise NotImplementedError

    info = backends._device_info(FakeGpu())
    assert (info.memory_total_bytes, info.memory_free_bytes) == (80 * 2**30, 60 * 2**30)
    assert info.compute_capability == "9.0"
    bare = backends._device_info(NoStats())
    assert bare.memory_total_bytes is None and bare.compute_capability is None
    s = backends.Summary("0.x", "0.x", "gpu", (backends.PlatformInfo("gpu", (info,), None),),
                         (), ())
    assert ("[0] NVIDIA H100 (memory 80.0 GiB total, 60.0 GiB free, compute capability 9.0)"
            in str(s))
    assert fj.backends is backends


def test_cli_info(capsys):
    assert cli.main(["info"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("forge_jax on JAX ")
    assert "  cpu: 8 device(s)" in out and "attention: xla -> available" in out


DEMO_OPS = ("matmul", "quantized_matmul", "rms_norm", "silu_mul", "softmax", "rope", "attention",
            "embedding", "paged_attention")


def test_cli_demo_gives_a_verdict_per_op(capsys):
    assert cli.main(["demo", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for op in DEMO_OPS:
        assert re.search(rf"^  {op}\s+(?:xla|cpu_kernel)\s+max \|err\| \S+\s+"
                         rf"\(\s*[\d.]+% of tolerance\)\s+PASS$", out, re.M), out
    n = len(registry.ops())
    assert f"{n}/{n} ops within tolerance" in out


def test_cli_demo_fails_on_a_wrong_implementation(capsys):
    def wrong(gate, up):
        return (jax.nn.silu(gate) * up * 1.01).astype(gate.dtype)

    dispatch.register("silu_mul", "wrong", priority={jax.default_backend(): 100})(wrong)
    try:
        assert cli.main(["demo", "--seed", "2"]) == 1
    finally:
        dispatch.unregister("silu_mul", "wrong")
    out = capsys.readouterr().out
    assert re.search(r"^  silu_mul\s+wrong .* FAIL$", out, re.M), out
    n = len(registry.ops())
    assert f"{n - 1}/{n} ops within tolerance; FAILED: silu_mul" in out


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage: forge-jax" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0


def test_console_script_is_installed():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert scripts["forge-jax"].value == "forge_jax.cli:main"


def test_info_says_which_kernel_path_serves_which_gpu():
    text = str(backends.summary())
    assert "GPU kernel paths:" in text
    hopper, ampere, blackwell = backends.gpu_paths()[:3]
    assert "Mosaic GPU" in hopper and "attention" in hopper
    assert "Triton" in ampere and "rms_norm" in ampere
    assert "tcgen05" in blackwell and "paged_attention decode" in blackwell
    with fj.targets.use("h100"):
        assert backends.gpu_paths()[-1].endswith("the Mosaic GPU and Triton path")
    with fj.targets.use("a100"):
        assert backends.gpu_paths()[-1] == "this GPU (compute capability 8.0): the Triton path"
    with fj.targets.use("b200"):  # the tcgen05 kernels; Hopper's WGMMA does not compile
        assert backends.gpu_paths()[-1].endswith("the Mosaic GPU and Triton path")

