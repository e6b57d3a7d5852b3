"""The Pallas TPU (Mosaic) grouped_matmul kernel (pallas_kernels/tpu/grouped_matmul.py).

:class:`TestGroupedMatmulPallasTpu` runs the compiled kernel (``"pallas"``, skipped off TPU);
:class:`TestGroupedMatmulPallasTpuInterpret` runs the same tests on the same kernel code in
the TPU interpreter (race detection, uninitialised memory read as NaN). The behaviours come
from :class:`cases.grouped_matmul_base.GroupedMatmulCases` (empty, single-row and very
uneven groups, NaN padding rows, gradients) with lane-dense ``k`` and ``n``; the knob test
cuts the rows into 16-row tiles so that groups straddle tiles and a tile is visited by
several groups. The lowering tests run the real Mosaic lowering for TPU on this machine.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest
from cases.base import PallasTpu, assert_registered_unverified
from cases.grouped_matmul_base import ONE_GROUP, SINGLES, UNEVEN, GroupedMatmulCases, gmm_inputs

import forge_jax as fj
from forge_jax import _compat, dispatch
from forge_jax.pallas_kernels.tpu import _common as tpu_common
from forge_jax.pallas_kernels.tpu import grouped_matmul as kernel

ops_gmm = importlib.import_module("forge_jax.ops.grouped_matmul")
S = jax.ShapeDtypeStruct


class TestGroupedMatmulPallasTpu(PallasTpu, GroupedMatmulCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = {
        "uneven-f32": (UNEVEN, 128, 128, jnp.float32),
        "singles-bf16": (SINGLES, 128, 256, jnp.bfloat16),
    }

    @pytest.mark.parametrize("sizes,dtype,block_m", [(SINGLES + (0, 7, 2), jnp.bfloat16, 16),
                                                     (ONE_GROUP, jnp.float32, 8)])
    def test_row_tiles_shared_by_groups(self, sizes, dtype, block_m):
        """Tiles of ``block_m`` rows, two ``n`` blocks; NaN padding rows past the groups."""
        x, w, group_sizes = gmm_inputs(sizes, 128, 256, dtype, pad=3)

        def fn(x, w, group_sizes):
            starts, ends = ops_gmm.group_bounds(group_sizes, x.shape[0])
            return kernel.grouped_matmul(x, w, group_starts=starts, group_ends=ends,
                                         block_m=block_m, block_n=128, interpret=self.INTERPRET)

        out = jax.jit(fn)(x, w, group_sizes)
        self.assert_padded_output(out, x, w, sizes)


class TestGroupedMatmulPallasTpuInterpret(TestGroupedMatmulPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def test_registered_for_tpu_by_name_until_verified():
    assert_registered_unverified("grouped_matmul", "tpu")


# --- the contract with the Mosaic lowering -----------------------------------------------


def _lower(m, k, n, groups, dtype, **knobs):
    def fn(x, w, group_sizes):
        starts, ends = ops_gmm.group_bounds(group_sizes, x.shape[0])
        return kernel.grouped_matmul(x, w, group_starts=starts, group_ends=ends, **knobs)

    return _compat.export_for_tpu(fn, S((m, k), dtype), S((groups, k, n), dtype),
                                  S((groups,), jnp.int32))


@pytest.mark.parametrize("m,k,n,groups,dtype", [
    (37, 128, 128, 5, jnp.float32),
    (300, 2048, 768, 8, jnp.bfloat16),     # Qwen3-MoE's expert width; 3 row tiles, 2 k blocks
    (8, 256, 384, 64, jnp.bfloat16),       # decode: fewer rows than experts
])
def test_accepted_cases_lower_for_tpu(m, k, n, groups, dtype):
    args = dict(x=S((m, k), dtype), w=S((groups, k, n), dtype))
    assert kernel.supports(args) is None
    assert "forge_jax_tpu_grouped_matmul" in _lower(m, k, n, groups, dtype).mlir_module()


def test_row_tiles_off_the_sublane_tile_fail_lowering():
    """Why the table's block_m are multiples of 16 (or all the rows)."""
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower(37, 128, 128, 5, jnp.float32, block_m=4)
    for kind in (*tpu_common.GENERATIONS, "interpret", "default"):
        config = kernel.default_config({}, kind)
        assert config.block_m % 16 == 0 and config.block_k % 128 == 0, kind
        assert config.block_n % 128 == 0, kind


def test_block_sizes():
    config = kernel.Config(block_m=128, block_k=512, block_n=512)
    assert kernel.block_sizes(9, 128, 256, config) == (9, 128, 256)  # whole dimensions
    assert kernel.block_sizes(300, 640, 1024, config) == (128, 128, 512)  # tk divides k
    assert kernel.block_sizes(300, 2048, 768, config) == (128, 512, 512)


def test_policy_rejections():
    """float16 and unaligned k or n (they lower, but no TPU has compiled them)."""
    f16 = dict(x=S((8, 128), jnp.float16), w=S((2, 128, 128), jnp.float16))
    assert "float16" in kernel.supports(f16)
    odd = dict(x=S((8, 96), jnp.float32), w=S((2, 96, 128), jnp.float32))
    assert "multiples of 128" in kernel.supports(odd)
    x, w, sizes = gmm_inputs(UNEVEN, 96, 128, jnp.float32)
    with pytest.raises(dispatch.ImplementationError, match="multiples of 128"):
        fj.grouped_matmul(x, w, sizes, implementation="pallas_tpu_interpret")
