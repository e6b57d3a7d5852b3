"""How to install forge_jax with an extra (``gpu``, ``test``, ...), for the hints the library
prints: forge-jax is not published on PyPI, so ``pip install 'forge-jax[gpu]'`` finds
nothing. A hint names the checkout this forge_jax runs from (an editable install), else the
repository, whose address is set in one place: ``[project.urls] Repository`` in
``pyproject.toml`` (read from the installed package's metadata, or from the checkout)."""

from __future__ import annotations

import functools
import importlib.metadata
import pathlib

PLACEHOLDER_OWNER = "OWNER"  # what pyproject.toml says until the repository's owner is set


def checkout() -> pathlib.Path | None:
    """The source checkout this forge_jax is imported from, or None (an installed wheel)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "models").is_dir() else None


@functools.cache
def repository_url() -> str | None:
    """``[project.urls] Repository``: from the installed metadata, else the checkout's
    ``pyproject.toml``; None if neither says."""
    try:
        for entry in importlib.metadata.metadata("forge-jax").get_all("Project-URL") or ():
            label, _, url = entry.partition(",")
            if label.strip().lower() == "repository" and url.strip():
                return url.strip()
    except importlib.metadata.PackageNotFoundError:
        pass
    root = checkout()
    if root is None:
        return None
    import tomllib

    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        return project["urls"]["Repository"]
    except (KeyError, OSError, tomllib.TOMLDecodeError):
        return None


def pip_install(extras: str) -> str:
    """The command that installs forge_jax with ``extras`` (e.g. ``"gpu"``) here."""
    root = checkout()
    if root is not None:
        return f"pip install -e '{root}[{extras}]'"
    url = repository_url()
    if url and f"/{PLACEHOLDER_OWNER}/" not in url:
        return f"pip install 'forge-jax[{extras}] @ git+{url}'"
    return (f"pip install -e '.[{extras}]' in a checkout of the forge_jax repository; "
            f"forge-jax is not on PyPI")
