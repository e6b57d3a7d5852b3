"""The autotune cache file: where :func:`forge_jax.autotune` keeps measured winners.

A leaf module (it imports nothing of forge_jax), read by dispatch's auto selection at every
trace and written by :mod:`forge_jax.autotuning`.

The file: ``$FORGE_JAX_AUTOTUNE_CACHE`` when set (``off`` disables reading and writing
it), else ``$XDG_CACHE_HOME/forge_jax/autotune.json`` (``~/.cache`` without
``XDG_CACHE_HOME``). Entries are keyed by device kind, JAX version, op and argument
signature (shapes, dtypes and the static arguments). A file that is not valid JSON, or not
this module's format, is ignored with a warning (and set aside as ``*.corrupt`` when a new
result is written), never fatal.
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from forge_jax import targets

CACHE_ENV = "FORGE_JAX_AUTOTUNE_CACHE"
FORMAT = "forge_jax.autotune"
VERSION = 1

# path -> ((mtime_ns, size), entries, readable): the file as last read, re-read when it
# changes (dispatch looks winners up at every trace).
_READ: dict[str, tuple[tuple[int, int], dict[str, dict[str, Any]], bool]] = {}


def cache_path() -> pathlib.Path | None:
    """The cache file (see the module docstring), or None when disabled."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() == "off" else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "forge_jax" / "autotune.json"


def device_kind(platform: str) -> str:
    """The device kind autotuning keys on, e.g. "NVIDIA H100 80GB HBM3" or "cpu"."""
    return targets.device_kind(platform) or platform


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{np.dtype(value.dtype).name}{list(value.shape)}"
    return repr(value)


def signature(args: Mapping[str, Any]) -> str:
    """The argument signature of a (bound) op call: arrays by dtype and shape, every other
    argument by value, e.g. ``"x=bfloat16[4, 64] weight=bfloat16[64] eps=1e-06"``."""
    return " ".join(f"{name}={_describe(value)}" for name, value in args.items())


def _key(device: str, op: str, sig: str) -> str:
    return json.dumps([device, jax.__version__, op, sig])


def _entries(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """The entries of the cache file (empty when missing, unreadable or foreign; the latter
    two with a warning, once per version of the file)."""
    return _read(path)[0]


def _read(path: pathlib.Path) -> tuple[dict[str, dict[str, Any]], bool]:
    """``(entries, readable)`` of the cache file; a missing file is readable and empty."""
    try:
        stat = path.stat()
    except OSError:
        return {}, True
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _READ.get(str(path))
    if cached is not None and cached[0] == stamp:
        return cached[1], cached[2]
    entries, readable = {}, True
    try:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and data.get("format") == FORMAT
                and data.get("version") == VERSION and isinstance(data.get("entries"), list)):
            raise ValueError(f"not a {FORMAT} version {VERSION} file")
        for e in data["entries"]:
            if not (isinstance(e, dict) and isinstance(e.get("implementation"), str)
                    and isinstance(e.get("config"), dict)):
                raise ValueError(f"malformed entry {e!r}"[:200])
            entries[json.dumps([e["device_kind"], e["jax"], e["op"], e["signature"]])] = e
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"forge_jax autotune cache {path} ignored: {type(err).__name__}: {err}",
                      RuntimeWarning, stacklevel=4)
        entries, readable = {}, False
    _READ[str(path)] = (stamp, entries, readable)
    return entries, readable


def lookup(op: str, args: Mapping[str, Any], platform: str) -> Mapping[str, Any] | None:
    """The stored winner for ``op`` with these (bound) arguments on ``platform``'s device
    (an entry with ``implementation`` and ``config``), or None."""
    path = cache_path()
    entries = {} if path is None else _entries(path)
    if not entries:  # the common case: nothing tuned, no signature to build
        return None
    return entries.get(_key(device_kind(platform), op, signature(args)))


def _store(path: pathlib.Path, entries: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes ``entries`` as the whole file, atomically (a reader sees the old file or the
    new one, never half of one); a file that was unreadable is set aside first."""
    if not _read(path)[1]:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        warnings.warn(f"forge_jax autotune cache {path} was unreadable; moved to {aside}",
                      RuntimeWarning, stacklevel=3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION,
                               "entries": sorted(entries.values(), key=json.dumps)},
                              indent=1) + "\n")
    os.replace(tmp, path)
    _READ.pop(str(path), None)  # re-read next time, whatever the file system's clock says


def write(path: pathlib.Path, entry: Mapping[str, Any]) -> None:
    """Adds ``entry`` to the file, keeping the entries already there."""
    entries = dict(_entries(path))
    entries[_key(entry["device_kind"], entry["op"], entry["signature"])] = dict(entry)
    _store(path, entries)


def clear(op: str | None = None) -> int:
    """Forgets the stored winners (of ``op`` only, when given); returns how many."""
    path = cache_path()
    if path is None or not path.exists():
        return 0
    entries = _entries(path)
    keep = {k: e for k, e in entries.items() if op is not None and e["op"] != op}
    _store(path, keep)
    return len(entries) - len(keep)
