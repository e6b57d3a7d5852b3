"""``fj.grouped_matmul`` with a quantized right-hand side (a mixture of experts' quantized
expert weights): each format against the float64 product with the dequantized weight, on
group-size patterns with empty, single-row and uneven groups, the sizes traced under jit;
one group's weight in full precision at a time (the compiled temporaries); the Pallas
TPU kernel and ``ragged_dot`` refuse it with their reason (dispatch falls back to XLA; the
GPU kernel's quantized path is tested in its own file); no
gradient through a quantized weight; bad inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.grouped_matmul_base import ONE_GROUP, SINGLES, UNEVEN
from cases.grouped_references import grouped_matmul_ref
from cases.inputs import normal, rng
from cases.references import f64

import forge_jax as fj
from forge_jax import dispatch
from forge_jax.pallas_kernels.gpu import grouped_matmul as gpu_kernel
from forge_jax.pallas_kernels.tpu import grouped_matmul as tpu_kernel

# format -> fj.quantize's keyword arguments, for a stacked [groups, n, k] weight.
FORMATS = {
    "int8": dict(format="int8"),
    "int4-g32": dict(format="int4", group_size=32),
    "int4-g32-asym": dict(format="int4", group_size=32, symmetric=False),
    "fp8": dict(format="fp8"),
    "fp8-blocks": dict(format="fp8", block=(128, 128)),
}
# The base patterns, each padded to 6 groups and 45 rows (NaN rows past the groups), so
# that one compilation serves them all (the sizes are traced).
PATTERNS = {"uneven": UNEVEN + (0,), "singles": SINGLES, "one-group": ONE_GROUP + (0, 0)}
ROWS = 45


def _inputs(sizes, k, n, dtype=jnp.float32, *, pad=0, seed=0, rows=None):
    """``x [rows or sum(sizes) + pad, k]`` (NaN padding rows), a float ``w [groups, n, k]``
    and the int32 sizes."""
    gen = rng(seed, len(sizes), k, n)
    m = sum(sizes)
    x = np.asarray(normal(gen, (rows or m + pad, k), jnp.float32)).copy()
    x[m:] = np.nan
    return (jnp.asarray(x, dtype), normal(gen, (len(sizes), n, k), jnp.float32),
            jnp.asarray(sizes, jnp.int32))


@functools.cache
def _jitted(trans_w):
    return jax.jit(functools.partial(fj.grouped_matmul, trans_w=trans_w))


def _reference(x, q, sizes, trans_w):
    w = f64(fj.dequantize(q, x.dtype))  # the weight in the compute dtype
    return grouped_matmul_ref(np.nan_to_num(f64(x)), w.transpose(0, 2, 1) if trans_w else w,
                              sizes)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_matches_float64_of_the_dequantized_weight(fmt):
    for seed, (pattern, sizes) in enumerate(sorted(PATTERNS.items())):
        x, w, group_sizes = _inputs(sizes, 128, 128, rows=ROWS, seed=seed)
        q = fj.quantize(w, **FORMATS[fmt])
        assert q.scales.shape[0] == len(sizes)  # scales per group
        out = _jitted(True)(x, q, group_sizes)
        assert out.dtype == jnp.float32 and out.shape == (ROWS, 128)
        np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0, err_msg=pattern)
        assert_close(out, _reference(x, q, sizes, True), err_msg=pattern)
        # Quantization changed the weight (the reference is not the float product).
        assert np.abs(f64(fj.dequantize(q)) - f64(w)).max() > 1e-4


def test_the_k_n_layout_and_bfloat16():
    """``w`` as ``[groups, k, n]`` (int8 with one scale per column: ``block=(k, 1)``) and
    bfloat16 activations (the weight dequantized to bfloat16 in the loop)."""
    sizes = UNEVEN
    x, w, group_sizes = _inputs(sizes, 48, 40)
    q = fj.quantize(jnp.swapaxes(w, 1, 2), "int8", block=(48, 1))  # [groups, k, n]
    assert q.scales.shape == (len(sizes), 1, 40)
    assert_close(_jitted(False)(x, q, group_sizes), _reference(x, q, sizes, False))
    xb = x.astype(jnp.bfloat16)
    out = _jitted(False)(xb, q, group_sizes)
    assert out.dtype == jnp.bfloat16
    assert_close(out, _reference(xb, q, sizes, False))


def test_one_groups_weight_at_a_time():
    """The compiled XLA implementation's temporaries stay far below a float32 copy of
    every group's weight (it dequantizes one group per step of its loop)."""
    x, w, group_sizes = _inputs((3, 0, 9, 1) * 8, 64, 128)
    q = fj.quantize(w, "int8")
    compiled = _jitted(True).lower(x, q, group_sizes).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("no memory analysis on this backend")
    full = w.size * 4
    assert stats.temp_size_in_bytes < full / 4, (stats.temp_size_in_bytes, full)


def test_kernels_refuse_a_quantized_w_and_dispatch_falls_back_to_xla():
    x, w, group_sizes = _inputs(UNEVEN, 128, 128)
    q = fj.quantize(w, "int8")
    args = dispatch.bind("grouped_matmul", x, q, group_sizes, trans_w=True)
    # The TPU kernel refuses a quantized w; the GPU kernel dequantizes int8/int4 (its own
    # tests), but is not verified on a GPU, so auto dispatch does not pick it there.
    assert "quantized w (int8)" in tpu_kernel.supports(args)
    with pytest.raises(ValueError, match="quantized w"):
        tpu_kernel.grouped_matmul(x, q, group_starts=args["group_starts"],
                                  group_ends=args["group_ends"], trans_w=True, interpret=True)
    assert gpu_kernel.supports(args) is None
    float_args = dispatch.bind("grouped_matmul", x, w, group_sizes, trans_w=True)
    assert "trans_w=True" in gpu_kernel.supports(float_args)
    assert "trans_w=True" in tpu_kernel.supports(float_args)
    for platform in ("gpu", "tpu"):
        selection = dispatch.select("grouped_matmul", args, platform=platform)
        assert selection.implementation == "xla", selection
    with pytest.raises(fj.dispatch.ImplementationError, match="ragged_dot multiplies float"):
        fj.grouped_matmul(x, q, group_sizes, trans_w=True, implementation="ragged_dot")


def test_float_w_in_the_n_k_layout_and_its_gradients():
    """``trans_w`` with a float ``w``: the same product and gradients as the ``[groups, k,
    n]`` layout (float64 references)."""
    x, w, group_sizes = _inputs(SINGLES, 32, 24, pad=1)
    out = _jitted(True)(x, w, group_sizes)
    wt = f64(w).transpose(0, 2, 1)
    assert_close(out, grouped_matmul_ref(np.nan_to_num(f64(x)), wt, SINGLES))
    ct = normal(rng(5), out.shape)
    loss = lambda w, s: jnp.sum(fj.grouped_matmul(x, w, s, trans_w=True) * ct)
    dw = jax.jit(jax.grad(loss))(w, group_sizes)  # sizes traced (NaN padding rows)
    xs = np.nan_to_num(f64(x))
    start = 0
    for i, size in enumerate(SINGLES):
        ref = f64(ct)[start:start + size].T @ xs[start:start + size]  # [n, k]
        np.testing.assert_allclose(f64(dw[i]), ref, atol=1e-4, rtol=1e-4)
        start += size


def test_no_gradient_through_a_quantized_w():
    x, w, group_sizes = _inputs(UNEVEN, 32, 32)
    q = fj.quantize(w, "int8")
    with pytest.raises(NotImplementedError, match="no gradient with a quantized w"):
        jax.grad(lambda x: fj.grouped_matmul(x, q, group_sizes, trans_w=True).sum())(x)
    dx = jax.grad(lambda x: fj.grouped_matmul(x, w, group_sizes, trans_w=True).sum())(x)
    assert np.isfinite(np.asarray(dx)).all() and np.abs(np.asarray(dx)).max() > 0


def test_bad_quantized_inputs_are_one_line_errors():
    x, w, group_sizes = _inputs(UNEVEN, 32, 32)
    shared = fj.quantize(w, "int8", block=(5, 32, 32))  # one scale over all the groups
    with pytest.raises(ValueError, match=r"own scales per group .* block=\(5, 32, 32\)"):
        fj.grouped_matmul(x, shared, group_sizes, trans_w=True)
    narrow = fj.quantize(w[:, :, :16], "int8")
    with pytest.raises(ValueError, match=r"w must be \[groups, n, k\] \(trans_w=True\) with "
                                         r"k = x.shape\[1\] = 32, got w.shape=\(5, 32, 16\)"):
        fj.grouped_matmul(x, narrow, group_sizes, trans_w=True)
    with pytest.raises(TypeError, match="trans_w must be a bool"):
        fj.grouped_matmul(x, w, group_sizes, trans_w=1)
    # W8A8 (int8 activations) is a numerics choice the grouped product does not make: a
    # w that asks for it is refused, not multiplied as W8A16.
    w8a8 = fj.quantize(w, "int8", activations="int8")
    with pytest.raises(ValueError, match=r"w.activations='int8' \(W8A8\)"):
        fj.grouped_matmul(x, w8a8, group_sizes, trans_w=True)
