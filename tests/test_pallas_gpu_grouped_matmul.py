"""The Pallas GPU grouped_matmul kernel (pallas_kernels/gpu/grouped_matmul.py).

:class:`TestGroupedMatmulPallasGpu` runs the compiled kernel (``"pallas"``, skipped without a
GPU of compute capability >= 8.0); :class:`TestGroupedMatmulPallasGpuInterpret` runs the same
kernel code in Pallas' interpreter everywhere (outputs start as NaN there, so a row the
kernel should have written and did not fails the finiteness check). The behaviours come from
:class:`cases.grouped_matmul_base.GroupedMatmulCases`; the knob test cuts the rows into
16-row tiles so that groups straddle tiles. The lowering tests run the Pallas-to-Triton
lowering for CUDA on this machine (the PTX compile needs a GPU).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasGpu, assert_registered_unverified
from cases.checks import assert_close
from cases.grouped_matmul_base import ONE_GROUP, SINGLES, UNEVEN, GroupedMatmulCases, gmm_inputs
from cases.grouped_references import grouped_matmul_ref

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import grouped_matmul as kernel

ops_gmm = importlib.import_module("forge_jax.ops.grouped_matmul")
S = jax.ShapeDtypeStruct


def _kernel_call(block_m, block_n, interpret):
    def fn(x, w, group_sizes):
        starts, ends = ops_gmm.group_bounds(group_sizes, x.shape[0])
        return kernel.grouped_matmul(x, w, group_starts=starts, group_ends=ends,
                                     block_m=block_m, block_n=block_n, interpret=interpret)

    return fn


class TestGroupedMatmulPallasGpu(PallasGpu, GroupedMatmulCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = {
        "uneven-f32": (UNEVEN, 24, 48, jnp.float32),      # k and n below one block
        "singles-bf16": (SINGLES, 40, 96, jnp.bfloat16),  # partial k and n blocks
    }

    @pytest.mark.parametrize("sizes,dtype", [(SINGLES + (0, 7, 2), jnp.float16),
                                             (ONE_GROUP, jnp.float32)])
    def test_row_tiles_shared_by_groups(self, sizes, dtype):
        x, w, group_sizes = gmm_inputs(sizes, 48, 40, dtype, pad=3)
        out = jax.jit(_kernel_call(16, 16, self.INTERPRET))(x, w, group_sizes)
        self.assert_padded_output(out, x, w, sizes)


class TestGroupedMatmulPallasGpuInterpret(TestGroupedMatmulPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


def test_registered_for_gpu_by_name_until_verified():
    assert_registered_unverified("grouped_matmul", "gpu")


# --- the contract with the CUDA lowering -------------------------------------------------


@pytest.mark.parametrize("m,k,n,groups,dtype", [
    (37, 24, 48, 5, jnp.bfloat16),
    (300, 2048, 768, 8, jnp.bfloat16),     # Qwen3-MoE's expert width
    (8, 256, 384, 64, jnp.float16),        # decode: fewer rows than experts
    (33, 64, 64, 3, jnp.float32),
])
def test_accepted_cases_lower_for_cuda(m, k, n, groups, dtype):
    assert kernel.supports(dict(x=S((m, k), dtype), w=S((groups, k, n), dtype))) is None
    text = _compat.export_for_cuda(_kernel_call(None, None, False), S((m, k), dtype),
                                   S((groups, k, n), dtype),
                                   S((groups,), jnp.int32)).mlir_module()
    assert "__gpu$xla.gpu.triton" in text and "forge_jax_grouped_matmul" in text


def test_blocks_must_be_powers_of_two():
    """Triton dots need power-of-two operands of at least 16; every table entry is one."""
    for kind in (None, "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"):
        config = kernel.default_config({}, kind)
        for b in (config.block_m, config.block_k, config.block_n):
            assert b >= 16 and b & (b - 1) == 0, (kind, config)
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        _compat.export_for_cuda(_kernel_call(24, None, False), S((37, 24), jnp.float32),
                                S((5, 24, 48), jnp.float32), S((5,), jnp.int32))


def test_rejects_float64_and_huge_arrays():
    with jax.enable_x64(True):
        x = S((8, 16), jnp.float64)
        assert "float64" in kernel.supports(dict(x=x, w=S((2, 16, 16), jnp.float64)))
    huge = S((2**16, 2**15), jnp.bfloat16)
    assert "int32" in kernel.supports(dict(x=huge, w=S((1, 2**15, 16), jnp.bfloat16)))


# --- a quantized w, dequantized in the kernel ---------------------------------------------

QUANTIZED = {
    "int8": dict(format="int8"),
    "int4-g16": dict(format="int4", group_size=16),
    "int4-g16-asym": dict(format="int4", group_size=16, symmetric=False),
}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_w_in_the_interpreter(name):
    """Groups straddling 16-row tiles, partial n blocks, three k blocks (int4: a scale
    group each), NaN padding rows: against the float64 product with the dequantized w."""
    sizes = SINGLES + (0, 7, 2)
    x, w, group_sizes = gmm_inputs(sizes, 48, 40, jnp.float32, pad=3)
    q = fj.quantize(jnp.swapaxes(w, 1, 2), **QUANTIZED[name])  # [groups, n, k]

    def fn(x, q, group_sizes):
        starts, ends = ops_gmm.group_bounds(group_sizes, x.shape[0])
        return kernel.grouped_matmul(x, q, group_starts=starts, group_ends=ends, trans_w=True,
                                     block_m=16, block_k=16, block_n=16, interpret=True)

    out = jax.jit(fn)(x, q, group_sizes)
    np.testing.assert_array_equal(np.asarray(out[sum(sizes):]), 0.0)
    wd = np.asarray(fj.dequantize(q), np.float64).transpose(0, 2, 1)  # [groups, k, n]
    assert_close(out, grouped_matmul_ref(np.nan_to_num(np.asarray(x, np.float64)), wd, sizes),
                 implementation="pallas_gpu_interpret")
    with pytest.raises(NotImplementedError, match="no gradient with a quantized w"):
        jax.grad(lambda x: fn(x, q, group_sizes).sum())(x)


def test_quantized_supports_and_refusals():
    x, q8 = S((37, 256), jnp.bfloat16), fj.quantize(jnp.ones((4, 128, 256)), "int8")
    assert kernel.supports(dict(x=x, w=q8, trans_w=True)) is None
    assert "[groups, n, k]" in kernel.supports(dict(x=x, w=q8, trans_w=False))
    fp8 = fj.quantize(jnp.ones((4, 128, 256)), "fp8")
    assert "compute capability >= 8.9" in kernel.supports(dict(x=x, w=fp8, trans_w=True))
    mxfp4 = fj.quantize(jnp.ones((4, 128, 256)), "mxfp4")
    assert "not FP4 E2M1 codes" in kernel.supports(dict(x=x, w=mxfp4, trans_w=True))
    assert "trans_w=True with a float w" in kernel.supports(
        dict(x=x, w=S((4, 128, 256), jnp.bfloat16), trans_w=True))


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int4", 32)])
def test_quantized_cases_lower_for_cuda(fmt, group):
    """Qwen3-MoE's decode shape (8 rows over 8 experts of 768 x 2048) through the CUDA
    lowering (the PTX compile needs a GPU: not run here)."""
    q = jax.eval_shape(lambda w: fj.quantize(w, fmt, group_size=group),
                       S((8, 768, 2048), jnp.float32))

    def fn(x, q, group_sizes):
        starts, ends = ops_gmm.group_bounds(group_sizes, x.shape[0])
        return kernel.grouped_matmul(x, q, group_starts=starts, group_ends=ends, trans_w=True)

    text = _compat.export_for_cuda(fn, S((8, 2048), jnp.bfloat16), q,
                                   S((8,), jnp.int32)).mlir_module()
    assert "forge_jax_grouped_matmul_quantized" in text
