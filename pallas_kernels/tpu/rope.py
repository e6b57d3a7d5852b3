"""Pallas TPU kernel (Mosaic): rotary position embedding (RoPE), both pairing conventions.

``x [batch, seq, heads, head_dim]`` is viewed, for free, as ``[tokens, heads * head_dim]``:
the heads sit side by side along the lanes, so a head_dim of 64 fills the vregs as well as
one of 128. Grid ``(cdiv(tokens, block_tokens),)`` over ``(block_tokens, heads * head_dim)``
blocks, ``block_tokens`` a multiple of the sublane tile (8 for float32, 16 for bfloat16),
also when there are fewer tokens (Pallas clips the writes of a partial block on TPU): the
lane rotations below need vreg-aligned shapes.

Each block computes the float32 angles ``position * inv_freq`` and their cosines and sines
once for a ``[block_tokens, width]`` slab (no ``[seq, head_dim]`` table in memory; only a
``[2, width]`` lane table built on the host from the ``[head_dim // 2]`` inverse frequencies
of :func:`forge_jax.ops.rope.inverse_frequencies`, which carry the scaling, and the sign of
each lane's rotation), then rotates every ``width``-lane chunk of the row with them.
``width`` is a multiple of both 128 and head_dim, so every chunk starts on a head and on a
vreg. Each lane ``j`` is paired with the lane ``d`` away (``d = head_dim // 2`` for the
rotate-half convention, ``d = 1`` for the interleaved GPT-J one):
``out[j] = x[j] * cos[j] + sign[j] * x[j + sign[j] * d] * sin[j]`` with ``sign = -1`` on
the first lane of each pair, and the partners come from two lane rotations (``pltpu.roll``)
and a select, which costs the same for both conventions. Math in float32.

A row of ``heads * head_dim`` that is not a multiple of ``width`` (e.g. 9 heads of 64:
576 lanes, not a multiple of 128) ends in a narrower tail chunk of whole heads. Such rows
were once rejected as shapes Mosaic's lane rotation would refuse, and the rejection hid a
bug: the tail lanes were never written. libtpu's compiler accepts them (9x64, 3x80, 1x96,
3x192 and others, both conventions, float32 and bfloat16, on v4, v5e and v6e; compiled
deviceless with forge_jax.aot, JAX 0.10.2, 2026-11-25) and the interpreter matches the
reference (``tests/test_pallas_tpu_elementwise.py``, ``tests/test_aot.py``).

The contract is that of :func:`forge_jax.rope` (its XLA implementation is the reference).
The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.rope.rope`; reference: its XLA implementation
:func:`forge_jax.ops.rope.rope_xla`. Tests: ``tests/test_pallas_tpu_elementwise.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _compat
from forge_jax.ops.rope import call_inverse_frequencies, inverse_frequencies, rope_xla
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.tpu import _common

pl = _compat.pallas()
pltpu = _compat.pallas_tpu()

# Where this kernel was compiled, checked and measured faster than XLA: none yet (checked
# in the TPU interpreter and lowered through Mosaic on CPU only; no TPU has run it).
VERIFIED: dict[str, str] = {}


# Widest lane chunk that shares one cos/sin slab: wider chunks evaluate more cos/sin per
# token, narrower ones unroll more chunks per block.
MAX_WIDTH = 512
# A block holds at least a sublane tile of whole token rows.
MAX_ROW = 65536


# The launch parameter, elements per block (rows per block: :func:`block_tokens_for`), and its
# defaults per TPU generation (:func:`_common.per_generation`), untuned, pending
# measurements on TPU hardware.
Config = _common.BlockConfig
TUNED: Mapping[str, Mapping[str, int]] = _common.per_generation(
    v4_v5e=dict(block_elements=256 * 1024), v5p=dict(block_elements=512 * 1024),
    v6e=dict(block_elements=512 * 1024), default=dict(block_elements=256 * 1024))
default_config = _common.block_config(TUNED)


def chunk_width(heads: int, head_dim: int) -> int:
    """Lanes per chunk: the widest multiple of lcm(head_dim, 128), up to :data:`MAX_WIDTH`
    (or that lcm if larger), that divides ``heads * head_dim``."""
    base = math.lcm(head_dim, 128)
    row = heads * head_dim
    return max([w for w in range(base, max(base, MAX_WIDTH) + 1, base) if row % w == 0],
               default=base)


def block_tokens_for(tokens: int, row: int, dtype, device_kind: str | None = None) -> int:
    """Tokens per block: a multiple of the sublane tile, no more than needed for ``tokens``."""
    tile = _common.sublane_tile(dtype)
    block = _common.block_rows(default_config({}, device_kind).block_elements, row, dtype)
    return min(block, pl.cdiv(tokens, tile) * tile)


def lane_table(inv_freq, width: int, *, interleaved: bool):
    """``[2, width]`` float32: each lane's frequency and its sign (-1 on the first lane of a
    pair, whose partner is ``d`` lanes to the right; +1 on the second). NumPy for a host
    table, a JAX array for frequencies computed in the call (longrope, dynamic NTK)."""
    xp = np if isinstance(inv_freq, np.ndarray) else jnp
    head_dim = 2 * inv_freq.shape[0]
    j = np.arange(width) % head_dim
    pair, first = (j // 2, j % 2 == 0) if interleaved else (j % (head_dim // 2),
                                                              j < head_dim // 2)
    return xp.stack([inv_freq[pair], xp.asarray(np.where(first, -1.0, 1.0))]).astype(
        np.float32)


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rope` arguments, else why not."""
    x = args["x"]
    if jnp.dtype(x.dtype) not in _common.FLOAT_DTYPES:
        return (f"x.dtype={jnp.dtype(x.dtype).name}; the kernel is built and tested for "
                "float32/bfloat16, the TPU inference dtypes (a policy: float16 lowers)")
    _, _, heads, head_dim = x.shape
    if heads * head_dim > MAX_ROW:
        return (f"heads * head_dim = {heads * head_dim} > {MAX_ROW}: a block of whole token "
                "rows must fit VMEM")
    return None


def _kernel(pos_ref, table_ref, x_ref, o_ref, *, width, shift, attention_factor):
    # pos_ref [block_tokens, 1] float32; table_ref [2, width] float32 (frequency, sign);
    # x_ref, o_ref [block_tokens, heads * head_dim].
    freq, sign = table_ref[0:1, :], table_ref[1:2, :]  # [1, width] each
    # float32 angles: in bfloat16, position 257 rounds to 256 and sin(257) is not sin(256).
    angle = pos_ref[...] * freq  # [block_tokens, width]
    cos, sin = jnp.cos(angle), sign * jnp.sin(angle)
    if attention_factor != 1.0:  # yarn / longrope: the multiplier on cos and sin
        cos, sin = cos * attention_factor, sin * attention_factor
    first = jnp.broadcast_to(sign < 0, angle.shape)
    row = x_ref.shape[1]
    # Whole chunks, then the row's tail: whole heads too (width and the row are multiples
    # of head_dim, and the table repeats per head), narrower than a chunk when the row is
    # not a multiple of the width (a row that is not a multiple of 128 lanes, which Mosaic's
    # rotation refuses; supports() rejects it, the interpreter runs it).
    for start in range(0, row, width):
        n = min(width, row - start)
        lanes = slice(start, start + n)
        x = x_ref[:, lanes].astype(jnp.float32)
        # roll(x, s)[j] = x[j - s]; a chunk holds whole heads, so no partner wraps around.
        partner = jnp.where(first[:, :n], pltpu.roll(x, n - shift, 1), pltpu.roll(x, shift, 1))
        o_ref[:, lanes] = (x * cos[:, :n] + partner * sin[:, :n]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("theta", "scaling", "interleaved", "block_tokens",
                                             "interpret"))
def rope_forward(x, positions, *, theta, scaling, interleaved, block_tokens, interpret=False):
    """The kernel alone (no VJP).

    Args:
      x: ``[batch, seq, heads, head_dim]`` float32/bfloat16.
      positions: int ``[batch, seq]``.
      theta, scaling, interleaved: as :func:`forge_jax.rope` (static: they build the lane
        table, from :func:`forge_jax.ops.rope.inverse_frequencies`).
      block_tokens: tokens per block, a multiple of 8 (of 16 for bfloat16).
      interpret: run in the TPU interpreter (any platform).

    Returns:
      The rotated ``x`` (shape and dtype of ``x``).
    """
    batch, seq, heads, head_dim = x.shape
    tokens, row = batch * seq, heads * head_dim
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    width = chunk_width(heads, head_dim)
    # The call's frequencies (longrope and dynamic NTK follow the largest position).
    inv_freq = (call_inverse_frequencies(positions, head_dim, theta, scaling)
                if scaling is not None and scaling.depends_on_length
                else inverse_frequencies(head_dim, theta, scaling))
    table = jnp.asarray(lane_table(inv_freq, width, interleaved=interleaved))
    factor = 1.0 if scaling is None else scaling.resolved_attention_factor
    # Converted as the reference converts them (one rounding to float32, exact below 2**24).
    pos = positions.reshape(tokens, 1).astype(jnp.float32)
    row_spec = pl.BlockSpec((block_tokens, row), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, width=width, shift=1 if interleaved else head_dim // 2,
                          attention_factor=float(factor)),
        grid=(pl.cdiv(tokens, block_tokens),),
        in_specs=[pl.BlockSpec((block_tokens, 1), lambda i: (i, 0)),
                  pl.BlockSpec((2, width), lambda i: (0, 0)),
                  row_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct((tokens, row), x.dtype),
        interpret=_compat.tpu_interpret_params() if interpret else False,
        name="forge_jax_tpu_rope",
        cost_estimate=_cost.elementwise(x.size, flops=4, transcendentals=2, io=(x, x)),
    )(pos, table, x.reshape(tokens, row))
    return out.reshape(x.shape)


_rope = with_reference_vjp(rope_forward, rope_xla, static=("theta", "scaling", "interleaved"))


def rope(x, positions, *, theta, scaling, interleaved, block_tokens=None, interpret=False):
    """:func:`forge_jax.rope` through the kernel; differentiable in ``x`` (the XLA
    implementation's VJP).

    Args:
      x, positions, theta, scaling, interleaved: as :func:`forge_jax.rope`.
      block_tokens: overrides :func:`block_tokens_for` (from :data:`TUNED`).
      interpret: run in the TPU interpreter (any platform).
    """
    if block_tokens is None:
        block_tokens = block_tokens_for(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3],
                                        x.dtype, _common.device_kind(interpret))
    return _rope(x, positions, theta=theta, scaling=scaling, interleaved=interleaved,
                 block_tokens=block_tokens, interpret=interpret)


_registration.register(
    "rope", rope, backend="tpu", supports=supports, verified=VERIFIED,
    description="[tokens, heads*head_dim] lanes, cos/sin from positions in-kernel, float32 "
                "angles")
