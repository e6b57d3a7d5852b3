"""``fj.grouped_matmul`` and its XLA implementation: the behaviours of
:class:`cases.grouped_matmul_base.GroupedMatmulCases`, argument checks (one-line errors
naming the values, before any work), the defined result of traced sizes that do not fit,
``vmap``, ``debug_checks`` and the partition rule on conftest's 8 CPU devices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.grouped_matmul_base import (
    ONE_GROUP,
    SINGLES,
    UNEVEN,
    GroupedMatmulCases,
    gmm_inputs,
    jit_gmm,
)
from cases.grouped_references import grouped_matmul_ref
from cases.references import f64
from jax.experimental import checkify

import forge_jax as fj
from forge_jax import dispatch, sharding


class TestGroupedMatmulXla(GroupedMatmulCases):
    IMPLEMENTATION = "xla"
    CASES = {
        "uneven-f32": (UNEVEN, 64, 48, jnp.float32),
        "singles-bf16": (SINGLES, 32, 128, jnp.bfloat16),
        "one_group-f16": (ONE_GROUP, 24, 40, jnp.float16),
        "50_groups_of_3": ((3,) * 50, 16, 8, jnp.float32),  # more groups than tiles
        "across_tiles": ((70, 0, 65), 16, 8, jnp.float32),  # groups across 64-row tiles
    }


class TestGroupedMatmulRaggedDot(GroupedMatmulCases):
    """``jax.lax.ragged_dot``, by name (on CPU it forms a masked dense operand)."""

    IMPLEMENTATION = "ragged_dot"
    CASES = {"uneven-f32": (UNEVEN, 64, 48, jnp.float32),
             "singles-bf16": (SINGLES, 32, 128, jnp.bfloat16)}


def test_eager_concrete_sizes_and_explain():
    x, w, sizes = gmm_inputs(UNEVEN, 16, 8, jnp.float32)
    # Concrete sizes inside a jit are checked (and taken) at trace time.
    out = jax.jit(lambda x, w: fj.grouped_matmul(x, w, np.asarray(UNEVEN, np.int32)))(x, w)
    assert_close(out, grouped_matmul_ref(x, w, UNEVEN))
    assert fj.explain("grouped_matmul", x, w, sizes).implementation == "xla"


def test_traced_sizes_that_do_not_fit_are_clipped():
    """Negative sizes count as 0; groups past row ``m`` are cut at ``m``."""
    x, w, _ = gmm_inputs((20, 10, 7), 16, 8, jnp.float32)
    sizes = jnp.asarray([25, -4, 30], jnp.int32)  # [0, 25) -> group 0, [25, 37) -> group 2
    out = jit_gmm("xla")(x, w, sizes)
    assert_close(out, grouped_matmul_ref(x, w, (25, 0, 30)))
    ref = np.concatenate([f64(x[:25]) @ f64(w[0]), f64(x[25:]) @ f64(w[2])])
    assert_close(out, ref)


def test_vmap_over_a_batch_of_problems():
    x, w, _ = gmm_inputs((4, 0, 5), 16, 8, jnp.float32)
    sizes = jnp.asarray([[4, 0, 5], [0, 9, 0], [1, 1, 7]], jnp.int32)
    out = jax.jit(jax.vmap(fj.grouped_matmul, in_axes=(None, None, 0)))(x, w, sizes)
    for b in range(3):
        assert_close(out[b], grouped_matmul_ref(x, w, np.asarray(sizes[b])))


INVALID = {
    "x_rank": (lambda x, w, s: (x[None], w, s), ValueError, r"x must have rank 2"),
    "w_rank": (lambda x, w, s: (x, w[0], s), ValueError, r"w must have rank 3"),
    "w_k": (lambda x, w, s: (x, w[:, :5], s), ValueError, r"k = x.shape\[1\] = 16"),
    "sizes_len": (lambda x, w, s: (x, w, s[:2]), ValueError, r"group_sizes.shape=\(2,\)"),
    "sizes_float": (lambda x, w, s: (x, w, s.astype(jnp.float32)), TypeError,
                    r"group_sizes.dtype=float32"),
    "dtypes": (lambda x, w, s: (x, w.astype(jnp.bfloat16), s), TypeError,
               r"x.dtype=float32, w.dtype=bfloat16"),
    "int_x": (lambda x, w, s: (x.astype(jnp.int32), w.astype(jnp.int32), s), TypeError,
              r"x.dtype=int32"),
    "sum": (lambda x, w, s: (x, w, jnp.asarray([4, 0, 4], jnp.int32)), ValueError,
            r"sum to the row count x.shape\[0\]=9, got sum\(group_sizes\)=8"),
    "negative": (lambda x, w, s: (x, w, jnp.asarray([10, -1, 0], jnp.int32)), ValueError,
                 r"group_sizes\[1\]=-1"),
    "no_groups": (lambda x, w, s: (x, w[:0], s[:0]), ValueError, r"at least one group"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_bad_arguments_raise_one_line_errors(case, monkeypatch):
    make, error, match = INVALID[case]
    x, w, sizes = gmm_inputs((4, 0, 5), 16, 8, jnp.float32)
    monkeypatch.setattr(dispatch, "call", None)  # refused before any implementation runs
    with pytest.raises(error, match=match) as info:
        fj.grouped_matmul(*make(x, w, sizes))
    assert "\n" not in str(info.value)


def test_debug_checks_report_traced_sizes_that_do_not_sum():
    x, w, _ = gmm_inputs((4, 0, 5), 16, 8, jnp.float32)
    with fj.debug_checks():
        fn = jax.jit(checkify.checkify(functools.partial(fj.grouped_matmul, x, w)))
        err, _ = fn(jnp.asarray([4, 0, 4], jnp.int32))
    with pytest.raises(Exception, match="must sum to the row count 9, got 8"):
        err.throw()
    err, _ = fn(jnp.asarray([4, 1, 4], jnp.int32))
    err.throw()


@pytest.mark.parametrize("groups,mesh,split,implementation", [
    (8, "tp=4", "groups", "xla"), (8, "dp=2,tp=4", "groups", "ragged_dot"),
    (3, "tp=2", "n", "xla")])
def test_runs_per_shard_on_a_mesh(groups, mesh, split, implementation):
    """Groups over the tensor axis (each device's partial products summed), or ``n`` when
    the groups do not divide it; the result is the unsharded one."""
    sizes = (5, 0, 1, 9, 0, 3, 2, 4)[:groups]
    x, w, group_sizes = gmm_inputs(sizes, 16, 8, jnp.float32)
    seen = []
    impl = dispatch.implementations("grouped_matmul", "cpu")[implementation]

    @dispatch.register("grouped_matmul", "spy", replace=True)
    def spy(**args):
        seen.append(tuple(args["w"].shape))
        return impl.fn(**args)

    try:
        with sharding.use_mesh(sharding.make_mesh(mesh)):
            out = jax.jit(functools.partial(fj.grouped_matmul, implementation="spy"))(
                x, w, group_sizes)
    finally:
        dispatch.unregister("grouped_matmul", "spy")
    assert seen == [(groups // 4, 16, 8) if split == "groups" else (groups, 16, 4)]
    assert_close(out, grouped_matmul_ref(x, w, sizes))


@pytest.mark.parametrize("fmt", ["int8", "mxfp4"])
def test_a_quantized_w_placed_by_group_runs_per_shard(fmt):
    """A quantized ``w`` (``[groups, n, k]``, ``trans_w``) placed split by group over the
    tensor axis: each device multiplies its 2 of 8 groups with their scales, the partial
    products summed; equal to the float64 product of the dequantized weight. Placed
    replicated, it does not split."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sizes = (5, 0, 1, 9, 0, 3, 2, 4)
    x, w, group_sizes = gmm_inputs(sizes, 64, 16, jnp.float32)
    q = fj.quantize(jnp.swapaxes(w, 1, 2), fmt)  # [groups, n, k], scales per group
    ref = grouped_matmul_ref(x, jnp.swapaxes(fj.dequantize(q), 1, 2), sizes)
    mesh = sharding.make_mesh("tp=4")
    impl = dispatch.implementations("grouped_matmul", "cpu")["xla"]
    for spec, local in ((P("tp", None, None), 2), (P(), 8)):
        seen = []

        @dispatch.register("grouped_matmul", "spy", replace=True)
        def spy(seen=seen, **args):
            seen.append((args["w"].shape, args["w"].scales.shape[0]))
            return impl.fn(**args)

        placed = fj.quant.place(q, NamedSharding(mesh, spec))
        try:
            with sharding.use_mesh(mesh):
                out = jax.jit(functools.partial(fj.grouped_matmul, trans_w=True,
                                                implementation="spy"))(x, placed, group_sizes)
        finally:
            dispatch.unregister("grouped_matmul", "spy")
        assert seen == [((local, 16, 64), local)], spec
        assert_close(out, ref)
