"""Every Python block of the README and of the guides in docs/ runs as written, top to bottom,
in a fresh interpreter; the docs' structure holds (the moved names they list still forward,
no dangling opt-outs, the site builds).

Each block is executed verbatim (never a fragment of it) in its own ``python`` process from a
scratch directory; a few blocks are followed by checks of what they computed. A block that
cannot run here (it needs a checkpoint, a GPU or the network) opts out with the line
``<!-- not run: REASON -->`` right above its fence; nothing else skips one. Old module paths
that warn (``DeprecationWarning``: "... has moved to ...") are errors inside a block, so the
docs show the new paths.
"""

import importlib
import json
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A fenced block: its info string and its body. Python blocks are spelled ```python only.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
PYTHON_SPELLINGS = {"python", "py", "python3", "pycon", "ipython"}
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->\n$")

# Run after the block, in the same interpreter, when the block has a line matching the key:
# checks on the names the block defined.
CHECKS = {
    r"y, h, o = block": """
assert o.shape == (2, 16, 8, 64) and o.dtype == jnp.bfloat16, (o.shape, o.dtype)
assert y.shape == h.shape == (2, 16, 512), (y.shape, h.shape)
""",
    r"tokens = generation\.generate": """
assert len(tokens) == 2 and all(1 <= len(t) <= 8 for t in tokens), tokens
""",
    r"manager = BlockManager": """
usage = manager.usage()
assert usage.used_pages == 0 and usage.free_pages == usage.total_pages, usage
assert out.shape == (1, 8, 64), out.shape
""",
    r"o1 = ": """
assert o1.shape == (2, 1, 8, 64), o1.shape
""",
    r"cu_q_lens = ": """
import numpy as np
assert out.shape == (8, 8, 64) and np.isfinite(np.asarray(out)).all()
assert (np.asarray(out[7]) == 0).all() and np.abs(np.asarray(out[:7])).max() > 0
""",
    r"int8_bytes = ": """
import numpy as np
float_bytes = quantize.parameter_bytes(llama.from_pretrained(TINY_DIR))
assert 0.24 < int8_bytes / float_bytes < 0.28, int8_bytes / float_bytes
want = np.ones((2, 128)) @ np.asarray(fj.dequantize(q), np.float64).T
assert y.shape == (2, 64) and np.allclose(np.asarray(y), want, atol=1e-4)
""",
    r"kv_pool_bytes = ": """
import numpy as np
assert kv_pool_bytes / (2 * 16 * 16 * 64 * 2) == (64 + 4) / 128, kv_pool_bytes
dense = np.asarray(fj.dequantize(k_pages), np.float64)[:, :2].reshape(2, 32, 64)[:, :20]
assert np.abs(dense - np.swapaxes(np.asarray(k), 0, 1)).max() < 0.03
assert quant_out.shape == (1, 8, 64) and np.isfinite(np.asarray(quant_out)).all()
""",
    r"answers = ": """
assert answers == ["001", "1231"], answers
""",
    r"served = ": """
assert served == ["001", "1231", "285"], served
assert engine.manager.usage().num_sequences == 0
""",
    r"sharded_tokens = ": """
one_device = generation.generate(llama.from_pretrained(TINY_DIR), [[3, 4, 5], [3, 6]],
                                 max_new_tokens=8)
assert sharded_tokens == one_device, (sharded_tokens, one_device)
assert model.mesh.tp == 2 and model.mesh.dp == 2
assert copy.layers[0].self_attn.qkv_proj.kernel[...].sharding.spec[0] == "tp"
""",
    r"moe_out = ": """
import numpy as np
assert moe_out.shape == (6, 64) and mixtral_out.shape == (6, 64)
assert np.isfinite(np.asarray(moe_out)).all() and np.abs(np.asarray(mixtral_out)).max() > 0
assert feat.shape == (2, 16, 16, 16) and depthwise.shape == (2, 16, 16, 16)
""",
    r"new_tokens = ": """
assert logits.shape[:2] == (1, 4) and len(new_tokens) == 2, (logits.shape, new_tokens)
""",
}

DRIVER = """
import json, sys, warnings
warnings.filterwarnings("error", message=r".* has moved to ", category=DeprecationWarning)
name, block, checks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
exec(compile(block, name, "exec"), namespace)
exec(compile(checks, name + " checks", "exec"), namespace)
print("DOC BLOCK OK")
"""


def _python_blocks():
    """``(file, index, body, reason not to run or None)`` of every Python block."""
    out = []
    for path in DOCS:
        text = path.read_text()
        index = 0
        for match in FENCE.finditer(text):
            info = match.group(1).strip()
            if info.split()[0:1] and info.split()[0] in PYTHON_SPELLINGS:
                reason = NOT_RUN.search(text[:match.start()])
                out.append((path, index, info, match.group(2),
                            reason.group(1) if reason else None))
                index += 1
    return out


BLOCKS = _python_blocks()


def _id(block):
    path, index = block[0], block[1]
    return f"{path.relative_to(ROOT)}:{index}"


def test_the_docs_have_examples():
    files = {path.name for path, *_ in BLOCKS}
    assert len(BLOCKS) >= 15 and {"README.md", "ops.md", "kv-caches.md"} <= files, files


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_python_block_runs_in_a_fresh_interpreter(block, tmp_path):
    path, index, info, body, reason = block
    assert info == "python", f"{_id(block)}: spell a Python block ```python, not ```{info}"
    if reason is not None:
        assert reason.strip(), f"{_id(block)}: a block that does not run must say why"
        pytest.skip(f"{_id(block)} is marked not to run: {reason}")
    checks = "".join(code for key, code in CHECKS.items() if re.search(f"^{key}", body, re.M))
    result = subprocess.run([sys.executable, "-c", DRIVER],
                            input=json.dumps([_id(block), body, checks]),
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "DOC BLOCK OK" in result.stdout, (
        f"{_id(block)} failed:\n{body}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr}")


def test_every_not_run_marker_sits_on_a_python_block():
    for path in DOCS:
        text = path.read_text()
        for marker in re.finditer(r"<!-- not run:.*?-->\n", text):
            follows = text[marker.end():marker.end() + 10]
            assert follows.startswith("```python"), (
                f"{path.relative_to(ROOT)}: {marker.group(0).strip()} is not right above a "
                f"```python block")


def test_every_check_matches_a_block():
    unused = [key for key in CHECKS
              if not any(re.search(f"^{key}", body, re.M) for *_, body, reason in BLOCKS
                         if reason is None)]
    assert unused == [], f"checks that no running block triggers: {unused}"


def _moved_names():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Moved names", 1)[1]
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)`", section, re.M)
    assert len(rows) >= 18, rows
    return rows


@pytest.mark.parametrize("old, new", _moved_names())
def test_each_moved_name_forwards_with_a_deprecation_warning(old, new):
    try:
        old_module = importlib.import_module(old)
    except ModuleNotFoundError:
        old_module = None
    if old_module is not None:  # a moved module: any name of the new one resolves there
        new_module = importlib.import_module(new)
        name = sorted(getattr(new_module, "__all__", None)
                      or (n for n in vars(new_module) if not n.startswith("_")))[0]
        owner, want = old_module, getattr(new_module, name)
    else:  # a moved name: old is module.name, new is its home module.name
        (old_owner, name), (new_owner, new_name) = old.rsplit(".", 1), new.rsplit(".", 1)
        assert name == new_name, (old, new)
        owner = importlib.import_module(old_owner)
        want = getattr(importlib.import_module(new_owner), name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(owner, name)
    assert got is want, (old, new, name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    home = new if old_module is not None else new.rsplit(".", 1)[0]
    assert any(home in m for m in messages), (old, new, messages)


# Docs speak of the project: no issue numbers, no work sessions.
FORBIDDEN = re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d+\b|\b(this|work|the) session'?s?\b",
                       re.I)


@pytest.mark.parametrize("path", [*DOCS, ROOT / "BENCHMARKS.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_issue_numbers_or_sessions(path):
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert hits == []


def test_benchmarks_open_with_the_current_figures():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    first_screen = "\n".join(lines[:30])
    assert "GPU: not measured on hardware yet" in first_screen
    header = next(line for line in lines if line.startswith("| figure"))
    assert header == "| figure | value | device | JAX | date | command |", header
    rows = lines[lines.index(header) + 2:]
    rows = rows[:next(i for i, line in enumerate(rows) if not line.startswith("|"))]
    assert len(rows) >= 5
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6 and all(cells), row
        assert cells[0].startswith("GPU") or re.fullmatch(r"\d{4}-\d\d-\d\d", cells[4]), row


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
