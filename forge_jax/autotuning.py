"""Autotuning: measure which implementation (and launch configuration) of an op is fastest
for given arguments on this device, remember it, and let auto selection follow it.

``fj.autotune(op, *args, **kwargs)`` takes the op's arguments exactly as the op does. It
times every implementation that auto selection could choose for them here (or those named
by ``implementations=``), each with its default launch parameters and with every
candidate configuration in its registry record (``Implementation.configs``), checks
each candidate's output against the XLA implementation, and stores the fastest in a JSON
file keyed by device kind, JAX version, op and argument signature (shapes, dtypes and the
static arguments). Later calls in any process read the file instead of timing again, and
:mod:`forge_jax.dispatch`'s auto selection chooses a stored winner first, with its
configuration, wherever it can serve the arguments.

The file and its format are :mod:`forge_jax.autotune_cache`'s (its API is re-exported
here). A new device kind or JAX version keys new entries; :func:`clear` forgets entries
and ``force=True`` times again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from forge_jax import dispatch, registry, tolerances
from forge_jax.autotune_cache import (  # noqa: F401  (the cache's API, as fj.autotuning's)
    CACHE_ENV,
    FORMAT,
    VERSION,
    cache_path,
    clear,
    device_kind,
    lookup,
    signature,
)
from forge_jax.autotune_cache import write as _write_entry

logger = logging.getLogger("forge_jax.autotuning")


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
    record = registry.op_record(op)
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters=!r}")
    bound = record.bind(*args, **kwargs)
    if any(isinstance(a, jax.core.Tracer) for a in bound.values()):
        raise ValueError(f"fj.autotune({op!r}, ...) times concrete arrays: call it outside "
                         "jax.jit / vmap / grad (auto selection inside them reads its result)")
    platform = dispatch.platform_of(bound)
    impls = registry.implementations(op, platform)
    names = ([n for n, i in impls.items() if i.ranked(platform)] if implementations is None
             else list(implementations))
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
        reason = dispatch.check(impls[name], bound, platform)
        if reason is not None:
            skipped[name] = reason
            continue
        for config in impls[name].candidate_configs(bound):
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
            _write_entry(path, {
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
