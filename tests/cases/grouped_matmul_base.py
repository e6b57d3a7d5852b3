"""The behaviours of every implementation of ``fj.grouped_matmul``: each output against the
float64 reference (:mod:`cases.grouped_references`) and the XLA implementation, through the
public op with ``implementation=IMPLEMENTATION``, with the group sizes traced."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from cases.base import ImplementationCases, parametrize_from
from cases.checks import assert_close
from cases.grouped_references import grouped_matmul_grads_ref, grouped_matmul_ref
from cases.inputs import normal, rng
from cases.references import f64
from forge_jax import dispatch

# Group-size patterns: empty groups first, last and between; single-row groups; one group
# holding nearly every row.
UNEVEN = (0, 1, 30, 0, 6)
SINGLES = (1, 1, 1, 0, 0, 40)
ONE_GROUP = (0, 0, 0, 9)


def gmm_inputs(sizes, k, n, dtype, *, pad=0, seed=0):
    """``x [sum(sizes) + pad, k]`` (``pad`` trailing rows of NaN), ``w [groups, k, n]`` and
    int32 ``group_sizes``."""
    gen = rng(seed, len(sizes), k)
    m = sum(sizes)
    x = np.asarray(normal(gen, (m + pad, k), jnp.float32)).copy()
    x[m:] = np.nan
    return (jnp.asarray(x, dtype), normal(gen, (len(sizes), k, n), dtype),
            jnp.asarray(sizes, jnp.int32))


def jit_gmm(implementation, **knobs):
    """The op under jit with the group sizes traced (one compilation per shape)."""
    return jax.jit(functools.partial(fj.grouped_matmul, implementation=implementation,
                                     **knobs))


class GroupedMatmulCases(ImplementationCases):
    """Case table ``CASES``: ``{id: (group sizes, k, n, dtype)}``."""

    CASES: dict[str, tuple]

    @parametrize_from("CASES", "sizes,k,n,dtype")
    def test_matches_reference_and_xla(self, sizes, k, n, dtype):
        x, w, group_sizes = gmm_inputs(sizes, k, n, dtype)
        out = jit_gmm(self.IMPLEMENTATION)(x, w, group_sizes)
        assert out.dtype == dtype and out.shape == (sum(sizes), n)
        assert_close(out, grouped_matmul_ref(x, w, sizes), implementation=self.IMPLEMENTATION)
        if self.IMPLEMENTATION != "xla":
            xla = jit_gmm("xla")(x, w, group_sizes)
            assert_close(out, f64(xla), implementation=self.IMPLEMENTATION)

    def test_rows_past_the_groups_are_zero(self):
        """Traced sizes summing below the row count: the NaN padding rows give zeros and
        reach no other row."""
        x, w, group_sizes = gmm_inputs(UNEVEN, 128, 128, jnp.float32, pad=5)
        out = np.asarray(jit_gmm(self.IMPLEMENTATION)(x, w, group_sizes))
        assert np.isfinite(out).all()
        self.assert_padded_output(out, x, w, UNEVEN)

    def assert_padded_output(self, out, x, w, sizes):
        """``out`` of ``x`` with padding rows past the groups: zeros there, the float64
        reference's values in the groups."""
        np.testing.assert_array_equal(np.asarray(out[sum(sizes):], np.float32), 0.0)
        assert_close(out, grouped_matmul_ref(x, w, sizes), implementation=self.IMPLEMENTATION)

    def test_grads_match_float64(self):
        """d x and d w with empty groups and NaN padding rows: zeros where no group reaches,
        never NaN."""
        x, w, group_sizes = gmm_inputs(SINGLES, 128, 128, jnp.float32, pad=3)
        ct = normal(rng(7), (x.shape[0], w.shape[2]))

        def loss(x, w, group_sizes):
            out = fj.grouped_matmul(x, w, group_sizes, implementation=self.IMPLEMENTATION)
            return jnp.sum(out * ct)

        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, group_sizes)
        dx_ref, dw_ref = grouped_matmul_grads_ref(np.nan_to_num(f64(x)), w, SINGLES, ct)
        assert_close(dx, dx_ref, implementation=self.IMPLEMENTATION, err_msg="dx")
        assert_close(dw, dw_ref, implementation=self.IMPLEMENTATION, factor=4, err_msg="dw")
        np.testing.assert_array_equal(np.asarray(dw)[3:5], 0.0)  # the empty groups
        np.testing.assert_array_equal(np.asarray(dx)[sum(SINGLES):], 0.0)

    def test_one_shards_groups(self):
        """Groups 2-4 of 6 alone, as the partition rule hands them to one device: their
        rows (which start past row 0) are computed, every other row is zero."""
        sizes = (3, 9, 4, 0, 17, 5)
        x, w, group_sizes = gmm_inputs(sizes, 128, 128, jnp.float32)
        bound = fj.dispatch.bind("grouped_matmul", x, w, group_sizes)
        fn = dispatch.implementations("grouped_matmul")[self.IMPLEMENTATION].fn
        out = jax.jit(lambda x, w, starts, ends: fn(x=x, w=w, group_starts=starts,
                                                    group_ends=ends))(
            x, w[2:5], bound["group_starts"][2:5], bound["group_ends"][2:5])
        ref = grouped_matmul_ref(x, w, sizes)
        ref[:12], ref[33:] = 0.0, 0.0
        np.testing.assert_array_equal(np.asarray(out)[:12], 0.0)
        assert_close(out, ref, implementation=self.IMPLEMENTATION)
