"""Matrix multiply with a quantized right-hand side: ``alpha * a @ op(dequantize(b)) + beta * c``.

:func:`forge_jax.matmul` calls this op when ``b`` is a :class:`forge_jax.quant.QuantizedArray`.

The XLA implementation dequantizes inside the product, one block of output rows (about
a MiB of float32) at a time (``lax.map`` over the blocks), so no full-precision copy of
the weight exists, not even a transient one. On CPU this is the fastest form measured:
converting a whole int8 weight first costs more than the product (writing and reading its
float32 copy), and XLA's int8 x int8 product needs int8 activations (another computation)
and is slow for one row. Against float32 on CPU, the int8 and int4 products measured on
par for one row of activations (two runs on a noisy host disagree for 16 rows), fp8 far
slower (XLA converts float8 slowly there): BENCHMARKS.md (``benchmarks/quant_cpu.py``).

W8A8 (``b.activations == "int8"``, asked for by ``fj.quantize(w, "int8",
activations="int8")``): every implementation computes

    qa, sa = quantize_rows(a)                     # int8 [M, K], float32 [M, 1]
    out[m, n] = sa[m] * sum_g sb[n, g] * float32(sum_{k in g} qa[m, k] * qb[n, k])

with the inner sums int8 x int8 products accumulated in int32 (exact), one per group of
``b``'s scales along K (one for per-channel scales), then float32. On CPU, XLA's integer
product is slower than float32 (BENCHMARKS.md): W8A8 is for TPUs with an int8 MXU.

On a mesh (:func:`forge_jax.sharding.use_mesh`) the product runs per shard as the weight
was placed (:func:`forge_jax.quant.place`, which ``from_pretrained(quantize=, mesh=)``
uses): see :func:`_quantized_matmul_partition`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding
from forge_jax.quant import (
    QuantizedArray,
    dequantize,
    e8m0_scales,
    fp4_values,
    partition_specs,
    quantize_rows,
)

_FULL = jax.lax.Precision.HIGHEST
# Values dequantized at a time: a block of rows of about 1 MiB in float32, which stays in
# cache; fewer, larger blocks also cost fewer loop iterations (each has a fixed overhead).
_BLOCK_VALUES = 1 << 18


def scale_and_add(out, *, alpha, beta, c, out_dtype):
    """The GEMM epilogue every matmul implementation shares: ``alpha * out + beta * c`` in
    ``out``'s (accumulator) dtype, then the cast to ``out_dtype``. ``alpha`` is skipped when
    it is the Python float 1.0 (a traced or array alpha always multiplies)."""
    acc = out.dtype
    if not (isinstance(alpha, float) and alpha == 1.0):
        out = out * jnp.asarray(alpha, acc)
    if c is not None:
        out = out + jnp.asarray(beta, acc) * c.astype(acc)
    return out.astype(out_dtype)


def _quantized_matmul_args(a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None,
                           out_dtype=None):
    _checks.array("a", a, min_ndim=2)
    if not isinstance(b, QuantizedArray):
        raise TypeError(f"b must be a QuantizedArray, got {type(b).__name__}")
    if b.ndim != 2:
        raise ValueError(f"a quantized b must be 2-D, got b.shape={b.shape}")
    if trans_a:
        raise ValueError("trans_a=True is not supported with a quantized b; transpose a")
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {trans_b=!r}")
    if b.activations == "int8":
        if not trans_b:
            raise ValueError("b.activations='int8' (W8A8) needs the [out, in] layout: "
                             "trans_b=True")
        if b.minimums is not None:
            raise ValueError("b.activations='int8' (W8A8) needs symmetric weights; b has "
                             "minimums")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"a must be float for W8A8 (it is quantized per row), got "
                            f"a.dtype={jnp.dtype(a.dtype).name}")
    alpha = _checks.number("alpha", alpha)
    beta = _checks.number("beta", beta)
    k_b = b.shape[1] if trans_b else b.shape[0]
    if a.shape[-1] != k_b:
        raise ValueError(f"contracting dimensions disagree: {a.shape=} has K={a.shape[-1]}, "
                         f"b.shape={b.shape} ({trans_b=}) has K={k_b}")
    n = b.shape[0] if trans_b else b.shape[1]
    out_shape = (*a.shape[:-1], n)
    out_dtype = _checks.product_output(out_dtype, a.dtype, c, beta, out_shape)
    return dict(a=a, b=b, trans_b=trans_b, alpha=alpha, beta=beta, c=c, out_dtype=out_dtype)


def _split_axes(b: QuantizedArray, trans_b: bool) -> tuple[str | None, str | None]:
    """The mesh axes ``b``'s output (N) and contracted (K) axes are split over (its
    ``spec``, set when :func:`forge_jax.quant.place` put it on a mesh)."""
    spec = tuple(b.spec) + (None,) * (2 - len(b.spec))
    return (spec[0], spec[1]) if trans_b else (spec[1], spec[0])


def _quantized_matmul_partition(args, config):
    """As the weight is placed (its ``spec``): a weight split over its output channels
    (column-parallel) gives each device its columns of the result; one split over its
    input channels (row-parallel) multiplies each device's columns of ``a`` and sums the
    partial products over that axis (one all-reduce). The weight's scales go with their
    values (:func:`forge_jax.quant.partition_specs`); ``a``'s leading axis splits over the
    data axis when it divides. Nothing splits for a weight that is not placed on this
    mesh (a product built by hand on replicated arrays). W8A8 splits only over output
    channels (its activation scales are per whole row)."""
    a, b, c = args["a"], args["b"], args["c"]
    n_axis, k_axis = _split_axes(b, args["trans_b"])
    axes = config.mesh.axis_names
    if (n_axis is None and k_axis is None) or any(
            x is not None and x not in axes for x in (n_axis, k_axis)):
        return {"a": P(), "b": P(), "c": P()}, P()
    if b.activations is not None and k_axis is not None:
        raise ValueError(f"b.activations={b.activations!r} (W8A8) with a weight split over its "
                         f"input channels (mesh axis {k_axis!r}): each row's activation scale "
                         f"spans all of K, which no shard holds; split the output channels")
    rows = config.batch_axis(a.shape[0])
    if rows in (n_axis, k_axis):
        rows = None
    lead = (rows,) + (None,) * (a.ndim - 2)
    out = P(*lead, n_axis)
    if c is None:
        c_spec = P()
    elif c.ndim == len(a.shape) and c.shape[0] == a.shape[0]:
        # (a column [..., M, 1] broadcasts over N: not split)
        c_spec = P(*lead, n_axis if c.shape[-1] > 1 else None)
    else:  # broadcast against the result's trailing axes
        c_spec = P(*((None,) * (c.ndim - 1)), n_axis if c.shape[-1] > 1 else None)
    specs = {"a": P(*lead, k_axis),
             "b": partition_specs(b, b.spec, config.mesh.shape), "c": c_spec}
    return specs, out if k_axis is None else sharding.Summed(out, k_axis)


dispatch.define("quantized_matmul", _quantized_matmul_args, partition=_quantized_matmul_partition)


def quantized_matmul(a, b, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, c=None,
                     out_dtype=None, implementation=None):
    """``alpha * a @ op(dequantize(b)) + beta * c`` with float32 accumulation.

    Args:
      a: ``[..., M, K]`` float (the compute dtype: ``b`` is dequantized to it).
      b: a 2-D :class:`~forge_jax.quant.QuantizedArray`: ``[N, K]`` with ``trans_b``
        (a weight in the ``[out, in]`` layout, the fast path), else ``[K, N]``. With
        ``b.activations == "int8"`` (W8A8), ``a`` is quantized per row and the product is
        int8 x int8 with int32 accumulation (the module docstring has the formula); that
        needs ``trans_b`` and symmetric int8 weights.
      trans_a: must be False.
      alpha, beta, c, out_dtype, implementation: as :func:`forge_jax.matmul`.

    Returns:
      ``[..., M, N]`` in ``out_dtype`` (default ``a.dtype``).
    """
    args = _quantized_matmul_args(a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha,
                                  beta=beta, c=c, out_dtype=out_dtype)
    if c is not None and _split_axes(b, args["trans_b"])[1] is not None:
        # Split over K, the product is a sum over devices: add beta * c once, after it
        # (in float32, as the implementations do), not once per device.
        out = dispatch.call("quantized_matmul", {**args, "beta": 0.0, "c": None,
                                                 "out_dtype": jnp.dtype(jnp.float32)},
                            implementation)
        return (out + jnp.asarray(args["beta"], jnp.float32) * c.astype(jnp.float32)
                ).astype(args["out_dtype"])
    return dispatch.call("quantized_matmul", args, implementation)


def _row_block(n: int, k: int, rows_per_scale: int) -> int:
    """Rows dequantized at a time: the largest divisor of ``n`` up to about
    ``_BLOCK_VALUES / k`` (at least 128) made of whole scale blocks and a multiple of 8."""
    target = max(128, _BLOCK_VALUES // max(k, 1))
    for size in range(min(target, n), 7, -1):
        if n % size == 0 and size % rows_per_scale == 0 and size % 8 == 0:
            return size
    return n


def _block_product(a2, values, scales, minimums, *, fmt, group, rows_per_scale, dtype):
    """``a2 [M, K] @ W.T`` for one block of rows ``W`` ``[bn, K]`` stored as ``values``
    with ``scales`` (and ``minimums``) ``[bn / rows_per_scale, K / group]``."""
    dims = (((1,), (1,)), ((), ()))

    def rows(s):  # [bn / rows_per_scale, G] -> [bn, G, 1]
        s = s.astype(jnp.float32)
        return (jnp.repeat(s, rows_per_scale, axis=0) if rows_per_scale > 1 else s)[..., None]

    bn = values.shape[0]
    g = scales.shape[-1]
    if fmt == "mxfp4":  # E2M1 codes packed as int4's, E8M0 scales: decoded in the block
        scales = e8m0_scales(scales)
        out = 0.0
        for half, cols in ((values & 0xF, slice(0, None, 2)), (values >> 4, slice(1, None, 2))):
            w = fp4_values(half).reshape(bn, g, group // 2) * rows(scales)
            out = out + jax.lax.dot_general(a2[:, cols], w.reshape(bn, -1).astype(dtype), dims,
                                            preferred_element_type=jnp.float32, precision=_FULL)
        return out
    if fmt == "int4":
        # The low nibbles hold the even columns and the high ones the odd columns: two
        # products against a's even and odd columns, so no interleaving copy is made.
        out = 0.0
        for half, cols in ((values & 0xF, slice(0, None, 2)), (values >> 4, slice(1, None, 2))):
            q = half.astype(jnp.float32)
            if minimums is None:
                q = q - 8.0
            w = q.reshape(bn, g, group // 2) * rows(scales)
            if minimums is not None:
                w = w + rows(minimums)
            out = out + jax.lax.dot_general(a2[:, cols], w.reshape(bn, -1).astype(dtype), dims,
                                            preferred_element_type=jnp.float32, precision=_FULL)
        return out
    w = values.astype(jnp.float32).reshape(bn, g, group) * rows(scales)
    if minimums is not None:
        w = w + rows(minimums)
    return jax.lax.dot_general(a2, w.reshape(bn, -1).astype(dtype), dims,
                               preferred_element_type=jnp.float32, precision=_FULL)


def _w8a8_block_product(qa, sa, values, scales, *, group, rows_per_scale):
    """The W8A8 product of ``qa`` int8 ``[M, K]`` (row scales ``sa`` ``[M, 1]``) with one
    block of weight rows, int8 ``values`` ``[bn, K]`` and ``scales``
    ``[bn / rows_per_scale, K / group]``: float32 ``[M, bn]``."""
    bn, k = values.shape
    g = k // group
    # [g, M, bn] int32: one exact integer product per group of scales.
    acc = jax.lax.dot_general(qa.reshape(-1, g, group), values.reshape(bn, g, group),
                              (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)
    s = scales.astype(jnp.float32)
    s = jnp.repeat(s, rows_per_scale, axis=0) if rows_per_scale > 1 else s  # [bn, g]
    out = acc[0].astype(jnp.float32) * s[:, 0]
    for i in range(1, g):
        out = out + acc[i].astype(jnp.float32) * s[:, i]
    return out * sa


@dispatch.register("quantized_matmul", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="dequantizes a block of rows at a time inside the product (CPU: "
                               "not faster than float32, fp8 much slower; BENCHMARKS.md)")
def quantized_matmul_xla(a, b, *, trans_b, alpha, beta, c, out_dtype):
    lead, k = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, k)  # [M, K]
    acc = jnp.float32
    with jax.named_scope("quantized_matmul"):
        if b.activations == "int8":  # W8A8
            qa, sa = quantize_rows(a2)
            rows_per_scale, group = b.full_block()
            n = b.shape[0]
            bn = _row_block(n, k, rows_per_scale)
            nb = n // bn
            split = lambda x: x.reshape(nb, -1, x.shape[-1])
            product = lambda blk: _w8a8_block_product(qa, sa, *blk, group=group,
                                                      rows_per_scale=rows_per_scale)
            if nb == 1:
                out = product((b.values, b.scales))
            else:
                out = jax.lax.map(product, (split(b.values), split(b.scales)))  # [nb, M, bn]
                out = jnp.moveaxis(out, 0, 1).reshape(a2.shape[0], n)
        elif trans_b:
            rows_per_scale, group = b.full_block()
            n = b.shape[0]
            bn = _row_block(n, k, rows_per_scale)
            nb = n // bn
            split = lambda x: None if x is None else x.reshape(nb, -1, x.shape[-1])
            product = lambda blk: _block_product(
                a2, *blk, fmt=b.format, group=group, rows_per_scale=rows_per_scale,
                dtype=a.dtype)
            parts = (split(b.values), split(b.scales), split(b.minimums))
            if nb == 1:
                out = product(tuple(None if p is None else p[0] for p in parts))
            else:
                out = jax.lax.map(product, parts)  # [nb, M, bn]
                out = jnp.moveaxis(out, 0, 1).reshape(a2.shape[0], n)
        else:  # [K, N]: blocks run along the wrong axis for row blocks; dequantize whole
            w = dequantize(b, a.dtype)
            out = jax.lax.dot_general(a2, w, (((1,), (0,)), ((), ())),
                                      preferred_element_type=acc, precision=_FULL)
        # (out.shape[-1], not -1: a batch of no rows has nothing to infer it from)
        return scale_and_add(out.reshape(*lead, out.shape[-1]), alpha=alpha, beta=beta, c=c,
                             out_dtype=out_dtype)
