"""The notebooks run top to bottom on CPU, and the stored ones carry a real run's outputs.

Each notebook is executed from memory (the stored file is never rewritten) in a fresh
ipykernel on CPU, from a scratch directory, with its small CPU sizes; any cell error fails the
test. The stored files are checked for the outputs a reader sees without running them: every
code cell ran, none raised, the run names its device, and the plots are there as PNG images.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "kernel_benchmarks.ipynb", "paged_serving.ipynb")
WITH_PLOTS = ("kernel_benchmarks.ipynb", "paged_serving.ipynb")
COLAB = "https://colab.research.google.com/github/{owner}/forge_jax/blob/main/notebooks/{name}"


def _read(name):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _text(nb):
    return "".join(o.get("text", "") + "".join(
        v for k, v in o.get("data", {}).items() if k == "text/plain")
        for o in _outputs(nb))


def _kernel_env():
    """This environment, on CPU, without the test harness's 8 virtual CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env


def test_the_three_notebooks_are_here():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_has_the_outputs_of_a_run(name):
    nb = _read(name)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "Open In Colab" in first.source
    assert re.search(re.escape(COLAB.format(owner="OWNER", name=name)), first.source), (
        first.source)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), (
        f"{name}: some code cells were not run")
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{name}: not run top to bottom in one kernel")
    errors = [o for o in _outputs(nb) if o.output_type == "error"
              or (o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text)]
    assert not errors, f"{name}: error outputs stored: {errors}"
    # The run says which device produced it.
    assert re.search(r"This run: .+ \((cpu|gpu|tpu), \d+ device\(s\)\), JAX ", _text(nb)), name
    if name in WITH_PLOTS:
        assert any("image/png" in o.get("data", {}) for o in _outputs(nb)), (
            f"{name}: no plot stored")


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_holds_no_development_path_and_current_commands(name):
    text = (NOTEBOOKS / name).read_text()
    # A reader's clone is not the machine that ran it: no worktree or home path stored.
    assert not re.findall(r"/work/|/wt-\w+|/root/|/home/\w+", text), name
    # huggingface_hub 1.x ships `hf`; `huggingface-cli` is gone.
    assert "huggingface-cli" not in text, name


def test_notebooks_download_nothing_outside_the_install_cell():
    for name in NAMES:
        nb = _read(name)
        install = [c for c in nb.cells if "REPO_URL" in c.source]
        assert len(install) == 1 and "find_spec(\"forge_jax\")" in install[0].source, name
        for cell in nb.cells:
            if cell is install[0] or cell.cell_type != "code":
                continue
            source = cell.source
            assert not re.search(r"pip install|git clone|urlopen|requests\.get|hf_hub|"
                                 r"snapshot_download|^\s*!", source, re.M), (name, source)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_on_cpu(name, tmp_path, monkeypatch):
    # Jupyter's connection files and IPython's profile go to scratch, not the user's home.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter_runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = _read(name)
    stored = (NOTEBOOKS / name).read_bytes()
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_kernel_env())  # raises CellExecutionError on any cell error
    assert (NOTEBOOKS / name).read_bytes() == stored, "the stored notebook was rewritten"
    text = _text(nb)
    assert "This run: cpu (cpu, 1 device(s))" in text, text[:2000]
    assert "forge_jax is already installed: nothing to install" in text
    if name == "quickstart.ipynb":
        assert "accuracy: 100.0% exact match" in text
        assert "CHECKPOINT is empty: skipped" in text
    if name in WITH_PLOTS:
        assert any("image/png" in o.get("data", {}) for o in _outputs(nb))
    json.dumps(nb)  # the executed notebook is still plain JSON
