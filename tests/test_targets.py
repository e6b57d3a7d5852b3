"""forge_jax.targets: a named target makes dispatch, supports(), the kernels' tuning tables,
the autotune cache's key and explain answer as on that device (nothing compiled here: the
compile tests are tests/test_aot.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import forge_jax as fj
from forge_jax import autotune_cache, backends
from forge_jax.pallas_kernels.gpu import _common as gpu_common
from forge_jax.pallas_kernels.gpu import attention as gpu_attention
from forge_jax.pallas_kernels.tpu import _common as tpu_common
from forge_jax.pallas_kernels.tpu import attention as tpu_attention

S = jax.ShapeDtypeStruct


def _q(dtype=jnp.bfloat16, head_dim=128):
    return S((1, 64, 8, head_dim), dtype)


def test_outside_a_target_the_process_devices_answer():
    assert fj.targets.current() is None
    assert fj.targets.platform() == jax.default_backend() == "cpu"
    assert fj.targets.compute_capability() is None
    assert gpu_common.device_kind() is None and tpu_common.device_kind() is None


@pytest.mark.parametrize("name", sorted(fj.targets.TARGETS))
def test_a_target_answers_as_its_device(name):
    t = fj.targets.get(name)
    with fj.targets.use(name) as used:
        assert used is t and fj.targets.current() is t
        assert fj.targets.platform() == t.platform
        assert backends.has_platform(t.platform)
        assert not backends.has_platform("cpu")
        assert autotune_cache.device_kind(t.platform) == t.device_kind
        if t.platform == "gpu":
            assert backends.gpu_compute_capability() == t.compute_capability
            assert gpu_common.device_kind() == t.device_kind
            assert gpu_common.gpu_reason("gpu") is None
        else:
            assert fj.targets.compute_capability() is None
            assert tpu_common.device_kind() == t.device_kind
            assert tpu_common.tpu_available() is None
    assert fj.targets.current() is None


def test_the_tuning_tables_use_the_targets_rows():
    q = _q()
    with fj.targets.use("h100"):
        got = gpu_attention.default_config({"q": q}, gpu_common.device_kind())
    assert got == gpu_attention.Config(**gpu_attention.TUNED["H100"][128])
    with fj.targets.use("l4"):
        got = gpu_attention.default_config({"q": q}, gpu_common.device_kind())
    assert got == gpu_attention.Config(**gpu_attention.TUNED["L4"][128])
    with fj.targets.use("tpu-v6e"):
        got = tpu_attention.default_config({}, tpu_common.device_kind())
    assert got == tpu_attention.Config(**tpu_common.tuned(tpu_attention.TUNED, "TPU v6 lite"))


def test_explain_answers_as_on_the_target():
    x, w = S((4, 256), jnp.bfloat16), S((256,), jnp.bfloat16)
    with fj.targets.use("h100"):
        gpu = fj.explain("rms_norm", x, w, eps=1e-5, implementation="pallas")
    with fj.targets.use("tpu-v5e"):
        tpu = fj.explain("rms_norm", x, w, eps=1e-5, implementation="pallas")
    assert (gpu.platform, gpu.implementation) == ("gpu", "pallas")
    assert (tpu.platform, tpu.implementation) == ("tpu", "pallas")
    with pytest.raises(fj.ImplementationError, match="serves .*gpu.*tpu.*, not cpu"):
        fj.explain("rms_norm", x, w, eps=1e-5, implementation="pallas")


def test_supports_reads_the_targets_compute_capability():
    # cuDNN attention needs Ampere: served on an A100 target, refused with the reason off one.
    q = _q()
    with fj.targets.use("a100"):
        assert fj.explain("attention", q, q, q, implementation="cudnn").implementation == "cudnn"


def test_gpu_target_config_carries_the_devices_figures():
    text = fj.targets.gpu_target_config("h100")
    for field in ("core_count: 132", "shared_memory_per_block_optin: 232448",
                  "major: 9 minor: 0", 'device_description_str: "NVIDIA H100 80GB HBM3"',
                  'platform_name: "CUDA"'):
        assert field in text, field
    assert "major: 8 minor: 9" in fj.targets.gpu_target_config("l4")


def test_bad_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown target 'h10'.*h100"):
        fj.targets.get("h10")
    with pytest.raises(ValueError, match="'tpu-v5e' is a tpu target"):
        fj.targets.gpu_target_config("tpu-v5e")


def test_a_missing_extra_is_named_with_its_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "libtpu", "jax_plugins.xla_cuda12") else real(name, *a))
    assert "libtpu" in fj.targets.missing("tpu-v5e")
    assert "CUDA plugin" in fj.targets.missing("h100")
    assert "[aot]" in fj.targets.missing("h100")
    # The devices are built once per process: an earlier test may have built v6e's (the
    # extra is installed), so the check is asked of the uncached builder.
    with pytest.raises(RuntimeError, match="cannot compile for tpu-v6e: libtpu"):
        fj.targets._devices.__wrapped__("tpu-v6e")
