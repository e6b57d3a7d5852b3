"""The implementation registry: which function computes an op, and why.

Every public op is a thin wrapper that validates its arguments and then calls
:func:`call`, which picks an implementation *at trace time* and calls it. An
implementation is a plain function registered under ``(op, name)`` together with

* ``supports(args, platform) -> None | str``: ``None`` when it can serve these
  arguments on that platform, otherwise the reason why not;
* ``available() -> None | str``: ``None`` when its toolchain is usable in this
  process at all (used by :func:`forge_jax.backends.summary`);
* ``priority``: a mapping ``platform -> int``. Auto selection tries the
  implementations that name the platform, highest priority first. An
  implementation that names no platform (e.g. ``"pallas_gpu_interpret"``) is only
  ever used when asked for by name;
* ``platforms``: the platforms this registration serves (``None``: any). One name
  may be registered several times for disjoint platforms: ``"pallas"`` is the
  Triton kernel on ``"gpu"`` and the Mosaic kernel on ``"tpu"``, each with its own
  ``supports``;
* ``verified``: for hand-written kernels, a mapping ``platform -> record`` of where
  the kernel was compiled, checked and measured faster than XLA (device, JAX
  version, date). With ``verified`` given, auto selection ranks the kernel on a
  platform only once that platform has a record; until then it runs by name and
  :func:`explain` says it is not yet verified there.

Which implementation runs, most specific first:

1. ``implementation=`` on the call: strict. If it cannot serve the arguments,
   :class:`ImplementationError` says why.
2. :func:`use_implementation` (innermost block wins), then the
   ``FORGE_JAX_IMPLEMENTATION`` environment variable: a preference. Ops that have
   no implementation of that name, or whose implementation of that name cannot
   serve the arguments, fall back to auto selection and record the reason, so a
   model with ops that have no kernel still runs inside ``use_implementation("pallas")``.
   ``use_implementation(name, strict=True)`` makes the preference strict.
3. Auto: the first supported implementation in priority order for the platform.

Kernels register from ``pallas_kernels`` (imported lazily on the first dispatch);
the ops never import a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from forge_jax import sharding

logger = logging.getLogger("forge_jax.dispatch")

ENV_VAR = "FORGE_JAX_IMPLEMENTATION"

SupportsFn = Callable[[Mapping[str, Any], str], "str | None"]
AvailableFn = Callable[[], "str | None"]


class ImplementationError(ValueError):
    """An implementation asked for by name cannot serve the call."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    fn: Callable[..., Any]
    supports: SupportsFn
    available: AvailableFn
    priority: Mapping[str, int]
    description: str = ""
    platforms: frozenset[str] | None = None
    verified: Mapping[str, str] | None = None

    def serves(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms


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


def _always(args: Mapping[str, Any], platform: str) -> None:
    del args, platform
    return None


def _always_available() -> None:
    return None


# The registry: op name -> implementation name -> its registrations (one per set of
# platforms). Together with the user's override below, the only module-level mutable
# state in forge_jax.
_REGISTRY: dict[str, dict[str, tuple[Implementation, ...]]] = {}
# The last selection made for each op (inspectable; e.g. the CLI reports it).
_LAST: dict[str, Selection] = {}
# op name -> the function that validates a call's arguments into the mapping
# implementations receive (the public op minus the dispatch), for explain().
_BINDERS: dict[str, Callable[..., dict[str, Any]]] = {}
_LOCAL = threading.local()
_PLUGINS_LOADED = False


def register(
    op: str,
    name: str,
    *,
    priority: Mapping[str, int] | None = None,
    supports: SupportsFn | None = None,
    available: AvailableFn | None = None,
    description: str = "",
    platforms: tuple[str, ...] | None = None,
    verified: Mapping[str, str] | None = None,
    replace: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as implementation ``name`` of ``op``.

    Args:
      op: the op's public name, e.g. ``"rms_norm"``.
      name: the implementation's name, e.g. ``"xla"``, ``"pallas"``.
      priority: platform -> priority for auto selection; higher runs first.
        ``None`` or empty: never chosen automatically, only by name.
      supports: ``supports(args, platform) -> None | reason``; ``args`` is the
        mapping of the op's arguments (arrays may be tracers: use shapes and dtypes).
      available: ``available() -> None | reason``, whether the toolchain works here.
      description: one line for :func:`forge_jax.backends.summary`.
      platforms: the platforms this registration serves; ``None``: every platform.
        Registrations of one name must not overlap.
      verified: platform -> where the kernel was verified (device, JAX version,
        date). Given, auto selection ranks it only on platforms with a record.
      replace: allow replacing an existing registration (tests, user overrides).
    """
    served = None if platforms is None else frozenset(platforms)
    if priority and served is not None and set(priority) - served:
        raise ValueError(f"{op!r}/{name!r}: priority names platforms it does not serve: "
                         f"{priority=}, {platforms=}")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        impls = _REGISTRY.setdefault(op, {})
        existing = impls.get(name, ())
        clash = [i for i in existing
                 if i.platforms is None or served is None or i.platforms & served]
        if clash and not replace:
            raise ValueError(f"implementation {name!r} of op {op!r} is already registered"
                             + ("" if served is None else f" for {sorted(served)}"))
        impls[name] = tuple(i for i in existing if i not in clash) + (Implementation(
            op=op,
            name=name,
            fn=fn,
            supports=supports or _always,
            available=available or _always_available,
            priority=dict(priority or {}),
            description=description,
            platforms=served,
            verified=None if verified is None else dict(verified),
        ),)
        return fn

    return decorator


def unregister(op: str, name: str) -> None:
    """Removes implementation ``name`` of ``op`` (for tests and user overrides)."""
    try:
        del _REGISTRY[op][name]
    except KeyError:
        raise KeyError(f"no implementation {name!r} registered for op {op!r}") from None


def ops() -> tuple[str, ...]:
    """The names of all ops with at least one registered implementation."""
    _load_plugins()
    return tuple(sorted(_REGISTRY))


def implementations(op: str, platform: str | None = None) -> Mapping[str, Implementation]:
    """The implementations of ``op`` that serve ``platform`` (default: JAX's default
    backend), by name."""
    _load_plugins()
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(_REGISTRY)}")
    platform = platform or jax.default_backend()
    return {name: v for name, variants in _REGISTRY[op].items()
            for v in variants if v.serves(platform)}


def registrations(op: str) -> tuple[Implementation, ...]:
    """Every registration of ``op``, on every platform."""
    _load_plugins()
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(_REGISTRY)}")
    return tuple(v for variants in _REGISTRY[op].values() for v in variants)


def names() -> tuple[str, ...]:
    """Every implementation name some op has registered (on any platform)."""
    _load_plugins()
    return tuple(sorted({name for impls in _REGISTRY.values() for name in impls}))


def check_name(name: str, what: str = "implementation") -> None:
    """Raises ValueError if no op has registered an implementation called ``name``
    (a typo: a name some ops lack is a preference, and they fall back)."""
    known = names()
    if name not in known:
        raise ValueError(f"{what} {name!r} is not registered by any op; "
                         f"registered: {', '.join(known)}")


def _load_plugins() -> None:
    """Imports ``pallas_kernels`` once so that its kernels register themselves."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    try:
        importlib.import_module("forge_jax.pallas_kernels")
    except ImportError as e:  # Only the XLA implementations then; say so once.
        logger.debug("pallas_kernels not importable, XLA implementations only: %s", e)


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


def _check(impl: Implementation, args: Mapping[str, Any], platform: str) -> str | None:
    """``None`` if ``impl`` can serve ``args`` on ``platform``, else the reason why not.

    Under :func:`forge_jax.sharding.use_mesh` an op with a partition rule runs per shard,
    so ``supports`` sees the shapes one shard computes. A probe that raises is a reason
    too: dispatch reports it instead of crashing.
    """
    try:
        return impl.available() or impl.supports(sharding.local_args(impl.op, args), platform)
    except Exception as e:
        return f"its supports/available check raised {type(e).__name__}: {e}"


def _platform(args: Mapping[str, Any]) -> str:
    """The platform the op will run on: that of its committed inputs, else the default."""
    for value in args.values():
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            try:
                if value.committed:
                    return next(iter(value.devices())).platform
            except Exception:  # Deleted or abstract arrays: fall through.
                pass
    return jax.default_backend()


def _unverified(impl: Implementation, platform: str) -> bool:
    return impl.verified is not None and platform not in impl.verified


def _auto(
    impls: Mapping[str, Implementation], args: Mapping[str, Any], platform: str,
    rejected: dict[str, str],
) -> tuple[Implementation | None, bool]:
    """The first supported implementation in priority order, and whether one ranked
    above it was rejected (a fallback). Records in ``rejected`` why every other
    implementation does not run, so that :func:`explain` accounts for all of them."""
    for impl in impls.values():
        if platform in impl.priority and _unverified(impl, platform):
            reason = _check(impl, args, platform)
            rejected.setdefault(impl.name, (
                f"not yet verified on a {platform.upper()} (runs by name; ranked automatically "
                "once compiled, checked and measured faster there)"
                + (f"; it could not serve these arguments anyway: {reason}" if reason else "")))
    ranked = sorted(
        (impl for impl in impls.values()
         if platform in impl.priority and not _unverified(impl, platform)),
        key=lambda impl: -impl.priority[platform],
    )
    chosen, fell_back = None, False
    for impl in ranked:
        if chosen is not None:
            rejected.setdefault(impl.name, f"lower priority on {platform} than {chosen.name!r}")
            continue
        reason = _check(impl, args, platform)
        if reason is None:
            chosen = impl
        else:
            rejected.setdefault(impl.name, reason)
            fell_back = True
    for impl in impls.values():
        if platform not in impl.priority and impl.name not in rejected:
            rejected[impl.name] = f"not chosen automatically on {platform} (ask for it by name)"
    return chosen, fell_back


def select(op: str, args: Mapping[str, Any], implementation: str | None = None) -> Selection:
    """Chooses the implementation of ``op`` for ``args`` without running it."""
    return _select(op, args, implementation)[1]


def _select(
    op: str, args: Mapping[str, Any], implementation: str | None
) -> tuple[Implementation, Selection]:
    _load_plugins()
    if not _REGISTRY.get(op):
        raise KeyError(f"no implementation registered for op {op!r}")
    platform = _platform(args)
    impls = {name: v for name, variants in _REGISTRY[op].items()
             for v in variants if v.serves(platform)}
    name, source, strict = _preference(implementation)
    rejected: dict[str, str] = {}
    if name is not None:
        impl = impls.get(name)
        if impl is None and name in _REGISTRY[op]:
            served = sorted(p for v in _REGISTRY[op][name] for p in (v.platforms or ()))
            reason = f"{op!r} implementation {name!r} serves {served}, not {platform}"
        elif impl is None:
            reason = (f"{op!r} has no implementation {name!r} "
                      f"(registered: {sorted(_REGISTRY[op])})")
        else:
            reason = _check(impl, args, platform)
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
    return sharding.per_shard(op, impl.fn, args)()


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


def define(op: str, binder: Callable[..., dict[str, Any]]) -> None:
    """Declares public op ``op`` whose arguments ``binder(*args, **kwargs)`` validates."""
    _BINDERS[op] = binder


def explain(op: str, *args: Any, implementation: str | None = None, **kwargs: Any) -> Selection:
    """Which implementation of ``op`` would run for these arguments, and why not the others.

    Takes the op's arguments exactly as the op does, e.g.
    ``fj.explain("rms_norm", x, w, eps=1e-5)``; validates them as the op would.
    """
    if op not in _BINDERS:
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(_BINDERS)}")
    return select(op, _BINDERS[op](*args, **kwargs), implementation)
