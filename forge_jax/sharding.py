"""Running forge_jax on a device mesh: the mesh and its axis roles, and ops per shard.

forge_jax uses JAX's own sharding (``jax.sharding.Mesh``, ``NamedSharding``,
``jax.shard_map``); nothing here communicates by itself. Two roles name mesh axes:

* the *tensor* axis (``tp_axis``, default ``"tp"``): attention heads, the MLP's
  intermediate dimension and the vocabulary are split across it;
* the *data* axis (``dp_axis``, default ``"dp"``): the batch is split across it.

A :class:`MeshConfig` holds a mesh and those two names. Inside
``with use_mesh(config):`` every op with a partition rule (the attention family, the
paged cache writes, RMSNorm, RoPE, SiLU-mul) runs *per shard* through one
``jax.shard_map`` built here, whatever implementation dispatch chose: batch over the
data axis, heads (or the feature axis) over the tensor axis, each device computing
its own slice with no communication. A Pallas kernel, which has no partitioning rule
of its own in XLA, therefore sees only its shard's shapes, and the XLA attention's
finiteness check stays local to the shard instead of becoming a cross-device reduction.
Ops without a rule (``matmul``, ``embedding``, ``softmax``, ``paged_gather``) are left to
XLA's sharding propagation; a product with a quantized weight (``quantized_matmul``) has
one, read from where the weight was placed (:func:`forge_jax.quant.place`), since XLA
cannot split its dequantize-in-blocks loop by itself. A rule may give a pytree argument
(a :class:`~forge_jax.quant.QuantizedArray`) one spec per array; inside the shard it is
given its shard's block (``shard_local``).

The model-level rules (which weight is split along which axis) live with the model:
:mod:`forge_jax.models.llama_sharding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from forge_jax import _compat, registry

__all__ = [
    "MeshConfig", "Summed", "current", "make_mesh", "parse_mesh", "per_shard", "put",
    "use_mesh",
]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A device mesh and the roles of its axes.

    Attributes:
      mesh: a ``jax.sharding.Mesh`` whose axes are ``tp_axis`` and/or ``dp_axis``
        (an axis of size 1 may be left out). Meshes with explicit axis types are
        rebuilt with automatic ones (forge_jax relies on sharding propagation).
      tp_axis: the tensor-parallel axis's name.
      dp_axis: the data-parallel axis's name.
    """

    mesh: Mesh
    tp_axis: str = "tp"
    dp_axis: str = "dp"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {self.mesh!r:.80}")
        for name in ("tp_axis", "dp_axis"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.tp_axis == self.dp_axis:
            raise ValueError(f"tp_axis and dp_axis must differ, both are {self.tp_axis!r}")
        others = [a for a in self.mesh.axis_names if a not in (self.tp_axis, self.dp_axis)]
        if others:
            raise ValueError(
                f"mesh axes {others} are neither tp_axis={self.tp_axis!r} nor "
                f"dp_axis={self.dp_axis!r} (mesh axis_names={self.mesh.axis_names}); name the "
                f"roles with tp_axis= / dp_axis=")
        if any(t != jax.sharding.AxisType.Auto for t in self.mesh.axis_types):
            object.__setattr__(self, "mesh", Mesh(self.mesh.devices, self.mesh.axis_names))

    @property
    def tp(self) -> int:
        """The size of the tensor axis (1 if the mesh has none)."""
        return self.mesh.shape.get(self.tp_axis, 1)

    @property
    def dp(self) -> int:
        """The size of the data axis (1 if the mesh has none)."""
        return self.mesh.shape.get(self.dp_axis, 1)

    @property
    def tp_name(self) -> str | None:
        """The tensor axis for a PartitionSpec, None if the mesh lacks it or it has size 1."""
        return self.tp_axis if self.tp > 1 else None

    @property
    def dp_name(self) -> str | None:
        """The data axis for a PartitionSpec, None if the mesh lacks it or it has size 1."""
        return self.dp_axis if self.dp > 1 else None

    def sharding(self, *spec: str | None) -> NamedSharding:
        """``NamedSharding(mesh, PartitionSpec(*spec))``."""
        return NamedSharding(self.mesh, P(*spec))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch_axis(self, batch: int) -> str | None:
        """The data axis if ``batch`` splits evenly across it, else None (replicated)."""
        return self.dp_name if self.dp_name and batch % self.dp == 0 else None

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())


def parse_mesh(spec: str) -> dict[str, int]:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}`` (the CLI's ``--mesh``); errors name the text."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a mesh is written like 'tp=4' or 'dp=2,tp=4', got {spec!r}")
    axes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, size = part.strip().partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit():
            raise ValueError(f"a mesh is written like 'tp=4' or 'dp=2,tp=4', got {spec!r}")
        if name in axes:
            raise ValueError(f"mesh {spec!r} names axis {name!r} twice")
        if int(size) < 1:
            raise ValueError(f"mesh {spec!r}: axis {name!r} must have size >= 1")
        axes[name] = int(size)
    return axes


def make_mesh(axes: Mapping[str, int] | str, devices=None) -> Mesh:
    """A mesh with automatic axis types over the first ``prod(sizes)`` devices.

    Args:
      axes: ``{"dp": 2, "tp": 4}`` (in mesh order, the last axis fastest) or the same
        as text, ``"dp=2,tp=4"``.
      devices: the devices to use (default: ``jax.devices()``, every process's).

    Raises:
      ValueError: malformed axes, or more devices asked for than there are.
    """
    if isinstance(axes, str):
        axes = parse_mesh(axes)
    axes = dict(axes)
    if not axes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                       for n in axes.values()):
        raise ValueError(f"axes must map axis names to sizes >= 1, got {axes!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(axes.values())
    if need > len(devices):
        raise ValueError(f"a mesh {axes} needs {need} devices; only {len(devices)} available "
                         f"({devices[0].platform if devices else 'none'})")
    grid = np.asarray(devices[:need], dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes))


def put(value: Any, sharding: NamedSharding) -> jax.Array:
    """A host value (the same on every process) as a global array with ``sharding``.

    Each device receives only its slice, and only addressable devices are asked for:
    this works unchanged when the mesh spans several processes.
    """
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# ---------------------------------------------------------------------------------------
# The active mesh: the one place ops learn they run on a mesh.

_LOCAL = threading.local()


@contextlib.contextmanager
def use_mesh(config: MeshConfig | Mesh | None, *, tp_axis: str = "tp",
             dp_axis: str = "dp") -> Iterator[MeshConfig | None]:
    """Ops traced inside the block run per shard on this mesh (see the module docstring).

    Accepts a :class:`MeshConfig`, or a ``Mesh`` with the axis roles given here;
    ``None`` turns per-shard execution off inside the block. Like
    ``forge_jax.use_implementation``, it applies when a function is traced: a jitted
    function keys its cache on its arguments, so trace it inside the block.
    """
    if isinstance(config, Mesh):
        config = MeshConfig(config, tp_axis=tp_axis, dp_axis=dp_axis)
    elif config is not None and not isinstance(config, MeshConfig):
        raise TypeError(f"use_mesh takes a MeshConfig, a Mesh or None, got {config!r:.80}")
    stack = _stack()
    stack.append(config)
    try:
        yield config
    finally:
        stack.pop()


def _stack() -> list[MeshConfig | None]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def current() -> MeshConfig | None:
    """The mesh ops run on per shard here (``None``: no mesh, or inside a shard)."""
    if getattr(_LOCAL, "inside", False):
        return None
    stack = _stack()
    config = stack[-1] if stack else None
    return config if config is not None and config.mesh.size > 1 else None


# ---------------------------------------------------------------------------------------
# Partition rules: for each op, how its array arguments split over the mesh. Each op's rule
# lives beside the op (its module passes it to ``dispatch.define(..., partition=...)``).
#
# A rule maps the op's argument mapping and the mesh config to (in_specs by argument
# name, out_specs). It splits only dimensions an op computes independently along (batch
# rows, attention heads, elementwise features) and only where the size divides the axis,
# so per-shard results are exactly the global result's slices.

Specs = tuple[dict[str, P], Any]


@dataclasses.dataclass(frozen=True)
class Summed:
    """An out spec for a result each shard holds a part of, as a sum: the op's result is
    the sum of the shards' results over mesh axis ``axis`` (a ``psum``), laid out as
    ``spec``. E.g. ``grouped_matmul`` with its groups split: each device multiplies the
    rows of its own groups, the others' rows are zero there."""

    spec: P
    axis: str
Rule = Callable[[Mapping[str, Any], MeshConfig], Specs]


def divisible(config: MeshConfig, axis: str | None, *sizes: int) -> str | None:
    """``axis`` if every size divides over it, else None (that dimension is not split)."""
    if axis is None:
        return None
    n = config.mesh.shape[axis]
    return axis if all(s % n == 0 for s in sizes) else None


def heads_axis(config: MeshConfig, q_heads: int, kv_heads: int) -> str | None:
    """The tensor axis if both head counts split across it (GQA groups stay whole)."""
    return divisible(config, config.tp_name, q_heads, kv_heads)


def has_rule(op: str) -> bool:
    """Whether ``op`` runs per shard under :func:`use_mesh` (it declared a partition rule)."""
    return registry.partition_rule(op) is not None


def per_shard(rule: Rule | None, fn: Callable[..., Any], args: Mapping[str, Any]
              ) -> Callable[[], Any]:
    """``fn(**args)`` as a thunk, run per shard by ``rule`` when a mesh is active (as is
    without a mesh, or without a rule).

    The one place where forge_jax's ops meet ``jax.shard_map``: dispatch calls it for
    every op, so a kernel needs nothing of its own to run on a mesh.
    """
    config = current()
    if config is None or rule is None:
        return lambda: fn(**args)
    specs, out_specs = rule(args, config)
    if all(all(a is None for a in s) for s in _spec_leaves(specs)):
        return lambda: fn(**args)  # nothing splits: run it as is
    names = [n for n in specs if args.get(n) is not None]
    static = {n: v for n, v in args.items() if n not in names}

    summed = out_specs.axis if isinstance(out_specs, Summed) else None
    if summed is not None:
        out_specs = out_specs.spec

    def body(*arrays):
        # A quantized array's static block is its global one: make it the shard's.
        arrays = [a.shard_local() if hasattr(a, "shard_local") else a for a in arrays]
        _LOCAL.inside = True
        try:
            out = fn(**static, **dict(zip(names, arrays, strict=True)))
        finally:
            _LOCAL.inside = False
        return out if summed is None else jax.lax.psum(out, summed)

    mapped = _compat.shard_map(body, mesh=config.mesh, in_specs=tuple(specs[n] for n in names),
                               out_specs=out_specs)
    return lambda: mapped(*(args[n] for n in names))


def local_args(rule: Rule | None, args: Mapping[str, Any]) -> Mapping[str, Any]:
    """``args`` with each array replaced by the shape one shard sees under the active mesh
    when split by ``rule`` (for an implementation's ``supports`` check); ``args`` itself
    without a mesh or a rule."""
    config = current()
    if config is None or rule is None:
        return args
    specs, _ = rule(args, config)

    def local(value, spec):
        if value is None or not hasattr(value, "shape") or not hasattr(value, "dtype"):
            return value
        shape = list(value.shape)
        for dim, axis in enumerate(spec):
            if axis is not None:
                shape[dim] //= config.mesh.shape[axis]
        return jax.ShapeDtypeStruct(tuple(shape), value.dtype)

    out = dict(args)
    for name, spec in specs.items():
        value = args.get(name)
        if value is None:
            continue
        if isinstance(spec, P):  # one spec for the argument (every array of a pytree)
            out[name] = jax.tree.map(lambda v, spec=spec: local(v, spec), value)
        else:  # a spec per array of a pytree argument (a QuantizedArray's values, scales)
            out[name] = jax.tree.map(lambda s, v: local(v, s), spec, value,
                                     is_leaf=lambda x: isinstance(x, P))
    return out


def _spec_leaves(specs: Mapping[str, Any]) -> list[P]:
    """The PartitionSpecs of a rule's in_specs (an argument's may be a pytree of them)."""
    return jax.tree.leaves(list(specs.values()), is_leaf=lambda x: isinstance(x, P))
