"""Compiled generation steps kept on disk, so that a later process runs them without tracing.

JAX's persistent compilation cache saves the XLA compile, but a fresh process still traces
each step (the whole model, every op's dispatch) and lowers it to find the cache entry.
Here the compiled executables themselves are kept (``jax.experimental.serialize_executable``)
under a key computed from the call alone, without tracing:

* the step's name and its static arguments (the model's graph definition, so its config,
  layer structure and weight formats; greedy or sampling; the implementation preference);
* the argument tree and, for every array in it, its shape, dtype and sharding;
* the JAX and jaxlib versions, the platform, its device kinds and, on CPU, the processor's
  feature flags; and a fingerprint of forge_jax's own sources (their sizes and times).

``with use_step_cache(directory):`` (``forge-jax chat`` / ``generate`` / ``serve`` open it
beside their persistent compilation cache) makes :class:`CachedStep` wrappers look there
first: a step found is loaded and run; one not found is compiled as jit would and then
written there (atomically). An entry that does not load (corrupted, written for another key,
an executable jaxlib refuses) is ignored with one log line, never trusted, and compiled
anew. Outside the block the wrappers are plain ``jax.jit`` calls.

JAX's format for serialized executables loads through pickle, and an executable is machine
code either way: use only a cache directory you own (the CLI's is under your user's cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import tempfile
from collections.abc import Iterator
from typing import Any

import jax

logger = logging.getLogger("forge_jax.generation.compiled_cache")

FORMAT = "forge-jax-compiled-step/1"
SUFFIX = ".step"
_DIRECTORY: list[pathlib.Path] = []  # the active cache directory (innermost last)
# (step name, call signature) -> executable, for this process: a cache of derived values.
_LOADED: dict[tuple, Any] = {}


@contextlib.contextmanager
def use_step_cache(directory: str | os.PathLike | None) -> Iterator[None]:
    """Within the block, the generation steps are loaded from and saved to ``directory``
    (created if missing); ``None`` leaves things as they are."""
    if directory is None:
        yield
        return
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    _DIRECTORY.append(path)
    try:
        yield
    finally:
        _DIRECTORY.pop()


def active_directory() -> pathlib.Path | None:
    return _DIRECTORY[-1] if _DIRECTORY else None


def _sources_fingerprint() -> str:
    """Sizes and modification times of forge_jax's sources (the package and its models
    and kernels): an edit makes every entry stale."""
    root = pathlib.Path(__file__).resolve().parents[1]
    import forge_jax.models as models

    parts = []
    for base in (root, pathlib.Path(models.__file__).resolve().parent):
        for f in sorted(base.rglob("*")):
            if f.suffix in (".py", ".cc"):
                st = f.stat()
                parts.append(f"{f.relative_to(base)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


_FINGERPRINT: list[str] = []


def _machine() -> str:
    """The platform, its devices and, on CPU, the processor's features."""
    devices = jax.devices()
    text = f"{devices[0].platform}:{len(devices)}:{sorted({d.device_kind for d in devices})}"
    if devices[0].platform == "cpu":
        with contextlib.suppress(OSError):
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith(("flags", "Features")):
                    return f"{text}:{line}"
        text += f":{platform.machine()}:{platform.processor()}"
    return text


def _static_text(value) -> str:
    value = getattr(value, "value", value)  # steps.Static
    return repr(value)


def _signature(args, kwargs, statics):
    leaves, treedef = jax.tree.flatten((args, kwargs))
    avals = tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                  if hasattr(x, "shape") else (type(x).__name__, x) for x in leaves)
    return treedef, avals, tuple(sorted(statics.items()))


def _key_text(name, treedef, avals, statics) -> str:
    if not _FINGERPRINT:
        _FINGERPRINT.append(_sources_fingerprint())
    lines = [FORMAT, name, f"jax {jax.__version__} jaxlib {jax.lib.__version__}", _machine(),
             _FINGERPRINT[0], str(treedef), repr(avals)]
    lines += [f"{k}={_static_text(v)}" for k, v in statics]
    return "\n".join(lines)


class CachedStep:
    """A jitted step that, inside :func:`use_step_cache`, runs executables kept on disk.

    Everything else (``lower``, ``trace``, ...) is the jitted function's."""

    def __init__(self, jitted, name: str, static_argnames: tuple[str, ...]):
        self._jitted, self._name, self._static = jitted, name, frozenset(static_argnames)

    def __getattr__(self, attr):
        return getattr(self._jitted, attr)

    def __call__(self, *args, **kwargs):
        if active_directory() is None:
            return self._jitted(*args, **kwargs)
        statics = {k: kwargs.pop(k) for k in list(kwargs) if k in self._static}
        return self._executable(args, kwargs, statics)(*args, **kwargs)

    def compiled(self, *args, **kwargs):
        """The step compiled for these arguments (``jit(...).lower(...).compile()``), from
        the cache when one is active; called with the arguments but the static ones."""
        if active_directory() is None:
            return self._jitted.lower(*args, **kwargs).compile()
        statics = {k: kwargs.pop(k) for k in list(kwargs) if k in self._static}
        return self._executable(args, kwargs, statics)

    def _executable(self, args, kwargs, statics):
        directory = active_directory()
        treedef, avals, static_items = _signature(args, kwargs, statics)
        memo = (self._name, directory, treedef, avals, static_items)
        executable = _LOADED.get(memo)
        if executable is None:
            executable = self._load_or_compile(directory, treedef, avals, static_items,
                                               args, kwargs, statics)
            _LOADED[memo] = executable
        return executable

    def _load_or_compile(self, directory, treedef, avals, static_items, args, kwargs, statics):
        text = _key_text(self._name, treedef, avals, static_items)
        file = directory / f"{self._name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}{SUFFIX}"
        if file.exists():
            try:
                return _load(file, text, treedef)
            except Exception as e:  # noqa: BLE001  (any bad entry is ignored, never trusted)
                logger.warning("ignoring the compiled step %s: %s", file, e)
        with _without_jax_cache():
            compiled = self._jitted.lower(*args, **kwargs, **statics).compile()
        try:
            _save(file, text, compiled)
        except Exception as e:  # noqa: BLE001  (an unserializable step still runs)
            logger.info("could not keep the compiled step %s: %s", file, e)
        return compiled


@contextlib.contextmanager
def _without_jax_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for a step that will be kept: an executable
    JAX loaded from that cache serializes without its functions' code (XLA:CPU, jaxlib
    0.10: the kept step fails at its first run with ``Function compare_convert_fusion not
    found``), so a step to keep is compiled afresh."""
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def _prepare_kernels() -> None:
    """Makes every implementation that is available here ready (a C++ kernel registers its
    FFI target when first asked): an executable that calls one loads only then."""
    from forge_jax import registry

    for op in registry.ops():
        for impl in registry.registrations(op):
            with contextlib.suppress(Exception):
                impl.available()


def _load(file: pathlib.Path, text: str, treedef):
    from jax.experimental import serialize_executable

    _prepare_kernels()
    with open(file, "rb") as f:
        entry = pickle.load(f)
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} entry")
    if entry["key"] != text:
        raise ValueError("written for another model, machine, JAX or forge_jax version")
    if entry["in_tree"] != treedef:
        raise ValueError("its argument tree differs from the call's")
    by_id = {d.id: d for d in jax.devices()}
    missing = [i for i in entry["devices"] if i not in by_id]
    if missing:
        raise ValueError(f"compiled for devices {missing} this process does not have")
    return serialize_executable.deserialize_and_load(
        entry["payload"], entry["in_tree"], entry["out_tree"],
        execution_devices=[by_id[i] for i in entry["devices"]])


def _save(file: pathlib.Path, text: str, compiled) -> None:
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    # The devices it runs on, in its device assignment's order (one device, or a mesh's).
    sharding = jax.tree.leaves(compiled.input_shardings)[0]
    devices = [d.id for d in sharding._device_assignment]
    entry = {"format": FORMAT, "key": text, "payload": payload, "in_tree": in_tree,
             "out_tree": out_tree, "devices": devices}
    fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
