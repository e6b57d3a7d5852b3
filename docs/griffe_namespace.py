"""A Griffe extension for the API reference (mkdocs.yml): the repository keeps ``models/`` and
``pallas_kernels/`` beside ``forge_jax/`` and installs them as ``forge_jax.models`` and
``forge_jax.pallas_kernels`` (pyproject's package-dir). Griffe reads packages from their
folders, so it would not find those two inside ``forge_jax``; this loads them there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

# Installed name inside forge_jax -> the repository folder that holds it.
FOLDERS = {"models": "models", "pallas_kernels": "pallas_kernels"}


class ForgeJaxNamespace(griffe.Extension):
    """Loads ``models/`` and ``pallas_kernels/`` as submodules of the ``forge_jax`` package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        if pkg.path != "forge_jax" or pkg.filepath is None:
            return
        root = Path(pkg.filepath).resolve().parent.parent
        for name, folder in FOLDERS.items():
            init = root / folder / "__init__.py"
            if name in pkg.members or not init.is_file():
                continue
            # Loaded from its folder (as a top-level package named after it), then set as a
            # member of forge_jax, which makes its path forge_jax.<name>.
            module = loader.load(init.parent, submodules=True)
            pkg.set_member(name, module)
