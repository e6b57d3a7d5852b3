"""The installed package claims one top-level name, ``forge_jax``.

The repository keeps ``forge_jax/``, ``models/`` and ``pallas_kernels/`` at the top; they
install as ``forge_jax``, ``forge_jax.models`` and ``forge_jax.pallas_kernels``. A user's own
``models`` package (a Django app, a research repo) must neither shadow ours nor be shadowed.

The wheel test builds the wheel, installs it (without dependencies) into a fresh virtual
environment whose only other path is this environment's dependencies (added as a plain path,
so this environment's editable install of forge_jax is *not* visible there), and runs
``forge-jax generate`` and an import of every public module from a directory that has its own
``models/__init__.py``. The editable install (this environment) passes the same checks.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_MODULES = [
    "forge_jax", "forge_jax.ops", "forge_jax.dispatch", "forge_jax.backends",
    "forge_jax.kv_cache", "forge_jax.memory", "forge_jax.tolerances", "forge_jax.cli",
    "forge_jax.models", "forge_jax.models.llama", "forge_jax.generation.sampling",
    "forge_jax.models.tiny.task", "forge_jax.pallas_kernels", "forge_jax.pallas_kernels.gpu",
    "forge_jax.pallas_kernels.tpu",
]
# Run from a user's project that has its own `models` and `pallas_kernels` packages: the
# user's must win for the bare names, ours must load under forge_jax, and ours must never be
# imported under a bare name (a module imported twice registers its kernels twice).
CHECK = f"""
import sys, importlib
import models, pallas_kernels
assert models.OWNER == "user" and pallas_kernels.OWNER == "user", "user package shadowed"
for name in {PUBLIC_MODULES!r}:
    importlib.import_module(name)
import forge_jax as fj, forge_jax.models.llama as llama
assert not hasattr(sys.modules["models"], "llama")
assert "models.llama" not in sys.modules and "pallas_kernels.gpu" not in sys.modules
assert fj.dispatch.names()
print("IMPORTS OK", llama.__file__)
"""


def _user_project(tmp_path: pathlib.Path) -> pathlib.Path:
    project = tmp_path / "user_project"
    for name in ("models", "pallas_kernels"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text('OWNER = "user"\n')
    return project


def _run(cmd, cwd, env=None):
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _generate_ok(out: str) -> None:
    assert "accuracy:" in out and "exact match" in out, out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: setuptools comes from the test extra, so no index is needed.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(out), str(ROOT)], cwd=out)
    (whl,) = out.glob("forge_jax-*.whl")
    return whl


def test_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"forge_jax"}, top
    for path in ("forge_jax/models/llama.py", "forge_jax/models/tiny/model.safetensors",
                 "forge_jax/models/tiny/tokenizer.json", "forge_jax/pallas_kernels/gpu/__init__.py",
                 "forge_jax/pallas_kernels/tpu/__init__.py", "forge_jax/ops/attention.py"):
        assert path in names, path


def test_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   cwd=tmp_path).strip()
    # This environment's dependencies (jax, flax, ...) as a plain path entry: .pth files there
    # (the editable install's finder) are not processed, so only the wheel provides forge_jax.
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    pathlib.Path(purelib, "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=tmp_path)
    project = _user_project(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = _run([str(python), "-c", CHECK], cwd=project, env=env)
    assert "IMPORTS OK" in out and str(venv) in out, out  # loaded from the wheel, not the repo
    _generate_ok(_run([str(bindir / "forge-jax"), "generate", "--num-problems", "16",
                       "--show", "1"], cwd=project, env=env))


def test_editable_install_from_a_user_project(tmp_path):
    project = _user_project(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run([sys.executable, "-c", CHECK], cwd=project, env=env)
    assert "IMPORTS OK" in out
    script = pathlib.Path(sys.executable).parent / "forge-jax"
    _generate_ok(_run([str(script), "generate", "--num-problems", "16", "--show", "1"],
                      cwd=project, env=env))


def test_nothing_imports_the_bare_names():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ".git" in path.parts or "build" in path.parts or path.name == "test_install.py":
            continue  # (this file imports the *user's* bare packages on purpose)
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("import models", "from models", "import pallas_kernels",
                                    "from pallas_kernels")):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {stripped}")
    assert not offenders, offenders


def test_pinned_jax_versions_match_the_readme():
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {d.split(">")[0].split("=")[0].strip(): d for d in deps}
    assert pins["jax"] == "jax>=0.10,<0.13" and pins["jaxlib"] == "jaxlib>=0.10,<0.13", pins
    readme = (ROOT / "README.md").read_text()
    assert "JAX 0.10, 0.11 and 0.12 are the supported releases" in readme
    assert "`jax>=0.10,<0.13`" in readme
    compat = (ROOT / "forge_jax" / "_compat.py").read_text()
    assert re.search(r"JAX 0\.10 .*0\.11 and 0\.12", compat), \
        "the shim module names other releases"
