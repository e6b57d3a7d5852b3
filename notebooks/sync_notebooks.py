"""Writes the repository's address into the notebooks: each first cell's Colab badge, and
the install cell (``install_cell.py`` here, the same in every notebook). The address is set
in one place, ``[project.urls] Repository`` in ``pyproject.toml``; run this after changing
it or ``install_cell.py``, then ``run_notebooks.py`` to refresh the stored outputs.
``tests/test_install_hints.py`` checks that the notebooks agree with both.

Usage::

    python notebooks/sync_notebooks.py
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

HERE = pathlib.Path(__file__).resolve().parent
_BADGE = re.compile(r"https://colab\.research\.google\.com/github/[^)\s]*")
_REPO_URL = re.compile(r'^REPO_URL = "[^"]*"', re.M)


def repository_url() -> str:
    """``[project.urls] Repository`` of the repository's ``pyproject.toml``."""
    return tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["urls"][
        "Repository"]


def colab_url(repository: str, name: str) -> str:
    """Where Colab opens notebook ``name`` of a GitHub repository."""
    prefix = "https://github.com/"
    if not repository.startswith(prefix):
        raise ValueError(f"Colab opens notebooks from GitHub; the repository is {repository!r}")
    path = repository.removeprefix(prefix).rstrip("/").removesuffix(".git")
    return f"https://colab.research.google.com/github/{path}/blob/main/notebooks/{name}"


def install_cell(repository: str) -> str:
    """The install cell's code, with ``REPO_URL`` the repository's address."""
    code = (HERE / "install_cell.py").read_text()
    return _REPO_URL.sub(f'REPO_URL = "{repository}"', code, count=1).rstrip("\n")


def sync(nb, name: str, repository: str) -> bool:
    """Updates notebook ``nb`` (an nbformat node) in place; returns whether it changed."""
    first, cell = nb.cells[0], next(c for c in nb.cells if "REPO_URL" in c.source)
    badge = _BADGE.sub(colab_url(repository, name), first.source)
    code = install_cell(repository)
    changed = (badge, code) != (first.source, cell.source)
    first.source, cell.source = badge, code
    return changed


def main(argv: list[str]) -> int:
    import nbformat

    repository = repository_url()
    for path in [HERE / name for name in argv] or sorted(HERE.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if sync(nb, path.name, repository):
            nbformat.write(nb, path)
            print(f"{path.name}: synced with {repository}")
        else:
            print(f"{path.name}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
