"""Test harness set-up. Runs before JAX initialises its backends.

* 8 CPU devices, so that pmap / sharding variants and the sharded-inference meshes
  (tp=8, dp=2 x tp=4, dp=8) run on a laptop or CI machine.
* The autotune and compilation caches off (see below).
* Strict dtype promotion: an op that mixes float32 and bfloat16 without saying
  so is a bug (silent upcasts double memory traffic), so tests make it an error.
* Two markers keep the default run (pyproject's ``-m "not slow and not target"``) to about a
  quarter of an hour on 2 cores; CI's extras leg runs them (``-m "slow or target"``):
  ``target("h100")``, a deviceless compile for a named target (the ``aot`` extra's
  compilers; skipped, naming the install command, where they are missing), and ``slow``,
  the kernels' interpreter classes (``*Interpret``: each kernel's compiled class runs on
  its hardware) and the files listed in ``SLOW_FILES``. ``-m ""`` runs everything.
"""

import gc
import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.pop("FORGE_JAX_IMPLEMENTATION", None)
# The user's caches stay out of the tests (and the tests out of them): no autotuned winners
# steer auto selection, no compilation cache is written to ~/.cache. Tests of the caches
# point these at temporary directories themselves.
os.environ["FORGE_JAX_AUTOTUNE_CACHE"] = "off"
os.environ["FORGE_JAX_COMPILATION_CACHE"] = "off"
# On a machine without an accelerator, JAX's backends stay on the CPU: with the aot extra
# installed (the CUDA plugin, libtpu; forge_jax.targets compiles for their devices without
# them), JAX would otherwise try to start both and print their failures.
if not any(next(pathlib.Path("/dev").glob(p), None)
           for p in ("nvidia[0-9]*", "accel[0-9]*", "vfio")):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # No TPU to share: the test processes (pytest-xdist) may each load libtpu for the
    # deviceless TPU compiles, which its lock file would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # XLA:CPU's LLVM backend at optimization level 0: the suite mostly compiles small
    # programs and runs them once (the kernels' interpreters too), and level 0 compiles
    # faster; the results are the same IEEE arithmetic (XLA:CPU enables no fast math). Runs
    # 10-26% faster on the files measured. A named target's compile (fj.aot.compile)
    # keeps the device's own level. Set the flag in XLA_FLAGS to choose another.
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
if os.environ.get("JAX_PLATFORMS"):  # also when a pytest plugin imported JAX before us
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

import hypothesis  # noqa: E402
import pytest  # noqa: E402

hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's caches of compiled programs after each test file. Each XLA:CPU executable
    holds memory mappings: the whole suite in one process compiles thousands of programs,
    and past the kernel's limit of 65530 mappings (vm.max_map_count) a later compile
    segfaults (CI's full suite did, in a serving step's compile at ~90%)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A small Llama checkpoint with a trained BPE tokenizer and a chat template
    (tests/cases/chat_checkpoint.py), written once for every text and chat test."""
    from cases.chat_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("chat_ckpt"))


@pytest.fixture(scope="session")
def chat_model(chat_checkpoint):
    from forge_jax.models import llama

    return llama.from_pretrained(chat_checkpoint)


@pytest.fixture(scope="session")
def chat_tokenizer(chat_checkpoint):
    from forge_jax.text import api as text

    return text.load_tokenizer(chat_checkpoint)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails a command-line test if the weights are loaded, problems drawn or the demo's
    ops run: a refused input must be refused before any of that work."""
    from forge_jax import demo
    from forge_jax.models import llama
    from forge_jax.models.tiny import task as tasks

    def refuse(*args, **kwargs):
        raise AssertionError("did the work before refusing the input")

    monkeypatch.setattr(llama, "from_pretrained", refuse)
    monkeypatch.setattr(tasks.AdditionTask, "sample", refuse)
    monkeypatch.setattr(demo, "run", refuse)


@pytest.fixture(scope="session")
def hf():
    """(torch, transformers), or the test skips: the parity tests against transformers."""
    torch = pytest.importorskip("torch", reason="parity tests need torch (pip install .[parity])")
    transformers = pytest.importorskip(
        "transformers", reason="parity tests need transformers (pip install .[parity])")
    return torch, transformers


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory):
    """(directory, vocab size) of a byte-level BPE tokenizer with a chat template, which the
    family checkpoints (tests/cases/hf_families.py) share: their vocab is its size."""
    from cases.hf_families import write_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    return directory, write_tokenizer(directory)


# Whole files of the slow kind: scripts and installs run in subprocesses, notebooks executed.
SLOW_FILES = {"test_benchmarks.py", "test_benchmark_gpu_script.py", "test_install.py",
              "test_notebooks.py"}


def pytest_collection_modifyitems(config, items):
    import forge_jax as fj

    missing = {}
    for item in items:
        if item.path.name in SLOW_FILES or (item.cls is not None
                                            and item.cls.__name__.endswith("Interpret")):
            item.add_marker(pytest.mark.slow)
        for mark in item.iter_markers("target"):
            (name,) = mark.args
            if name not in missing:
                missing[name] = fj.targets.missing(name)
            if missing[name] is not None:
                item.add_marker(pytest.mark.skip(reason=missing[name]))
