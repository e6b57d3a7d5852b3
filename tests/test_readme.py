"""The README's self-contained examples run as written.

A block that starts with ``import`` is a complete program; other blocks are fragments
(they name the user's own model or checkpoint directory) and are not run.
"""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _examples():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if b.lstrip().startswith("import ")]


def test_readme_has_examples():
    assert len(_examples()) >= 2


@pytest.mark.parametrize("index", range(len(_examples())))
def test_readme_example_runs(index, capsys):
    namespace = {"__name__": f"readme_example_{index}"}
    exec(compile(_examples()[index], f"README.md example {index}", "exec"), namespace)
    if "manager" in namespace:  # The paged decode loop: everything freed at the end.
        usage = namespace["manager"].usage()
        assert usage.used_pages == 0 and usage.free_pages == usage.total_pages
        assert namespace["out"].shape == (1, 8, 64)
    if "o1" in namespace:  # The op tour: the decode query's output has one row per sequence.
        assert namespace["o1"].shape == (2, 1, 8, 64)
