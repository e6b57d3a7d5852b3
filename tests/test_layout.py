"""The shape of the code base: one-way dependencies, no reaching into another module's
private names, files of one concern (read from the sources with ``ast``; nothing imported).

* No import cycle among forge_jax's modules (a module pair importing each other is the
  smallest one). Imports inside functions count too: a lazy import is still a dependency.
  The one deliberate exception is dispatch loading ``forge_jax.pallas_kernels`` by name
  (``importlib``), which is how kernels register without the ops importing them.
* No module uses a private name (``_x``) of another module: not ``from m import _x`` and
  not ``m._x``. Private *modules* (``forge_jax._compat``, ``pallas_kernels/gpu/_common.py``)
  are the package's own and may be imported within it; their public names are its API.
* The layers, bottom to top: the kernel library (``forge_jax`` core), the Pallas kernels that
  register into it, ``forge_jax.models``, then the runtime (``forge_jax.generation``,
  ``forge_jax.text``, ``forge_jax.serving``) and the CLI on top. No import runs from a lower
  layer to a higher one (``docs/architecture.md`` draws them). The old paths of moved modules
  forward by name (``forge_jax._moved``) and import nothing upward.
* No source file over 600 lines.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folder -> the package name it installs as (pyproject.toml's package-dir).
PACKAGES = {"forge_jax": "forge_jax", "models": "forge_jax.models",
            "pallas_kernels": "forge_jax.pallas_kernels"}
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, pathlib.Path()).name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    if not level:
        return target or ""
    base = module.split(".")
    base = base if _is_package(module) else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str, tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` of every import statement."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module)
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    out.append((f"{source}.{alias.name}", None, node.lineno))
                else:
                    out.append((source, alias.name, node.lineno))
    return out


def _trees() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


TREES = _trees()


def _graph() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for target, _, _ in _imports(name, tree):
            # `import a.b.c` depends on a.b.c; an unknown name on its nearest known parent.
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_layout_is_read():
    assert len(MODULES) > 40
    assert "forge_jax.dispatch" in _graph()["forge_jax.ops.norm"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


# Layer of a module: the longest prefix here that names it (anything else in forge_jax is core).
LAYERS = {
    "forge_jax": 0,
    "forge_jax.pallas_kernels": 1,
    "forge_jax.models": 2,
    "forge_jax.generation": 3,
    "forge_jax.text": 4,
    "forge_jax.serving": 5,
    "forge_jax.cli": 6,
}


def _layer(module: str) -> tuple[str, int]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return prefix, LAYERS[prefix]


def test_layers_are_ordered():
    assert _layer("forge_jax.ops.norm") == ("forge_jax", 0)
    assert _layer("forge_jax.serving.http") == ("forge_jax.serving", 5)
    assert _layer("forge_jax.models.checkpoints.gguf") == ("forge_jax.models", 2)


def test_no_import_runs_up_the_layers():
    """A module imports only its own layer and the ones below it (lazy imports included)."""
    upward = []
    for name, targets in _graph().items():
        for target in targets:
            (lower, low), (upper, high) = _layer(name), _layer(target)
            if high > low:
                upward.append(f"{MODULES[name].relative_to(ROOT)} ({lower}) imports {target} "
                              f"({upper})")
    assert upward == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_uses_another_modules_private_names():
    bad = []
    for name, tree in TREES.items():
        aliases = {}  # local name -> module it stands for
        for target, imported, line in _imports(name, tree):
            if imported is None:
                continue
            if _private(imported) and target != name:
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line} from {target} "
                           f"import {imported}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, node.level, node.module)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in MODULES:
                        aliases[alias.asname or alias.name] = full
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _private(node.attr)):
                module = aliases[node.value.id]
                if f"{module}.{node.attr}" not in MODULES and module != name:
                    bad.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} "
                               f"{node.value.id}.{node.attr}")
    assert bad == []


@pytest.mark.parametrize("folder", ["forge_jax", "models", "pallas_kernels", "benchmarks"])
def test_no_source_file_over_the_limit(folder):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
