"""Grouped matrix multiply: one weight matrix per group of consecutive rows (the
``ragged_dot`` shape of a mixture of experts' expert layers)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.quant import QuantizedArray, dequantize, partition_specs

# float32 operands as IEEE products on every platform (see forge_jax.ops.matmul).
_FULL = jax.lax.Precision.HIGHEST
# Rows per tile of the XLA implementation's schedule (a loop step's product is
# [ROW_TILE, k] @ [k, n]; fewer rows when x has fewer).
ROW_TILE = 64


def _grouped_matmul_args(x, w, group_sizes, *, trans_w=False):
    _checks.array("x", x, ndim=2)
    _checks.array("w", w, ndim=3)
    _checks.array("group_sizes", group_sizes, ndim=1, kind="int")
    if not isinstance(trans_w, bool):
        raise TypeError(f"trans_w must be a bool, got {trans_w=!r}")
    if isinstance(w, QuantizedArray):
        if w.full_block()[0] != 1:
            raise ValueError(f"a quantized w needs its own scales per group (blocks of 1 "
                             f"along the group axis), got block={w.block} for w.shape="
                             f"{w.shape}")
        if w.activations is not None:
            raise ValueError(f"w.activations={w.activations!r} (W8A8): grouped_matmul "
                             f"multiplies dequantized weights in x's dtype; quantize w "
                             f"without activations=")
    else:
        _checks.same_dtype(("x", x), ("w", w))
    m, k = x.shape
    g = w.shape[0]
    if w.shape[2 if trans_w else 1] != k:
        layout = "[groups, n, k]" if trans_w else "[groups, k, n]"
        raise ValueError(f"w must be {layout} ({trans_w=}) with k = x.shape[1] = {k}, got "
                         f"w.shape={tuple(w.shape)} for {x.shape=}")
    if group_sizes.shape[0] != g:
        raise ValueError(f"group_sizes must have one entry per group of w: "
                         f"{group_sizes.shape=}, {w.shape=}")
    if g == 0:
        raise ValueError(f"w must hold at least one group, got {w.shape=}")
    sizes = _checks.concrete_ints(group_sizes)
    if sizes is not None:
        if (sizes < 0).any():
            i = int(np.argmax(sizes < 0))
            raise ValueError(f"group_sizes must be >= 0, got group_sizes[{i}]={sizes[i]}")
        if sizes.sum() != m:
            raise ValueError(f"group_sizes must sum to the row count x.shape[0]={m}, got "
                             f"sum(group_sizes)={sizes.sum()}")
    starts, ends = group_bounds(group_sizes, m)
    return dict(x=x, w=w, group_starts=starts, group_ends=ends, trans_w=trans_w)


def group_bounds(group_sizes, m: int):
    """``(starts, ends)`` int32 ``[groups]``: group ``i`` owns rows ``[starts[i], ends[i])``
    of ``m``. Negative sizes count as 0 and groups are clipped at row ``m`` (the defined
    result of traced sizes that do not fit; concrete ones are checked by the op)."""
    if isinstance(group_sizes, jax.ShapeDtypeStruct):  # shapes only (supports, explain)
        spec = jax.ShapeDtypeStruct(group_sizes.shape, jnp.int32)
        return spec, spec
    sizes = jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m).astype(jnp.int32)
    if _checks.debug_checks_enabled() and not _checks.is_concrete(group_sizes):
        total = jnp.sum(sizes)
        _checks.traced_check(total == m, "group_sizes must sum to the row count {m}, got {s}",
                             m=jnp.int32(m), s=total)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def grouped_matmul(x, w, group_sizes, *, trans_w=False, implementation=None):
    """Grouped matrix multiply: each group of consecutive rows of ``x`` times its own matrix.

    With ``e_i = group_sizes[0] + ... + group_sizes[i]`` and ``s_i = e_i - group_sizes[i]``,
    ``out[r] = x[r] @ w[i]`` for the rows ``s_i <= r < e_i`` of group ``i``, accumulated in
    float32 and rounded once to ``x.dtype``. This is ``jax.lax.ragged_dot``'s contract (the
    expert layers of a mixture of experts, rows sorted by expert); no implementation forms
    a dense ``[rows, groups, ...]`` product.

    Group sizes may be traced (under ``jit``). Concrete sizes must be ``>= 0`` and sum to
    ``m`` (ValueError otherwise). Traced sizes get a defined result instead: negative
    sizes count as 0, groups are clipped at row ``m`` (rows past ``m`` do not exist), and
    rows past ``sum(group_sizes)`` are zero (so a padded buffer of rows may carry
    anything, NaN included, in its padding; it reaches neither the output nor the
    gradients). Inside :func:`forge_jax.debug_checks` a traced sum other than ``m`` is a
    checkify error. Empty groups give no rows, and zero gradients for their ``w[i]``.
    Differentiable in reverse mode (``grad``, ``vjp``: a custom VJP of two more grouped
    products); forward mode (``jax.jvp``) is not supported.

    Under :func:`forge_jax.sharding.use_mesh` the groups split over the tensor axis when
    their count divides it (expert parallelism: each device multiplies the rows of its
    own groups and the partial products are summed), else ``n`` does when it divides.

    A quantized ``w`` (a :class:`forge_jax.QuantizedArray` stacked over the groups, each
    group with its own scales: ``fj.quantize`` of a stacked ``[groups, n, k]`` weight gives
    that, its leading axis having blocks of 1) is dequantized one group at a time inside
    the loop over the visits, into the compute dtype ``x.dtype``: the XLA implementation
    never holds more than one group's matrix in full precision. ``trans_w=True`` (``w``
    as ``[groups, n, k]``, each group's weight in the ``[out, in]`` layout, blocks along
    the contracted last axis) is the layout ``fj.quantize`` gives int4 groups and
    per-output-channel scales in; one quantized with ``activations="int8"`` (W8A8) is
    refused. Quantized weights are for inference: there is no gradient through a
    quantized ``w`` (NotImplementedError when one is asked for), and the Pallas GPU
    kernel dequantizes int8/int4 in registers (by name), the TPU kernel refuses it (the
    XLA implementation runs), as both refuse a float ``w`` with ``trans_w``. On a mesh a
    quantized ``w`` splits by group where :func:`forge_jax.quant.place` put it so (its
    ``spec`` naming the tensor axis first), else not at all.

    Args:
      x: ``[m, k]`` float32/float16/bfloat16, rows sorted by group.
      w: ``[groups, k, n]`` (``[groups, n, k]`` with ``trans_w``), ``x``'s dtype (the
        dtype rule of :mod:`forge_jax.ops`), or a :class:`forge_jax.QuantizedArray` of
        that logical shape.
      group_sizes: int ``[groups]``, rows per group (traced allowed).
      trans_w: ``w`` holds each group's matrix transposed, ``[groups, n, k]``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[m, n]`` in ``x.dtype``.
    """
    return dispatch.call("grouped_matmul",
                         _grouped_matmul_args(x, w, group_sizes, trans_w=trans_w),
                         implementation)


def _grouped_matmul_partition(args, config):
    """Groups over the tensor axis (partial products summed over it), else ``n``. A
    quantized ``w`` splits as it was placed (its ``spec``): by group over the tensor axis,
    each group's scales with its values (:func:`forge_jax.quant.partition_specs`); one not
    placed that way does not split."""
    w = args["w"]
    if isinstance(w, QuantizedArray):
        groups = w.spec[0] if w.spec else None
        if groups is None or groups != config.tp_name or any(w.spec[1:]):
            return {"x": P(), "w": P(), "group_starts": P(), "group_ends": P()}, P()
        specs = partition_specs(w, P(groups, None, None), config.mesh.shape)
        return ({"x": P(), "w": specs, "group_starts": P(groups), "group_ends": P(groups)},
                sharding.Summed(P(), groups))
    groups = sharding.divisible(config, config.tp_name, w.shape[0])
    if groups is not None:
        return ({"x": P(), "w": P(groups, None, None), "group_starts": P(groups),
                 "group_ends": P(groups)}, sharding.Summed(P(), groups))
    trans_w = args.get("trans_w", False)
    cols = sharding.divisible(config, config.tp_name, w.shape[1 if trans_w else 2])
    spec = P(None, cols, None) if trans_w else P(None, None, cols)
    return ({"x": P(), "w": spec, "group_starts": P(), "group_ends": P()}, P(None, cols))


dispatch.define("grouped_matmul", _grouped_matmul_args, partition=_grouped_matmul_partition)


# --- the schedule: which row tile each step multiplies by which group --------------------


def tile_schedule(group_starts, group_ends, m: int, tm: int):
    """The visits of a grouped product over row tiles of ``tm`` rows (megablox's schedule).

    Groups are consecutive (``group_ends[i] == group_starts[i + 1]``); each non-empty group
    visits every tile its rows touch, in order, so a tile shared by two groups is visited
    twice, one after the other. At most ``steps = cdiv(m, tm) + groups - 1`` visits.

    Returns:
      ``(group_ids, tile_ids, num_visits)``: int32 ``[steps]`` each and a scalar; steps
      past ``num_visits`` repeat the last visit (``group 0, tile 0`` when there is none).
    """
    g = group_starts.shape[0]
    steps = cdiv(m, tm) + g - 1
    nonempty = group_ends > group_starts
    first = group_starts // tm
    last = (group_ends - 1) // tm
    counts = jnp.where(nonempty, last - first + 1, 0).astype(jnp.int32)
    num_visits = jnp.sum(counts)
    group_ids = jnp.repeat(jnp.arange(g, dtype=jnp.int32), counts, total_repeat_length=steps)
    offsets = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    s = jnp.minimum(jnp.arange(steps, dtype=jnp.int32), jnp.maximum(num_visits - 1, 0))
    group_ids = jnp.where(num_visits > 0, group_ids[s], 0)
    tile_ids = jnp.where(num_visits > 0, first[group_ids] + s - offsets[group_ids], 0)
    return group_ids, tile_ids.astype(jnp.int32), num_visits


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _window(i, group_ids, tile_ids, starts, ends, m, tm):
    """Visit ``i``: its group, the first row of its ``tm``-row window and which of the
    window's rows it computes ``[tm]``: the group's rows in its tile. The last tile's
    window is shifted back to fit inside ``m``; the rows it then shares with the tile
    before are that tile's, not this visit's."""
    group = group_ids[i]
    tile0 = tile_ids[i] * tm
    row0 = jnp.minimum(tile0, m - tm)
    rows = row0 + jnp.arange(tm, dtype=jnp.int32)
    return group, row0, (rows >= jnp.maximum(starts[group], tile0)) & (rows < ends[group])


def _gmm_loop(x, w, starts, ends, *, tm, transpose_w=False):
    """``out [m, n]`` float32: each visit's masked ``[tm, k] @ w[group]`` written into its
    window's rows (``w[group].T`` when ``transpose_w``)."""
    m, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    group_ids, tile_ids, num_visits = tile_schedule(starts, ends, m, tm)
    contract = 2 if transpose_w else 1

    def body(i, out):
        group, row0, mask = _window(i, group_ids, tile_ids, starts, ends, m, tm)
        xw = jax.lax.dynamic_slice(x, (row0, 0), (tm, k))
        xw = jnp.where(mask[:, None], xw, jnp.zeros((), x.dtype))  # padding rows may be NaN
        wg = jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
        acc = jax.lax.dot_general(xw, wg, (((1,), (contract - 1,)), ((), ())),
                                  precision=_FULL, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice(out, (row0, 0), (tm, n))
        return jax.lax.dynamic_update_slice(out, jnp.where(mask[:, None], acc, old), (row0, 0))

    return jax.lax.fori_loop(0, num_visits, body, jnp.zeros((m, n), jnp.float32))


def _tgmm_loop(x, dy, starts, ends, *, tm, groups):
    """``dw [groups, k, n]`` float32: ``x[rows of i].T @ dy[rows of i]`` per group."""
    m, k = x.shape
    n = dy.shape[1]
    group_ids, tile_ids, num_visits = tile_schedule(starts, ends, m, tm)

    def body(i, dw):
        group, row0, mask = _window(i, group_ids, tile_ids, starts, ends, m, tm)
        xw = jnp.where(mask[:, None], jax.lax.dynamic_slice(x, (row0, 0), (tm, k)), 0)
        dyw = jnp.where(mask[:, None], jax.lax.dynamic_slice(dy, (row0, 0), (tm, n)), 0)
        part = jax.lax.dot_general(xw, dyw, (((0,), (0,)), ((), ())), precision=_FULL,
                                   preferred_element_type=jnp.float32)
        return dw.at[group].add(part)

    return jax.lax.fori_loop(0, num_visits, body, jnp.zeros((groups, k, n), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped(x, w, starts, ends, tm, trans_w):
    return _gmm_loop(x, w, starts, ends, tm=tm, transpose_w=trans_w).astype(x.dtype)


def _grouped_fwd(x, w, starts, ends, tm, trans_w):
    return _grouped(x, w, starts, ends, tm, trans_w), (x, w, starts, ends)


def _grouped_bwd(tm, trans_w, saved, dy):
    # The VJP as two more grouped products, so that it too runs a while loop over the
    # visits (a scan's transpose would add a full [groups, k, n] cotangent per step).
    x, w, starts, ends = saved
    dx = _gmm_loop(dy, w, starts, ends, tm=tm, transpose_w=not trans_w).astype(x.dtype)
    dw = _tgmm_loop(x, dy, starts, ends, tm=tm, groups=w.shape[0])
    dw = (jnp.swapaxes(dw, 1, 2) if trans_w else dw).astype(w.dtype)
    zero = np.zeros(starts.shape, jax.dtypes.float0)
    return dx, dw, zero, zero


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def group_weight(w: QuantizedArray, group, dtype) -> jax.Array:
    """Group ``group`` (traced) of a quantized ``w [groups, ...]``, dequantized to ``dtype``
    (``w.shape[1:]``)."""
    pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, group, 0, False)
    one = QuantizedArray(pick(w.values), pick(w.scales), pick(w.minimums), w.format,
                         w.full_block()[1:], w.dtype)
    return dequantize(one, dtype)


def _gmm_loop_quantized(x, w, starts, ends, *, tm, trans_w):
    """``out [m, n]`` float32 as :func:`_gmm_loop` for a quantized ``w``: the loop carries
    the current group's matrix, dequantized to ``x.dtype`` when the visits reach a new
    group (a group's visits are consecutive, so each is dequantized once)."""
    m, k = x.shape
    n = w.shape[1] if trans_w else w.shape[2]
    group_ids, tile_ids, num_visits = tile_schedule(starts, ends, m, tm)
    contract = 1 if trans_w else 0

    def body(i, carry):
        out, wg, current = carry
        group, row0, mask = _window(i, group_ids, tile_ids, starts, ends, m, tm)
        wg = jax.lax.cond(group == current, lambda: wg,
                          lambda: group_weight(w, group, x.dtype))
        xw = jax.lax.dynamic_slice(x, (row0, 0), (tm, k))
        xw = jnp.where(mask[:, None], xw, jnp.zeros((), x.dtype))  # padding rows may be NaN
        acc = jax.lax.dot_general(xw, wg, (((1,), (contract,)), ((), ())),
                                  precision=_FULL, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice(out, (row0, 0), (tm, n))
        out = jax.lax.dynamic_update_slice(out, jnp.where(mask[:, None], acc, old), (row0, 0))
        return out, wg, group

    init = (jnp.zeros((m, n), jnp.float32), jnp.zeros(w.shape[1:], x.dtype), jnp.int32(-1))
    return jax.lax.fori_loop(0, num_visits, body, init)[0]


_NO_GRADIENT = ("fj.grouped_matmul has no gradient with a quantized w (quantized weights are "
                "for inference); differentiate with a float w (fj.dequantize(w))")


def no_gradient(forward, x, w, starts, ends, **options):
    """``forward(x, w, starts, ends, **options)`` for a quantized ``w``, with a VJP that
    raises NotImplementedError (the XLA implementation and the kernels alike)."""

    @jax.custom_vjp
    def fn(x, w, starts, ends):
        return forward(x, w, starts, ends, **options)

    def bwd(saved, dy):
        raise NotImplementedError(_NO_GRADIENT)

    fn.defvjp(lambda *args: (fn(*args), None), bwd)
    return fn(x, w, starts, ends)


@dispatch.register("grouped_matmul", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="a loop over (row tile, group) visits, float32 accumulation; "
                               "a quantized w dequantized one group at a time in the loop")
def grouped_matmul_xla(x, w, *, group_starts, group_ends, trans_w=False):
    with jax.named_scope("grouped_matmul"):
        m = x.shape[0]
        n = w.shape[1] if trans_w else w.shape[2]
        if m == 0:
            return jnp.zeros((0, n), x.dtype)
        if isinstance(w, QuantizedArray):
            loop = lambda x, w, s, e: _gmm_loop_quantized(
                x, w, s, e, tm=min(ROW_TILE, m), trans_w=trans_w).astype(x.dtype)
            return no_gradient(loop, x, w, group_starts, group_ends)
        return _grouped(x, w, group_starts, group_ends, min(ROW_TILE, m), trans_w)


def _ragged_dot_supports(args, platform) -> str | None:
    del platform
    if isinstance(args["w"], QuantizedArray):
        return ("a quantized w: jax.lax.ragged_dot multiplies float operands (the XLA "
                "implementation dequantizes one group at a time)")
    return None


@dispatch.register("grouped_matmul", "ragged_dot", supports=_ragged_dot_supports,
                   description="jax.lax.ragged_dot (XLA's ragged dot on GPU/TPU; a masked dense "
                               "[groups, m, k] operand on CPU), by name")
def grouped_matmul_ragged_dot(x, w, *, group_starts, group_ends, trans_w=False):
    with jax.named_scope("grouped_matmul"):
        if trans_w:
            w = jnp.swapaxes(w, 1, 2)  # a copy: ragged_dot reads [groups, k, n]
        # ragged_dot's groups start at row 0; one shard's groups (the partition rule) start
        # at group_starts[0]: rotate those rows to the top and the result back.
        row0 = group_starts[0]
        out = jax.lax.ragged_dot(jnp.roll(x, -row0, axis=0), w, group_ends - group_starts,
                                 precision=_FULL, preferred_element_type=jnp.float32)
        return jnp.roll(out, row0, axis=0).astype(x.dtype)
