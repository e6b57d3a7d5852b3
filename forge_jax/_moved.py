"""Modules that moved: the old path keeps working for one release and warns.

Each old module is a few lines that set its ``__getattr__`` to :func:`forward`, so that
``from forge_jax.models import text; text.generate_text(...)`` still runs, with a
``DeprecationWarning`` naming the new home. ``docs/architecture.md`` lists them.
"""

from __future__ import annotations

import importlib
import warnings


def forward(old: str, new: str):
    """A module ``__getattr__`` for ``old`` that hands out ``new``'s attributes, warning."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(f"{old} has moved to {new}: import {name} from there ({old} will be "
                      f"removed in the next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
