"""Pallas GPU kernel (Triton lowering): rotary position embedding (RoPE).

``x [batch, seq, heads, head_dim]`` is viewed as ``[tokens, heads, head_dim]``. Grid
``(cdiv(tokens, block_tokens), cdiv(heads, block_heads))``: each program computes the angles
``position * inv_freq`` of its tokens in float32 and their cosines and sines once (no
``[seq, head_dim]`` table in memory; only the ``[head_dim // 2]`` inverse frequencies of
:func:`forge_jax.ops.rope.inverse_frequencies`, which carry the scaling), then rotates the
``(x1, x2)`` pairs of every head in its block: ``(x[i], x[i + head_dim // 2])`` for the
rotate-half convention, ``(x[2i], x[2i + 1])`` for the interleaved (GPT-J) one. Tokens,
heads and pairs are padded to powers of two with masked loads and stores.

The contract is that of :func:`forge_jax.rope` (its XLA implementation is the reference).
The backward pass is the XLA implementation's VJP (a ``jax.custom_vjp``), not a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.rope import inverse_frequencies
from forge_jax.pallas_kernels import _reference_vjp
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

# The launch table stops here; the largest head dim of a released model is 256 (Gemma).
MAX_HEAD_DIM = 512
# Token indices are int32 (program id * block_tokens).
MAX_TOKENS = 2**30


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tokens and heads per program, and Triton launch parameters.

    When the (padded) head count is below ``block_heads``, the program takes
    proportionally more tokens instead.
    """

    block_tokens: int
    block_heads: int
    num_warps: int
    num_stages: int = 1


def launch_params(head_dim: int, heads: int, device_kind: str | None = None) -> Launch:
    """The launch parameters for ``heads`` heads of ``head_dim`` on ``device_kind`` (from
    :data:`forge_jax.pallas_kernels.gpu._common.TUNING`)."""
    launch = Launch(**_common.tuning("rope", device_kind, _common.next_pow2(head_dim)))
    block_heads = min(launch.block_heads, _common.next_pow2(heads))
    return dataclasses.replace(
        launch, block_heads=block_heads,
        block_tokens=launch.block_tokens * (launch.block_heads // block_heads))


def supports(args: Mapping[str, Any]) -> str | None:
    """``None`` if the kernel serves these :func:`forge_jax.rope` arguments, else why not."""
    x = args["x"]
    if jnp.dtype(x.dtype) not in _common.FLOAT_DTYPES:
        return f"x.dtype={jnp.dtype(x.dtype).name}; the kernel reads float32/bf16/f16"
    if x.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {x.shape[-1]} > {MAX_HEAD_DIM}, beyond the launch table"
    if x.shape[0] * x.shape[1] > MAX_TOKENS:
        return f"{x.shape[0] * x.shape[1]} tokens > {MAX_TOKENS}: token indices are int32"
    return None


def _kernel(pos_ref, inv_ref, x_ref, o_ref, *, block_tokens, block_heads, half_pad,
            interleaved):
    # pos_ref [tokens]; inv_ref [head_dim // 2] float32; x_ref, o_ref [tokens, heads,
    # head_dim]: whole arrays, indexed with this program's (masked) token/head/pair indices.
    tokens, heads, head_dim = x_ref.shape
    half = head_dim // 2
    t = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    h = pl.program_id(1) * block_heads + jnp.arange(block_heads)
    i = jnp.arange(half_pad)
    pos = _compat.triton_load(pos_ref, t, mask=t < tokens, other=0)
    inv = _compat.triton_load(inv_ref, i, mask=i < half, other=0)
    # float32 angles: in bfloat16, position 257 rounds to 256 and sin(257) is not sin(256).
    angle = pos.astype(jnp.float32)[:, None] * inv[None, :]  # [block_tokens, half_pad]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]

    shape = (block_tokens, block_heads, half_pad)
    t3 = jnp.broadcast_to(t[:, None, None], shape)
    h3 = jnp.broadcast_to(h[None, :, None], shape)
    i3 = jnp.broadcast_to(i[None, None, :], shape)
    mask = (t3 < tokens) & (h3 < heads) & (i3 < half)
    c1, c2 = (2 * i3, 2 * i3 + 1) if interleaved else (i3, i3 + half)
    x1 = _compat.triton_load(x_ref, (t3, h3, c1), mask=mask, other=0).astype(jnp.float32)
    x2 = _compat.triton_load(x_ref, (t3, h3, c2), mask=mask, other=0).astype(jnp.float32)
    _compat.triton_store(o_ref, (t3, h3, c1), (x1 * cos - x2 * sin).astype(o_ref.dtype),
                         mask=mask)
    _compat.triton_store(o_ref, (t3, h3, c2), (x2 * cos + x1 * sin).astype(o_ref.dtype),
                         mask=mask)


@functools.partial(jax.jit, static_argnames=("interleaved", "block_tokens", "block_heads",
                                             "num_warps", "num_stages", "interpret"))
def rope_forward(x, positions, inv_freq, *, interleaved, block_tokens, block_heads,
                 num_warps, num_stages, interpret=False):
    """The kernel alone (no VJP).

    Args:
      x: ``[batch, seq, heads, head_dim]`` float32/bfloat16/float16, head_dim even.
      positions: int ``[batch, seq]``.
      inv_freq: float32 ``[head_dim // 2]``, :func:`forge_jax.ops.rope.inverse_frequencies`.
      interleaved: the pairing convention of :func:`forge_jax.rope`.
      block_tokens, block_heads: tokens and heads per program (powers of two).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).

    Returns:
      The rotated ``x`` (shape and dtype of ``x``).
    """
    _compat.filter_triton_deprecation()
    batch, seq, heads, head_dim = x.shape
    tokens = batch * seq
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, block_tokens=block_tokens, block_heads=block_heads,
                          half_pad=_common.next_pow2(head_dim // 2), interleaved=interleaved),
        grid=(pl.cdiv(tokens, block_tokens), pl.cdiv(heads, block_heads)),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, head_dim), x.dtype),
        compiler_params=_compat.triton_compiler_params(num_warps=num_warps,
                                                       num_stages=num_stages),
        interpret=interpret,
        name="forge_jax_rope",
    )(positions.reshape(tokens), inv_freq, x.reshape(tokens, heads, head_dim))
    return out.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rope(x, positions, static, launch_and_interpret):
    theta, scaling, interleaved = static
    launch, interpret = launch_and_interpret
    inv_freq = jnp.asarray(inverse_frequencies(x.shape[-1], theta, scaling))
    return rope_forward(x, positions, inv_freq, interleaved=interleaved,
                        block_tokens=launch.block_tokens, block_heads=launch.block_heads,
                        num_warps=launch.num_warps, num_stages=launch.num_stages,
                        interpret=interpret)


def _rope_fwd(x, positions, static, launch_and_interpret):
    return _rope(x, positions, static, launch_and_interpret), (x, positions)


_rope.defvjp(_rope_fwd, _reference_vjp.rope_bwd)


def rope(x, positions, *, theta, scaling, interleaved, block_tokens=None, block_heads=None,
         num_warps=None, num_stages=None, interpret=False):
    """:func:`forge_jax.rope` through the kernel; differentiable in ``x`` (XLA VJP).

    Args:
      x, positions, theta, scaling, interleaved: as :func:`forge_jax.rope`.
      block_tokens, block_heads, num_warps, num_stages: override the tuning
        table's entry.
      interpret: run in Pallas' interpreter (any platform).
    """
    launch = launch_params(x.shape[-1], x.shape[2], _common.device_kind(interpret))
    launch = dataclasses.replace(
        launch, **{k: v for k, v in dict(block_tokens=block_tokens, block_heads=block_heads,
                                         num_warps=num_warps, num_stages=num_stages).items()
                   if v is not None})
    return _rope(x, positions, (theta, scaling, interleaved), (launch, interpret))


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults: tokens per program at
    the table's head block, 4 and 8 warps."""
    del args
    return [dict(block_tokens=t, num_warps=w) for t in (1, 2, 4, 8) for w in (4, 8)]


_common.register("rope", rope, supports=supports, verified=VERIFIED,
                 description="cos/sin from positions in-kernel, float32 angles", configs=configs,
                 interpret_configs=lambda args: [dict(block_tokens=2)])
