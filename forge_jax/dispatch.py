"""Dispatch: which implementation computes an op call, and why.

Every public op is a thin wrapper that validates its arguments and then calls
:func:`call`, which picks an implementation *at trace time* and calls it (per shard on a
mesh, by the op's partition rule). It chooses among the records of
:mod:`forge_jax.registry` (whose API is re-exported here): one
:class:`~forge_jax.registry.Op` per op (binder, partition rule) and one
:class:`~forge_jax.registry.Implementation` per implementation (function, ``supports``,
``available``, priority per platform, platforms, verification record, autotuning
configurations). A kernel with a ``verified`` mapping is ranked on a platform only once
that platform has a record; until then it runs by name and :func:`explain` says it is not
yet verified there. An implementation whose priority names no platform (e.g.
``"pallas_gpu_interpret"``) only ever runs by name.

Which implementation runs, most specific first:

1. ``implementation=`` on the call: strict. If it cannot serve the arguments,
   :class:`ImplementationError` says why.
2. :func:`use_implementation` (innermost block wins), then the
   ``FORGE_JAX_IMPLEMENTATION`` environment variable: a preference. Ops that have
   no implementation of that name, or whose implementation of that name cannot
   serve the arguments, fall back to auto selection and record the reason, so a
   model with ops that have no kernel still runs inside ``use_implementation("pallas")``.
   ``use_implementation(name, strict=True)`` makes the preference strict.
3. Auto: a winner measured by :func:`forge_jax.autotune` (its cache file,
   :mod:`forge_jax.autotune_cache`) where one is stored and can serve the call, else the
   first supported implementation in priority order for the platform.

Kernels register from ``pallas_kernels`` (imported lazily on the first dispatch);
the ops never import a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from forge_jax import autotune_cache, registry, sharding, targets
from forge_jax.registry import (  # noqa: F401  (the registry's API, as dispatch's)
    Implementation,
    check_name,
    implementations,
    names,
    ops,
    register,
    registrations,
    unregister,
)

logger = logging.getLogger("forge_jax.dispatch")

ENV_VAR = "FORGE_JAX_IMPLEMENTATION"


class ImplementationError(ValueError):
    """An implementation asked for by name cannot serve the call."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of dispatching one op call.

    Attributes:
      op: the op's name.
      implementation: the name of the implementation that runs.
      platform: the platform the selection was made for ("cpu", "gpu", "tpu").
      source: why this implementation was considered: "call" (``implementation=``),
        "context" (:func:`use_implementation`), "env" (``FORGE_JAX_IMPLEMENTATION``)
        or "auto".
      rejected: implementation name -> the reason it was not used.
    """

    op: str
    implementation: str
    platform: str
    source: str
    rejected: Mapping[str, str]

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.implementation!r} on {self.platform} ({self.source})"]
        for name, reason in self.rejected.items():
            lines.append(f"  not {name!r}: {reason}")
        return "\n".join(lines)


# The last selection made for each op (inspectable; e.g. the CLI reports it).
_LAST: dict[str, Selection] = {}
_LOCAL = threading.local()


@contextlib.contextmanager
def use_implementation(name: str | None, *, strict: bool = False) -> Iterator[None]:
    """Context manager: prefer implementation ``name`` for every op called inside.

    The choice is made when an op is traced, so it applies to functions first
    traced (or called eagerly) inside the block. ``strict=True`` raises
    :class:`ImplementationError` for an op that cannot use ``name`` instead of
    falling back to auto selection. ``name=None`` restores auto selection.

    A name that no op has registered is a typo and raises ValueError at once,
    listing the registered names.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"use_implementation takes a name or None, got {name=!r}")
    if name is not None:
        check_name(name, "use_implementation:")
    stack = _stack()
    stack.append((name, strict))
    try:
        yield
    finally:
        stack.pop()


def _stack() -> list[tuple[str | None, bool]]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def _preference(implementation: str | None) -> tuple[str | None, str, bool]:
    """(name, source, strict) of the implementation asked for, if any."""
    if implementation is not None:
        if not isinstance(implementation, str):
            raise TypeError(f"implementation must be a name or None, got {implementation=!r}")
        return implementation, "call", True
    stack = _stack()
    if stack:
        name, strict = stack[-1]
        return name, "context", strict
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        check_name(env, f"{ENV_VAR}=")
        return env, "env", False
    return None, "auto", False


def current_preference() -> tuple[str | None, str, bool]:
    """The implementation preference in force here: ``(name, source, strict)``.

    ``source`` is "context" (:func:`use_implementation`), "env"
    (``FORGE_JAX_IMPLEMENTATION``) or "auto" (``name`` None). Since ops choose their
    implementation when traced, a cache of compiled functions should key on this.
    """
    return _preference(None)


def check(impl: Implementation, args: Mapping[str, Any], platform: str) -> str | None:
    """``None`` if ``impl`` can serve ``args`` on ``platform``, else the reason why not.

    Under :func:`forge_jax.sharding.use_mesh` an op with a partition rule runs per shard,
    so ``supports`` sees the shapes one shard computes.
    """
    return impl.check(sharding.local_args(registry.partition_rule(impl.op), args), platform)


def platform_of(args: Mapping[str, Any]) -> str:
    """The platform the op will run on: inside ``fj.targets.use``, the target's; else that
    of its committed inputs, else the default."""
    if targets.current() is not None:
        return targets.platform()
    for value in args.values():
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            try:
                if value.committed:
                    return next(iter(value.devices())).platform
            except Exception:  # Deleted or abstract arrays: fall through.
                pass
    return targets.platform()


def _measured(impls: Mapping[str, Implementation], args: Mapping[str, Any], platform: str,
              rejected: dict[str, str]) -> Implementation | None:
    """The measured winner for these arguments (:func:`forge_jax.autotune`'s file), bound
    to its configuration, if one is stored and can serve them; records in ``rejected`` why
    the others do not run. None otherwise (auto selection then goes by priority)."""
    if not impls:
        return None
    op = next(iter(impls.values())).op
    try:
        entry = autotune_cache.lookup(op, args, platform)
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
    reason = check(impl, args, platform)
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


def _auto(
    impls: Mapping[str, Implementation], args: Mapping[str, Any], platform: str,
    rejected: dict[str, str],
) -> tuple[Implementation | None, bool]:
    """The first supported implementation in priority order, and whether one ranked
    above it was rejected (a fallback). Records in ``rejected`` why every other
    implementation does not run, so that :func:`explain` accounts for all of them."""
    measured = _measured(impls, args, platform, rejected)  # fj.autotune's winner goes first
    if measured is not None:
        return measured, False
    for impl in impls.values():
        if platform in impl.priority and impl.unverified(platform):
            reason = check(impl, args, platform)
            rejected.setdefault(impl.name, (
                f"not yet verified on a {platform.upper()} (runs by name; ranked automatically "
                "once compiled, checked and measured faster there)"
                + (f"; it could not serve these arguments anyway: {reason}" if reason else "")))
    ranked = sorted(
        (impl for impl in impls.values() if impl.ranked(platform)),
        key=lambda impl: -impl.priority[platform],
    )
    chosen, fell_back = None, False
    for impl in ranked:
        if chosen is not None:
            rejected.setdefault(impl.name, f"lower priority on {platform} than {chosen.name!r}")
            continue
        reason = check(impl, args, platform)
        if reason is None:
            chosen = impl
        else:
            rejected.setdefault(impl.name, reason)
            fell_back = True
    for impl in impls.values():
        if platform not in impl.priority and impl.name not in rejected:
            rejected[impl.name] = f"not chosen automatically on {platform} (ask for it by name)"
    return chosen, fell_back


def select(op: str, args: Mapping[str, Any], implementation: str | None = None, *,
           platform: str | None = None) -> Selection:
    """Chooses the implementation of ``op`` for ``args`` without running it.

    ``platform``: choose as if on that platform (default: that of ``args``' committed
    arrays, else JAX's default backend), e.g. to see what a GPU would run.
    """
    return _select(op, args, implementation, platform)[1]


def _select(
    op: str, args: Mapping[str, Any], implementation: str | None, platform: str | None = None,
) -> tuple[Implementation, Selection]:
    try:
        variants = registry.registrations(op)
    except KeyError:
        raise KeyError(f"no implementation registered for op {op!r}") from None
    platform = platform or platform_of(args)
    impls = {v.name: v for v in variants if v.serves(platform)}
    registered = sorted({v.name for v in variants})
    name, source, strict = _preference(implementation)
    rejected: dict[str, str] = {}
    if name is not None:
        impl = impls.get(name)
        if impl is None and name in registered:
            served = sorted(p for v in variants if v.name == name for p in (v.platforms or ()))
            reason = f"{op!r} implementation {name!r} serves {served}, not {platform}"
        elif impl is None:
            reason = (f"{op!r} has no implementation {name!r} "
                      f"(registered: {registered})")
        else:
            reason = check(impl, args, platform)
        if reason is None:
            return impl, Selection(op, name, platform, source, rejected)
        if strict:
            raise ImplementationError(
                f"implementation {name!r} asked for by {_SOURCES[source]} cannot run {op!r} "
                f"on {platform}: {reason}"
            )
        rejected[name] = reason
    preference_rejected = bool(rejected)
    chosen, fell_back = _auto(impls, args, platform, rejected)
    if chosen is None:
        raise ImplementationError(
            f"no implementation of {op!r} can serve these arguments on {platform}: {rejected}"
        )
    selection = Selection(op, chosen.name, platform, "auto" if name is None else
                          f"auto, {source} preference {name!r} rejected", rejected)
    if fell_back or preference_rejected:
        logger.debug("%s", selection)
    return chosen, selection


_SOURCES = {
    "call": "implementation=",
    "context": "use_implementation(strict=True)",
    "env": ENV_VAR,
}


def call(op: str, args: Mapping[str, Any], implementation: str | None = None) -> Any:
    """Selects an implementation of ``op`` for ``args`` and calls it with ``**args``."""
    impl, selection = _select(op, args, implementation)
    _LAST[op] = selection
    # On a mesh (forge_jax.sharding.use_mesh), ops with a partition rule run per shard.
    return sharding.per_shard(registry.partition_rule(op), impl.fn, args)()


def last_selection(op: str) -> Selection | None:
    """The selection made by the most recent (traced or eager) call of ``op``."""
    return _LAST.get(op)


def last_selections() -> Mapping[str, Selection]:
    """The most recent selection of every op called (or traced) so far in this process,
    or since the last :func:`clear_selections`."""
    return dict(_LAST)


def clear_selections() -> None:
    """Forgets the recorded selections, e.g. before a run whose ops you want to report."""
    _LAST.clear()


def define(op: str, binder: Callable[..., dict[str, Any]], *,
           partition: registry.PartitionRule | None = None) -> registry.Op:
    """Declares public op ``op``: ``binder(*args, **kwargs)`` validates its arguments, and
    ``partition`` says how they split over a mesh (see :mod:`forge_jax.sharding`)."""
    return registry.define(op, binder, partition=partition)


def bind(op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The mapping implementations of ``op`` receive for this call, validated as the op
    validates it (the public op minus the dispatch)."""
    return registry.op_record(op).bind(*args, **kwargs)


def explain(op: str, *args: Any, implementation: str | None = None, **kwargs: Any) -> Selection:
    """Which implementation of ``op`` would run for these arguments, and why not the others.

    Takes the op's arguments exactly as the op does, e.g.
    ``fj.explain("rms_norm", x, w, eps=1e-5)``; validates them as the op would.
    """
    return select(op, bind(op, *args, **kwargs), implementation)
