"""Executes the notebooks top to bottom and stores their outputs in place.

Run it after editing a notebook, so that the stored outputs (what a reader sees on GitHub
without running anything) come from a real run of the current code; the outputs say which
device produced them. ``tests/test_notebooks.py`` executes the same notebooks on CPU without
rewriting them.

Usage::

    python notebooks/run_notebooks.py                       # all of them
    python notebooks/run_notebooks.py paged_serving.ipynb   # some
"""

from __future__ import annotations

import pathlib
import sys
import time

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    paths = [HERE / name for name in argv] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, path)
        print(f"{path.name}: ran in {time.perf_counter() - start:.1f} s, outputs stored")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
