"""flax, as it is imported, asks whether it runs in an IPython shell (to colour its reprs)
by importing IPython whole: 1.4 s of every command's start where IPython is installed (it
is wherever Jupyter is). No shell can be running unless IPython was imported already, so
while it is not, flax is imported with IPython marked absent and gets the same answer;
IPython imports as usual afterwards. Imported first by :mod:`forge_jax.cli`."""

from __future__ import annotations

import sys


def import_flax() -> None:
    if "flax" in sys.modules or "IPython" in sys.modules:
        return
    sys.modules["IPython"] = None  # `import IPython` raises ImportError meanwhile
    try:
        import flax.nnx  # noqa: F401
    finally:
        if sys.modules.get("IPython", 0) is None:
            del sys.modules["IPython"]


import_flax()
