"""Install hints that work: forge-jax is not on PyPI, so no hint says
``pip install 'forge-jax[gpu]'``; the repository's address is one setting
(``[project.urls] Repository`` in pyproject.toml) that the notebooks' Colab badges and
install cells agree with; and the install cell installs from a wheel, a checkout or a URL."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tomllib

import pytest

from forge_jax import _compat, _install, cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ("quickstart.ipynb", "kernel_benchmarks.ipynb", "paged_serving.ipynb")


def _sync_script():
    spec = importlib.util.spec_from_file_location(
        "sync_notebooks", ROOT / "notebooks" / "sync_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setting() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def test_info_hints_at_an_install_that_exists(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "pip install 'forge-jax[" not in out, out
    if _compat.jax_triton_version() is None:  # no jax-triton here: the hint is shown
        hint = _install.pip_install("gpu")
        assert f"jax-triton not installed ({hint})" in out, out
    assert f"install the matching release ({_install.pip_install('gpu')})" in \
        _compat.jax_triton_reason("0.3.0", "0.11.0")


def test_pip_install_hint_names_the_checkout_or_the_repository(monkeypatch):
    # This test runs from a checkout (an editable install): the hint installs that checkout.
    assert _install.checkout() == ROOT
    assert _install.pip_install("gpu") == f"pip install -e '{ROOT}[gpu]'"
    assert _install.repository_url() == _setting()
    # From a wheel: the repository, once its address is set; a checkout until then.
    monkeypatch.setattr(_install, "checkout", lambda: None)
    monkeypatch.setattr(_install, "repository_url", lambda: "https://github.com/someone/forge_jax")
    assert _install.pip_install("gpu") == (
        "pip install 'forge-jax[gpu] @ git+https://github.com/someone/forge_jax'")
    monkeypatch.setattr(_install, "repository_url", lambda: "https://github.com/OWNER/forge_jax")
    assert _install.pip_install("test") == (
        "pip install -e '.[test]' in a checkout of the forge_jax repository; forge-jax is not "
        "on PyPI")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_agree_with_the_repository_setting(name):
    nbformat = pytest.importorskip("nbformat")
    sync = _sync_script()
    assert sync.repository_url() == _setting()
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert sync.colab_url(_setting(), name) in nb.cells[0].source
    assert not sync.sync(nb, name, _setting()), (
        f"{name} differs from pyproject.toml's Repository or notebooks/install_cell.py: run "
        f"python notebooks/sync_notebooks.py")


def test_colab_url_from_the_setting():
    sync = _sync_script()
    assert sync.colab_url("https://github.com/someone/forge_jax.git", "quickstart.ipynb") == (
        "https://colab.research.google.com/github/someone/forge_jax/blob/main/notebooks/"
        "quickstart.ipynb")
    with pytest.raises(ValueError, match="GitHub"):
        sync.colab_url("https://gitlab.com/someone/forge_jax", "quickstart.ipynb")


def run_install_cell(monkeypatch, tmp_path, *, source=None, repository, gpu=False):
    """Runs the install cell as a runtime without forge_jax would; returns the commands it
    ran and the names it left (CHECKOUT)."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 0, b"", b"")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "forge_jax" else real_find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/nvidia-smi" if gpu else None)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("COLAB_TPU_ADDR", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    if source is None:
        monkeypatch.delenv("FORGE_JAX_SOURCE", raising=False)
    else:
        monkeypatch.setenv("FORGE_JAX_SOURCE", str(source))
    namespace = {"__name__": "__main__"}
    exec(compile(_sync_script().install_cell(repository), "install_cell", "exec"), namespace)
    return [c for c in calls if c[0] != "nvidia-smi"], namespace


def test_install_cell_from_a_wheel_a_checkout_or_a_url(monkeypatch, tmp_path):
    if pathlib.Path("/content").is_dir() or pathlib.Path("/dev/accel0").exists():
        pytest.skip("a Colab or TPU machine: the cell's paths and accelerator differ")
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    url = "https://github.com/someone/forge_jax"
    wheel = tmp_path / "forge_jax-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    calls, _ = run_install_cell(monkeypatch, tmp_path, source=wheel, repository=url)
    assert calls == [pip + [str(wheel)]]
    calls, _ = run_install_cell(monkeypatch, tmp_path, source=wheel, repository=url, gpu=True)
    assert calls == [pip + [f"{wheel}[gpu]"]]

    checkout = tmp_path / "my_checkout"
    checkout.mkdir()
    calls, names = run_install_cell(monkeypatch, tmp_path, source=checkout, repository=url)
    assert calls == [pip + [str(checkout)]]
    assert names["CHECKOUT"] == checkout  # where kernel_benchmarks.ipynb finds benchmarks/

    clone = tmp_path / "home" / "forge_jax"
    for source in (None, "https://github.com/other/forge_jax"):
        calls, _ = run_install_cell(monkeypatch, tmp_path, source=source, repository=url)
        assert calls == [["git", "clone", "--depth", "1", source or url, str(clone)],
                         pip + [str(clone)]]

    with pytest.raises(RuntimeError, match="FORGE_JAX_SOURCE"):
        run_install_cell(monkeypatch, tmp_path, repository="https://github.com/OWNER/forge_jax")
