"""``fj.conv2d`` (its XLA implementation) against explicit float64 loops: both layouts,
strides, "SAME"/"VALID"/explicit padding, dilation, groups (depthwise included), three
dtypes, and its gradients through the adjoint identity ``<dL/dx, e> = sum(conv(e, w) * ct)``
(the convolution is linear in each argument); argument errors name the values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.conv_references import conv2d_ref
from cases.inputs import normal, rng
from cases.references import f64

import forge_jax as fj
from forge_jax import dispatch

# (layout, x shape, (kh, kw), out channels, stride, padding, explicit padding of the
# reference, dilation, groups, dtype)
CASES = {
    "nhwc-valid": ("NHWC", (2, 7, 6, 3), (3, 3), 4, 1, "VALID", ((0, 0), (0, 0)), 1, 1,
                   jnp.float32),
    "nhwc-same-stride2": ("NHWC", (1, 8, 7, 4), (3, 2), 6, 2, "SAME", ((0, 1), (0, 1)), 1, 2,
                          jnp.bfloat16),
    "nchw-explicit-dilated": ("NCHW", (2, 4, 9, 8), (2, 3), 4, (2, 1), ((1, 2), (0, 1)),
                              ((1, 2), (0, 1)), (2, 2), 1, jnp.float32),
    "nchw-depthwise-same": ("NCHW", (1, 6, 5, 5), (3, 3), 6, 1, "SAME", ((1, 1), (1, 1)), 1, 6,
                            jnp.float16),
    "nhwc-int-padding": ("NHWC", (1, 5, 5, 2), (3, 3), 3, 1, 1, ((1, 1), (1, 1)), 1, 1,
                         jnp.float32),
}


def _inputs(layout, shape, kernel, cout, groups, dtype, seed=0):
    gen = rng(seed, *shape)
    cin = shape[3] if layout == "NHWC" else shape[1]
    w_shape = ((*kernel, cin // groups, cout) if layout == "NHWC"
               else (cout, cin // groups, *kernel))
    return normal(gen, shape, dtype), normal(gen, w_shape, dtype)


def _pairs(v):
    return (v, v) if isinstance(v, int) else v


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_loops(case):
    layout, shape, kernel, cout, stride, padding, pads, dilation, groups, dtype = CASES[case]
    x, w = _inputs(layout, shape, kernel, cout, groups, dtype)
    fn = jax.jit(functools.partial(fj.conv2d, stride=stride, padding=padding,
                                   dilation=dilation, groups=groups, layout=layout))
    out = fn(x, w)
    ref = conv2d_ref(x, w, stride=_pairs(stride), padding=pads, dilation=_pairs(dilation),
                     groups=groups, layout=layout)
    assert out.dtype == dtype
    assert_close(out, ref)


@pytest.mark.parametrize("case", ["nchw-explicit-dilated", "nhwc-same-stride2"])
def test_grads_satisfy_the_adjoint_identity(case):
    layout, shape, kernel, cout, stride, padding, pads, dilation, groups, _ = CASES[case]
    x, w = _inputs(layout, shape, kernel, cout, groups, jnp.float32)
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, layout=layout)
    ref_kw = dict(stride=_pairs(stride), padding=pads, dilation=_pairs(dilation), groups=groups,
                  layout=layout)
    out = fj.conv2d(x, w, **kw, implementation="xla")
    gen = rng(9)
    ct = normal(gen, out.shape)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(fj.conv2d(x, w, **kw) * ct), (0, 1)))(x, w)
    ex, ew = normal(gen, x.shape), normal(gen, w.shape)
    lhs = (np.sum(f64(dx) * f64(ex)), np.sum(f64(dw) * f64(ew)))
    rhs = (np.sum(conv2d_ref(ex, w, **ref_kw) * f64(ct)),
           np.sum(conv2d_ref(x, ew, **ref_kw) * f64(ct)))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(groups=2), ValueError, r"groups=2 must divide the input channels \(3\)"),
    (dict(stride=0), ValueError, r"stride must be a positive int .* stride=0"),
    (dict(padding="FULL"), ValueError, r"padding must be 'SAME', 'VALID'"),
    (dict(padding=((1, 2, 3), (0, 0))), ValueError, r"padding must be"),
    (dict(padding=-1), ValueError, r"padding=-1"),
    (dict(layout="NWHC"), ValueError, r"layout must be one of"),
    (dict(dilation=(4, 1)), ValueError, r"dilated height 9 exceeds the padded input's 7"),
])
def test_bad_arguments_raise_one_line_errors(kwargs, error, match, monkeypatch):
    x, w = _inputs("NHWC", (1, 7, 6, 3), (3, 3), 4, 1, jnp.float32)
    monkeypatch.setattr(dispatch, "call", None)  # refused before any implementation runs
    with pytest.raises(error, match=match) as info:
        fj.conv2d(x, w, **kwargs)
    assert "\n" not in str(info.value)


def test_weight_and_dtype_errors():
    x, w = _inputs("NHWC", (1, 7, 6, 3), (3, 3), 4, 1, jnp.float32)
    with pytest.raises(ValueError, match=r"w must be \[out_channels, in_channels // groups"):
        fj.conv2d(x, w, layout="NCHW")
    with pytest.raises(TypeError, match=r"x.dtype=float32, w.dtype=bfloat16"):
        fj.conv2d(x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x must have rank 4"):
        fj.conv2d(x[0], w)
