"""Autotuning: measure which implementation (and launch configuration) of an op is fastest
for given arguments on this device, remember it, and let auto selection follow it.

``fj.autotune(op, *args, **kwargs)`` takes the op's arguments exactly as the op does. It
times every implementation that auto selection could choose for them here (or those named
by ``implementations=``), each with its default launch parameters and with every
candidate configuration its kernel module registered (:func:`register_configs`), checks
each candidate's output against the XLA implementation, and stores the fastest in a JSON
file keyed by device kind, JAX version, op and argument signature (shapes, dtypes and the
static arguments). Later calls in any process read the file instead of timing again, and
:mod:`forge_jax.dispatch`'s auto selection chooses a stored winner first, with its
configuration, wherever it can serve the arguments.

The file: ``$FORGE_JAX_AUTOTUNE_CACHE`` when set (``off`` disables reading and writing
it), else ``$XDG_CACHE_HOME/forge_jax/autotune.json`` (``~/.cache`` without
``XDG_CACHE_HOME``). A file that is not valid JSON, or not this module's format, is ignored
with a warning (and set aside as ``*.corrupt`` when a new result is written), never fatal.
A new device kind or JAX version keys new entries; :func:`clear` forgets entries and
``force=True`` times again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import pathlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from forge_jax import dispatch, tolerances

logger = logging.getLogger("forge_jax.autotuning")

CACHE_ENV = "FORGE_JAX_AUTOTUNE_CACHE"
FORMAT = "forge_jax.autotune"
VERSION = 1

ConfigsFn = Callable[[Mapping[str, Any]], Sequence[Mapping[str, Any]]]

# (op, implementation name) -> the candidate launch configurations of its kernel for given
# arguments (keyword knobs its wrapper takes). Filled by the kernel modules on import.
_CONFIGS: dict[tuple[str, str], ConfigsFn] = {}
# path -> ((mtime_ns, size), entries, readable): the file as last read, re-read when it
# changes (dispatch looks winners up at every trace).
_READ: dict[str, tuple[tuple[int, int], dict[str, dict[str, Any]], bool]] = {}


def register_configs(op: str, name: str, configs: ConfigsFn) -> None:
    """Declares the candidate launch configurations of implementation ``name`` of ``op``.

    ``configs(args)`` returns keyword dicts the implementation accepts besides the op's
    arguments (e.g. ``{"block_rows": 4, "num_warps": 8}``); each must be valid for ``args``.
    The implementation's defaults (no keywords) are always a candidate too.
    """
    _CONFIGS[(op, name)] = configs


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One timed (implementation, configuration): median seconds per call, or why not."""

    implementation: str
    config: Mapping[str, Any]
    seconds: float | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of :func:`autotune`.

    Attributes:
      op, device_kind, jax_version, signature: the cache key.
      implementation, config: the winner (what auto selection now runs for these arguments).
      seconds: the winner's median seconds per call.
      candidates: every candidate timed (empty when ``cached``).
      skipped: implementation -> why it was not timed.
      cached: read from the cache file, nothing timed.
    """

    op: str
    device_kind: str
    jax_version: str
    signature: str
    implementation: str
    config: Mapping[str, Any]
    seconds: float | None
    candidates: tuple[Candidate, ...] = ()
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cached: bool = False

    def __str__(self) -> str:
        config = ", ".join(f"{k}={v}" for k, v in self.config.items())
        best = f"{self.implementation}" + (f" ({config})" if config else "")
        when = "cached" if self.cached else f"{len(self.candidates)} candidates timed"
        time_ = "" if self.seconds is None else f", {self.seconds * 1e6:.1f} us"
        return f"{self.op} {self.signature}: {best}{time_} [{when}]"


def cache_path() -> pathlib.Path | None:
    """The cache file (see the module docstring), or None when disabled."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() == "off" else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "forge_jax" / "autotune.json"


def device_kind(platform: str) -> str:
    """The device kind autotuning keys on, e.g. "NVIDIA H100 80GB HBM3" or "cpu"."""
    try:
        return jax.devices(platform)[0].device_kind
    except RuntimeError:
        return platform


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


def winner(impls: Mapping[str, dispatch.Implementation], args: Mapping[str, Any],
           platform: str, rejected: dict[str, str]) -> dispatch.Implementation | None:
    """Auto selection's hook: the measured winner for these arguments, bound to its
    configuration, if one is stored and can serve them; records in ``rejected`` why the
    others do not run. None otherwise (auto selection then goes by priority)."""
    if not impls:
        return None
    op = next(iter(impls.values())).op
    try:
        entry = lookup(op, args, platform)
    except Exception as e:  # a broken cache never breaks dispatch
        logger.debug("autotune lookup failed: %s", e)
        return None
    if entry is None:
        return None
    impl = impls.get(entry["implementation"])
    if impl is None:
        rejected.setdefault(entry["implementation"],
                            "measured fastest here (autotune cache), but not registered now")
        return None
    reason = dispatch._check(impl, args, platform)
    if reason is not None:
        rejected.setdefault(impl.name, f"measured fastest here (autotune cache), but: {reason}")
        return None
    for other in impls.values():
        if other.name != impl.name:
            rejected.setdefault(other.name, f"measured slower than {impl.name!r} for these "
                                            f"arguments on this device (autotune cache)")
    if entry["config"]:
        impl = dataclasses.replace(impl, fn=functools.partial(impl.fn, **entry["config"]))
    return impl


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


def _write(path: pathlib.Path, entry: Mapping[str, Any]) -> None:
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


SAMPLE_S = 0.002  # a timed sample lasts about this long (back-to-back calls)
MAX_CALLS = 100  # calls per sample at most


def _time(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn``: the median of ``iters`` samples, each of enough
    back-to-back calls (one ``block_until_ready`` at the end) to last :data:`SAMPLE_S`, so
    that a small kernel is not measured as the host's dispatch overhead."""
    jax.block_until_ready(fn())  # compiled and warm
    start = time.perf_counter()
    jax.block_until_ready(fn())
    calls = max(1, min(MAX_CALLS, int(SAMPLE_S / max(time.perf_counter() - start, 1e-9))))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def _agrees(out: Any, ref: Any, implementation: str) -> str | None:
    """None if ``out`` matches the XLA output ``ref`` within both tolerance budgets."""
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"output {o.dtype}{o.shape} differs from XLA's {r.dtype}{r.shape}"
        tk, tx = tolerances.tolerance(r.dtype, implementation), tolerances.tolerance(r.dtype)
        o64, r64 = np.asarray(o, np.float64), np.asarray(r, np.float64)
        ok = np.abs(o64 - r64) <= tk.atol + tx.atol + (tk.rtol + tx.rtol) * np.abs(r64)
        ok |= np.isnan(o64) & np.isnan(r64)
        if not ok.all():
            return f"output differs from XLA's beyond the tolerance at {int((~ok).sum())} places"
    return None


def _default_names(impls: Mapping[str, dispatch.Implementation], platform: str) -> list[str]:
    """What auto selection could choose on ``platform``: ranked there and not unverified."""
    return [n for n, i in impls.items()
            if platform in i.priority and not dispatch._unverified(i, platform)]


def _configs(op: str, name: str, args: Mapping[str, Any]) -> list[dict[str, Any]]:
    configs = [{}]
    fn = _CONFIGS.get((op, name))
    for c in (fn(args) if fn else ()):
        if dict(c) not in configs:
            configs.append(dict(c))
    return configs


def autotune(op: str, *args: Any, implementations: Iterable[str] | None = None,
             iters: int = 10, force: bool = False, store: bool = True,
             **kwargs: Any) -> Result:
    """Times the implementations of ``op`` for these arguments and stores the fastest.

    Args:
      op: the op's name, e.g. ``"rms_norm"``.
      *args, **kwargs: the op's arguments, exactly as the op takes them.
      implementations: the names to time (default: those auto selection could choose on
        this platform: ranked there and verified). Naming one (e.g. an unverified kernel)
        is asking auto selection to follow it where it measures fastest.
      iters: timed calls per candidate (the median counts).
      force: time again even when the cache has an entry.
      store: write the winner to the cache file.

    Returns:
      A :class:`Result`; ``str()`` of it is one line.
    """
    if op not in dispatch._BINDERS:
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(dispatch._BINDERS)}")
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters=!r}")
    bound = dispatch._BINDERS[op](*args, **kwargs)
    if any(isinstance(a, jax.core.Tracer) for a in bound.values()):
        raise ValueError(f"fj.autotune({op!r}, ...) times concrete arrays: call it outside "
                         "jax.jit / vmap / grad (auto selection inside them reads its result)")
    platform = dispatch._platform(bound)
    impls = dispatch.implementations(op, platform)
    names = _default_names(impls, platform) if implementations is None else list(implementations)
    unknown = [n for n in names if n not in impls]
    if unknown:
        raise ValueError(f"implementations={unknown} are not registered for {op!r} on "
                         f"{platform}; registered: {sorted(impls)}")
    kind, sig = device_kind(platform), signature(bound)
    if not force:
        entry = lookup(op, bound, platform)
        if entry is not None:
            return Result(op, kind, jax.__version__, sig, entry["implementation"],
                          entry["config"], entry.get("seconds"), cached=True)

    arrays = {n: a for n, a in bound.items() if isinstance(a, jax.Array | np.ndarray)}
    static = {n: a for n, a in bound.items() if n not in arrays}
    ref = None
    if "xla" in impls:
        ref = jax.jit(lambda a: impls["xla"].fn(**a, **static))(arrays)
    candidates, skipped = [], {}
    for name in names:
        reason = dispatch._check(impls[name], bound, platform)
        if reason is not None:
            skipped[name] = reason
            continue
        for config in _configs(op, name, bound):
            fn = jax.jit(functools.partial(
                lambda a, fn, config: fn(**a, **static, **config), fn=impls[name].fn,
                config=config))
            try:
                out = fn(arrays)
                wrong = None if ref is None or name == "xla" else _agrees(out, ref, name)
                seconds = None if wrong else _time(lambda fn=fn: fn(arrays), iters)
            except Exception as e:  # a candidate that fails is reported, not fatal
                wrong, seconds = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", None
            candidates.append(Candidate(name, config, seconds, wrong))
    timed = [c for c in candidates if c.seconds is not None]
    if not timed:
        raise dispatch.ImplementationError(
            f"autotune: no implementation of {op!r} ran for these arguments on {platform}: "
            f"skipped {skipped}, failed {[(c.implementation, c.error) for c in candidates]}")
    best = min(timed, key=lambda c: c.seconds)
    result = Result(op, kind, jax.__version__, sig, best.implementation, dict(best.config),
                    best.seconds, tuple(candidates), skipped)
    path = cache_path()
    if store and path is not None:
        try:
            _write(path, {
                "device_kind": kind, "jax": jax.__version__, "op": op, "signature": sig,
                "implementation": best.implementation, "config": dict(best.config),
                "seconds": best.seconds,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "times": {f"{c.implementation} {json.dumps(c.config)}": c.seconds
                          for c in timed},
            })
        except OSError as e:  # a cache that cannot be written is not fatal: the result stands
            warnings.warn(f"forge_jax autotune cache {path} not written: {e}", RuntimeWarning,
                          stacklevel=2)
    return result
