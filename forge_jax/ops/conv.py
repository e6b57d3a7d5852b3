"""Two-dimensional convolution (cross-correlation, as in every deep-learning library)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from forge_jax import _checks, dispatch

LAYOUTS = {
    # layout -> (x, w, out) dimension names for jax.lax.conv_general_dilated.
    "NHWC": ("NHWC", "HWIO", "NHWC"),
    "NCHW": ("NCHW", "OIHW", "NCHW"),
}


def _pair(name: str, given) -> tuple[int, int]:
    value = given
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value, value)
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1
                   for v in value)):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {name}={given!r}")
    return int(value[0]), int(value[1])


def _padding(padding, in_hw, k_hw, stride, dilation):
    """``((top, bottom), (left, right))``; "SAME" gives ``ceil(in / stride)`` outputs per
    dimension, the extra row or column of padding at the end (TensorFlow's and JAX's)."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return ((0, 0), (0, 0))
        if mode == "SAME":
            out = []
            for n, k, s, d in zip(in_hw, k_hw, stride, dilation, strict=True):
                total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
                out.append((total // 2, total - total // 2))
            return tuple(out)
        raise ValueError(f"padding must be 'SAME', 'VALID', an int or pairs, got {padding=!r}")
    pads = padding
    if isinstance(pads, numbers.Integral) and not isinstance(pads, bool):
        pads = (pads, pads)
    try:
        pads = tuple((p, p) if isinstance(p, numbers.Integral) else tuple(p) for p in pads)
    except TypeError:
        pads = None
    if (pads is None or len(pads) != 2 or any(len(p) != 2 for p in pads)
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
                   for p in pads for v in p)):
        raise ValueError(f"padding must be 'SAME', 'VALID', an int >= 0, (pad_h, pad_w) or "
                         f"((top, bottom), (left, right)), got {padding=!r}")
    return tuple((int(a), int(b)) for a, b in pads)


def _conv2d_args(x, w, *, stride=1, padding="VALID", dilation=1, groups=1, layout="NHWC"):
    _checks.array("x", x, ndim=4)
    _checks.array("w", w, ndim=4)
    _checks.same_dtype(("x", x), ("w", w))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout=!r}")
    stride = _pair("stride", stride)
    dilation = _pair("dilation", dilation)
    groups = _checks.positive_int("groups", groups)
    if layout == "NHWC":
        _, h, wd, cin = x.shape
        kh, kw, w_in, cout = w.shape
        w_names = "[kh, kw, in_channels // groups, out_channels]"
    else:
        _, cin, h, wd = x.shape
        cout, w_in, kh, kw = w.shape
        w_names = "[out_channels, in_channels // groups, kh, kw]"
    if cin % groups or cout % groups:
        raise ValueError(f"groups={groups} must divide the input channels ({cin}) and the "
                         f"output channels ({cout}): {x.shape=}, {w.shape=}, {layout=}")
    if w_in != cin // groups:
        raise ValueError(f"w must be {w_names} for {layout}, with in_channels // groups = "
                         f"{cin // groups}; got {w.shape=} for {x.shape=}, {groups=}")
    pads = _padding(padding, (h, wd), (kh, kw), stride, dilation)
    for name, n, k, (lo, hi), d in (("height", h, kh, pads[0], dilation[0]),
                                    ("width", wd, kw, pads[1], dilation[1])):
        if n + lo + hi < (k - 1) * d + 1:
            raise ValueError(f"the kernel's dilated {name} {(k - 1) * d + 1} exceeds the padded "
                             f"input's {n + lo + hi}: {x.shape=}, {w.shape=}, {padding=}")
    return dict(x=x, w=w, stride=stride, padding=pads, dilation=dilation, groups=groups,
                layout=layout)


def conv2d(x, w, *, stride=1, padding="VALID", dilation=1, groups=1, layout="NHWC",
           implementation=None):
    """2-D convolution (cross-correlation) with stride, padding, dilation and groups.

    In NHWC, ``out[b, i, j, o] = sum_{p, q, c} xp[b, i*sh + p*dh, j*sw + q*dw, g*C + c] *
    w[p, q, c, o]`` with ``xp`` the zero-padded input, ``C = in_channels // groups`` and
    ``g = o // (out_channels // groups)`` the group of output channel ``o``; NCHW is the
    same computation with the channels first. Products accumulate in float32 and the
    result is rounded once to ``x.dtype``.

    Args:
      x: ``[batch, height, width, in_channels]`` (NHWC) or ``[batch, in_channels, height,
        width]`` (NCHW), float32/float16/bfloat16.
      w: NHWC: ``[kh, kw, in_channels // groups, out_channels]`` (HWIO); NCHW:
        ``[out_channels, in_channels // groups, kh, kw]`` (OIHW, PyTorch's), ``x``'s dtype.
      stride, dilation: an int or ``(height, width)`` ints >= 1 (dilation spaces the
        kernel's taps).
      padding: ``"VALID"`` (none), ``"SAME"`` (``ceil(size / stride)`` outputs, the odd
        row or column of padding at the end), an int, ``(pad_h, pad_w)`` or ``((top,
        bottom), (left, right))``.
      groups: input and output channels split into this many independent groups (both
        divisible by it); ``groups == in_channels`` is a depthwise convolution.
      layout: ``"NHWC"`` or ``"NCHW"``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``[batch, out_h, out_w, out_channels]`` (NHWC) or ``[batch, out_channels, out_h,
      out_w]`` (NCHW) in ``x.dtype``, ``out = (in + pads - (k - 1) * d - 1) // s + 1``.
    """
    args = _conv2d_args(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups,
                        layout=layout)
    return dispatch.call("conv2d", args, implementation)


dispatch.define("conv2d", _conv2d_args)


@dispatch.register("conv2d", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jax.lax.conv_general_dilated, float32 accumulation")
def conv2d_xla(x, w, *, stride, padding, dilation, groups, layout):
    with jax.named_scope("conv2d"):
        out = jax.lax.conv_general_dilated(
            x, w, window_strides=stride, padding=padding, rhs_dilation=dilation,
            dimension_numbers=LAYOUTS[layout], feature_group_count=groups,
            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return out.astype(x.dtype)
