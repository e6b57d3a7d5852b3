"""The registry: one record per op and one record per implementation.

Everything forge_jax knows about an op or an implementation is written once, in its
record, and read from there by dispatch (:mod:`forge_jax.dispatch`), autotuning
(:mod:`forge_jax.autotuning`), sharding (the op's partition rule), :func:`forge_jax.explain`,
``forge-jax info`` (:func:`forge_jax.backends.summary`) and the benchmarks.

* :class:`Op`: a public op: its name, the binder that validates a call's arguments into
  the mapping implementations receive, and its partition rule (how its arrays split over
  a device mesh, see :mod:`forge_jax.sharding`). Declared by the op's module with
  :func:`define`.
* :class:`Implementation`: one way to compute an op: the function, ``supports`` (the
  contract with its lowering), ``available`` (whether its toolchain works here), its
  priority per platform, the platforms it serves, where it was verified, and the launch
  configurations autotuning may time. Declared with :func:`register` (the ops' XLA
  implementations) or built by a kernel module's ``register`` helper
  (:mod:`forge_jax.pallas_kernels._registration`) and added with :func:`add`.

This module imports nothing of forge_jax: every other module depends on it, never the
other way. The records are the only module-level mutable state of forge_jax besides the
user's implementation override (:func:`forge_jax.use_implementation`) and caches of
derived values (the last selections, the autotune file as last read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from forge_jax import targets

logger = logging.getLogger("forge_jax.registry")

SupportsFn = Callable[[Mapping[str, Any], str], "str | None"]
AvailableFn = Callable[[], "str | None"]
# configs(args) -> keyword dicts the implementation takes besides the op's arguments.
ConfigsFn = Callable[[Mapping[str, Any]], Sequence[Mapping[str, Any]]]
# partition(args, mesh_config) -> (in_specs by argument name, out_specs).
PartitionRule = Callable[[Mapping[str, Any], Any], tuple[dict[str, Any], Any]]


def _always(args: Mapping[str, Any], platform: str) -> None:
    del args, platform
    return None


def _always_available() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Op:
    """A public op.

    Attributes:
      name: the op's public name, e.g. ``"paged_attention"``.
      bind: ``bind(*args, **kwargs) -> dict``: validates a call's arguments exactly as
        the public function does and returns the mapping implementations receive.
      partition: ``partition(args, mesh_config) -> (in_specs, out_specs)``: how the op's
        arrays split over a mesh under :func:`forge_jax.sharding.use_mesh` (``None``: the
        op runs unsplit).
    """

    name: str
    bind: Callable[..., dict[str, Any]]
    partition: PartitionRule | None = None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op: everything about it, in one record.

    Attributes:
      op, name: the op and the implementation's name (``"xla"``, ``"pallas"``, ...).
      fn: ``fn(**args, **config)`` computes the op; ``args`` as bound by the op.
      supports: ``supports(args, platform) -> None | reason``; ``args`` may hold tracers
        (use shapes and dtypes). The contract with the real lowering: every case it
        accepts must compile there.
      available: ``available() -> None | reason``: whether its toolchain works here.
      priority: platform -> priority for auto selection, higher first; empty: only ever
        run by name.
      description: one line for ``forge-jax info``.
      platforms: the platforms this registration serves (``None``: every platform). One
        name may be registered several times for disjoint platforms (``"pallas"`` is the
        Triton kernel on GPU and the Mosaic kernel on TPU).
      verified: for hand-written kernels, platform -> where the kernel was compiled,
        checked and measured faster than XLA (device, JAX version, date). Given, auto
        selection ranks the kernel only on platforms with a record; ``None`` (XLA, or
        library calls) ranks it wherever ``priority`` names the platform.
      configs: the launch configurations :func:`forge_jax.autotune` times besides the
        implementation's defaults (``None``: only the defaults).
    """

    op: str
    name: str
    fn: Callable[..., Any]
    supports: SupportsFn = _always
    available: AvailableFn = _always_available
    priority: Mapping[str, int] = dataclasses.field(default_factory=dict)
    description: str = ""
    platforms: frozenset[str] | None = None
    verified: Mapping[str, str] | None = None
    configs: ConfigsFn | None = None

    def __post_init__(self):
        if self.platforms is not None and not isinstance(self.platforms, frozenset):
            object.__setattr__(self, "platforms", frozenset(self.platforms))
        if self.priority and self.platforms is not None and set(self.priority) - self.platforms:
            raise ValueError(f"{self.op!r}/{self.name!r}: priority names platforms it does "
                             f"not serve: priority={dict(self.priority)}, "
                             f"platforms={sorted(self.platforms)}")

    def serves(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms

    def unverified(self, platform: str) -> bool:
        """Whether this is a kernel that still waits for a verification on ``platform``."""
        return self.verified is not None and platform not in self.verified

    def ranked(self, platform: str) -> bool:
        """Whether auto selection may choose it on ``platform`` (by priority)."""
        return platform in self.priority and not self.unverified(platform)

    def check(self, args: Mapping[str, Any], platform: str) -> str | None:
        """``None`` if it can serve ``args`` on ``platform``, else the reason why not. A
        probe that raises is a reason too, never a crash."""
        try:
            return self.available() or self.supports(args, platform)
        except Exception as e:
            return f"its supports/available check raised {type(e).__name__}: {e}"

    def candidate_configs(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The configurations autotuning times: the defaults (``{}``) first, then
        :attr:`configs`, without repeats."""
        out: list[dict[str, Any]] = [{}]
        for config in (self.configs(args) if self.configs is not None else ()):
            if dict(config) not in out:
                out.append(dict(config))
        return out


# op name -> its record; op name -> implementation name -> its registrations (one per set
# of platforms).
_OPS: dict[str, Op] = {}
_IMPLEMENTATIONS: dict[str, dict[str, tuple[Implementation, ...]]] = {}
_PLUGINS_LOADED = False


def define(op: str, bind: Callable[..., dict[str, Any]], *,
           partition: PartitionRule | None = None) -> Op:
    """Declares public op ``op``: its binder and its partition rule."""
    record = Op(op, bind, partition)
    _OPS[op] = record
    return record


def op_record(op: str) -> Op:
    """The record of public op ``op``."""
    try:
        return _OPS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(_OPS)}") from None


def partition_rule(op: str) -> PartitionRule | None:
    """The partition rule of ``op`` (``None`` for an op without one, or not declared)."""
    record = _OPS.get(op)
    return None if record is None else record.partition


def add(impl: Implementation, *, replace: bool = False) -> Implementation:
    """Adds an implementation record. Registrations of one name must not overlap in
    platforms unless ``replace`` (tests, user overrides)."""
    impls = _IMPLEMENTATIONS.setdefault(impl.op, {})
    existing = impls.get(impl.name, ())
    clash = [i for i in existing
             if i.platforms is None or impl.platforms is None or i.platforms & impl.platforms]
    if clash and not replace:
        raise ValueError(f"implementation {impl.name!r} of op {impl.op!r} is already registered"
                         + ("" if impl.platforms is None else f" for {sorted(impl.platforms)}"))
    impls[impl.name] = tuple(i for i in existing if i not in clash) + (impl,)
    return impl


def register(
    op: str,
    name: str,
    *,
    priority: Mapping[str, int] | None = None,
    supports: SupportsFn | None = None,
    available: AvailableFn | None = None,
    description: str = "",
    platforms: Sequence[str] | None = None,
    verified: Mapping[str, str] | None = None,
    configs: ConfigsFn | None = None,
    replace: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: adds ``fn`` as implementation ``name`` of ``op`` (the fields of
    :class:`Implementation`); returns ``fn`` unchanged."""
    record = _record_factory(
        op=op, name=name, supports=supports or _always,
        available=available or _always_available, priority=dict(priority or {}),
        description=description, platforms=None if platforms is None else frozenset(platforms),
        verified=None if verified is None else dict(verified), configs=configs)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        add(record(fn=fn), replace=replace)
        return fn

    return decorator


def _record_factory(**fields: Any) -> Callable[..., Implementation]:
    """``Implementation`` with ``fields`` given now and ``fn`` later; the fields are checked
    at once (a bad priority fails at the decorator, not at the call)."""
    Implementation(fn=_always, **fields)
    return lambda fn: Implementation(fn=fn, **fields)


def unregister(op: str, name: str) -> None:
    """Removes implementation ``name`` of ``op`` (for tests and user overrides)."""
    try:
        del _IMPLEMENTATIONS[op][name]
    except KeyError:
        raise KeyError(f"no implementation {name!r} registered for op {op!r}") from None


# Importing Pallas' fuser defines a JAX config that is part of every jit's cache key (JAX
# 0.11 and 0.12). ``load_plugins`` runs at the first dispatch, inside the first traced
# function: imported only then, the key changes under that function, and everything it
# compiled compiled again at the next call (``generate``'s second call: 14 programs). Imported
# here, with ``forge_jax``, the key is the same before and after (tests/test_generate.py).
with contextlib.suppress(ImportError):  # an older JAX without it (nor the config)
    importlib.import_module("jax.experimental.pallas.fuser")


def load_plugins() -> None:
    """Imports ``forge_jax.pallas_kernels`` once, so that its kernels add their records."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    try:
        importlib.import_module("forge_jax.pallas_kernels")
    except ImportError as e:  # Only the XLA implementations then; say so once.
        logger.debug("pallas_kernels not importable, XLA implementations only: %s", e)


def ops() -> tuple[str, ...]:
    """The names of all ops with at least one registered implementation."""
    load_plugins()
    return tuple(sorted(op for op, impls in _IMPLEMENTATIONS.items() if impls))


def _variants(op: str) -> dict[str, tuple[Implementation, ...]]:
    load_plugins()
    if not _IMPLEMENTATIONS.get(op):
        raise KeyError(f"unknown op {op!r}; known ops: {sorted(_IMPLEMENTATIONS)}")
    return _IMPLEMENTATIONS[op]


def implementations(op: str, platform: str | None = None) -> Mapping[str, Implementation]:
    """The implementations of ``op`` that serve ``platform`` (default: JAX's default
    backend), by name."""
    platform = platform or targets.platform()
    return {name: v for name, variants in _variants(op).items()
            for v in variants if v.serves(platform)}


def registrations(op: str, name: str | None = None) -> tuple[Implementation, ...]:
    """Every registration of ``op`` (of implementation ``name`` only, when given), on
    every platform."""
    return tuple(v for n, variants in _variants(op).items() if name in (None, n)
                 for v in variants)


def names() -> tuple[str, ...]:
    """Every implementation name some op has registered (on any platform)."""
    load_plugins()
    return tuple(sorted({name for impls in _IMPLEMENTATIONS.values() for name in impls}))


def check_name(name: str, what: str = "implementation") -> None:
    """Raises ValueError if no op has registered an implementation called ``name``
    (a typo: a name some ops lack is a preference, and they fall back)."""
    known = names()
    if name not in known:
        raise ValueError(f"{what} {name!r} is not registered by any op; "
                         f"registered: {', '.join(known)}")
