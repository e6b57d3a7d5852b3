# Install forge_jax (Colab, or a Jupyter without it) with the JAX build for this runtime:
# jax[cuda12] and jax-triton on a GPU, jax[tpu] on a TPU. forge-jax is not on PyPI: it comes
# from FORGE_JAX_SOURCE when set (a wheel, a checkout's directory, or a git URL), else from
# REPO_URL. Where forge_jax is already importable (a local checkout, CI) nothing is installed.
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

REPO_URL = "https://github.com/OWNER/forge_jax"  # pyproject.toml's [project.urls] Repository
SOURCE = os.environ.get("FORGE_JAX_SOURCE") or REPO_URL


def detect_accelerator() -> str:
    """"tpu", "gpu" or "cpu", from the runtime's environment (before JAX is imported)."""
    if (os.environ.get("COLAB_TPU_ADDR") or os.environ.get("TPU_ACCELERATOR_TYPE")
            or pathlib.Path("/dev/accel0").exists() or pathlib.Path("/dev/vfio/0").exists()):
        return "tpu"
    if shutil.which("nvidia-smi") and subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        return "gpu"
    return "cpu"


def install_target(source: str, checkout: pathlib.Path) -> pathlib.Path:
    """What pip installs: a wheel or a checkout as given; a git URL cloned to ``checkout``."""
    path = pathlib.Path(source).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".whl"):
        return path.resolve()
    if "/OWNER/" in source:
        raise RuntimeError("REPO_URL names no repository yet (OWNER): set it to forge_jax's "
                           "repository, or set FORGE_JAX_SOURCE to a wheel, a checkout or a "
                           "git URL")
    if not checkout.exists():
        subprocess.run(["git", "clone", "--depth", "1", source, str(checkout)], check=True)
    return checkout


# A checkout also holds benchmarks/ (the timing helpers kernel_benchmarks.ipynb reuses).
CHECKOUT = pathlib.Path("/content/forge_jax" if pathlib.Path("/content").is_dir()
                        else pathlib.Path.home() / "forge_jax")
if importlib.util.find_spec("forge_jax") is not None:
    print("forge_jax is already installed: nothing to install")
else:
    accelerator = detect_accelerator()
    target = install_target(SOURCE, CHECKOUT)
    if target.is_dir():
        CHECKOUT = target
    # pip leaves an installed JAX alone when it already satisfies forge_jax's pin
    # (jax>=0.10,<0.12) and the accelerator's plugin is there.
    packages = {"gpu": [f"{target}[gpu]"],  # jax[cuda12] and jax-triton
                "tpu": [str(target), "jax[tpu]>=0.10,<0.12"],
                "cpu": [str(target)]}[accelerator]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages], check=True)
    print(f"installed forge_jax from {target} for a {accelerator} runtime")
    if "jax" in sys.modules:  # this process holds the JAX it imported before the install
        print("JAX was imported before this cell: restart the session "
              "(Runtime > Restart session), then run all")
