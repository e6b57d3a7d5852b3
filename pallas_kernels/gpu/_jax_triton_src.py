"""The plain Triton kernels (``triton.jit``) behind the ``"triton"`` implementations.

Imported only when such a kernel is launched (by :mod:`.jax_triton_elementwise`): ``triton``
comes with the ``gpu`` extra and is absent from CPU installs. Launched through
``jax_triton.triton_call``, which passes the input arrays, then the scalars, then one
pointer per output, then the ``tl.constexpr`` meta-parameters by name.
"""

import triton
import triton.language as tl


@triton.jit
def _normalise(h, w_ptr, y_ptr, row, cols, mask, n_cols, eps):
    # h: [BLOCK] float32, zeros past n_cols, so the sum is over the row.
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (h * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, n_cols, eps, y_ptr, BLOCK: tl.constexpr):
    """One program per row of ``x [rows, n_cols]``: ``y = w * x / sqrt(mean(x^2) + eps)``."""
    row = tl.program_id(0).to(tl.int64)  # row * n_cols may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    _normalise(h, w_ptr, y_ptr, row, cols, mask, n_cols, eps)


@triton.jit
def add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, n_cols, eps, y_ptr, h_ptr, BLOCK: tl.constexpr):
    """As :func:`rms_norm_kernel` of ``h = x + r``, also writing ``h`` (rounded to its dtype
    before normalising, as the XLA reference does)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offsets, h, mask=mask)
    _normalise(h.to(tl.float32), w_ptr, y_ptr, row, cols, mask, n_cols, eps)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, size, o_ptr, BLOCK: tl.constexpr):
    """``o = silu(g) * u`` over ``size`` elements, ``BLOCK`` per program, float32 math."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < size
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # g / (1 + exp(-g)): for g -> -inf, exp(-g) overflows to inf and the quotient is -0.
    tl.store(o_ptr + offsets, (g / (1.0 + tl.exp(-g)) * u).to(o_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rope_kernel(x_ptr, pos_ptr, inv_ptr, heads, head_dim, o_ptr, BLOCK_HEADS: tl.constexpr,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """RoPE of one token's ``BLOCK_HEADS`` heads of ``x [tokens, heads, head_dim]``: the
    angles ``position * inv_freq`` in float32, the ``(x1, x2)`` pairs rotated by them;
    ``HALF`` is ``head_dim // 2`` padded to a power of two."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, HALF)
    half = head_dim // 2
    in_half = i < half
    # float32 angles: in bfloat16, position 257 rounds to 256 and sin(257) is not sin(256).
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_ptr + i, mask=in_half,
                                                              other=0.0)
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    mask = (h[:, None] < heads) & in_half[None, :]
    base = token * heads * head_dim + h[:, None] * head_dim
    if INTERLEAVED:
        c1 = 2 * i
        c2 = 2 * i + 1
    else:
        c1 = i
        c2 = i + half
    x1 = tl.load(x_ptr + base + c1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + c2[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + base + c1[None, :], (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty),
             mask=mask)
    tl.store(o_ptr + base + c2[None, :], (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty),
             mask=mask)
