"""Pallas GPU kernel (Triton lowering): rotary position embedding (RoPE).

``x [batch, seq, heads, head_dim]`` is viewed as ``[tokens, heads, head_dim]``. Grid
``(cdiv(tokens, block_tokens), cdiv(heads, block_heads))``: each program computes the angles
``position * inv_freq`` of its tokens in float32 and their cosines and sines once (no
``[seq, head_dim]`` table in memory; only the ``[head_dim // 2]`` inverse frequencies of
:func:`forge_jax.ops.rope.call_inverse_frequencies`, which carry the scaling; yarn and
longrope multiply cos and sin by their attention factor), then rotates the
``(x1, x2)`` pairs of every head in its block: ``(x[i], x[i + head_dim // 2])`` for the
rotate-half convention, ``(x[2i], x[2i + 1])`` for the interleaved (GPT-J) one. Tokens,
heads and pairs are padded to powers of two with masked loads and stores.

The contract is that of :func:`forge_jax.rope` (its XLA implementation is the reference).
The backward pass is the XLA implementation's VJP
(:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`), not a kernel.

Op: :func:`forge_jax.ops.rope.rope`; reference: its XLA implementation
:func:`forge_jax.ops.rope.rope_xla`. Launch knobs: :class:`Config`, the per-device table
:data:`TUNED`, :func:`default_config`. Registered by
:func:`~forge_jax.pallas_kernels._registration.register` (GPU; :data:`VERIFIED`). Tests:
``tests/test_pallas_gpu_rope.py``, ``tests/test_gpu_tuning.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import _compat
from forge_jax.ops.rope import call_inverse_frequencies, rope_xla
from forge_jax.pallas_kernels import _cost, _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

pl = _compat.pallas()

# Where this kernel was compiled, checked and measured faster than XLA: none yet.
VERIFIED: dict[str, str] = {}

# The launch table stops here; the largest head dim of a released model is 256 (Gemma).
MAX_HEAD_DIM = 512
# Token indices are int32 (program id * block_tokens).
MAX_TOKENS = 2**30


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernel's launch knobs: tokens and heads per program, and Triton launch
    parameters."""

    block_tokens: int
    block_heads: int
    num_warps: int
    num_stages: int = 1


# The defaults per device kind (:func:`_common.kind_row`; "default" serves any other kind
# and the interpreter), by padded head dim (the smallest bucket >= ``next_pow2(head_dim)``).
# Not measured yet: the ranges of JAX's own Pallas kernels and Triton's tutorials.
TUNED: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "default": {
        64: dict(block_tokens=8, block_heads=16, num_warps=4),
        128: dict(block_tokens=4, block_heads=16, num_warps=4),
        256: dict(block_tokens=2, block_heads=16, num_warps=4),
        512: dict(block_tokens=1, block_heads=16, num_warps=8),
    },
    # Compiled for an H100 (forge_jax.aot, ptxas; JAX 0.10.2, 2026-11-25): with 4 warps the
    # bfloat16 kernel takes 168 registers and spills 24-36 bytes (SmolLM2's and Llama's
    # shapes); 8 warps halve each thread's elements: ~100 registers, no spill, both dtypes.
    "H100": {
        64: dict(block_tokens=8, block_heads=16, num_warps=8),
        128: dict(block_tokens=4, block_heads=16, num_warps=8),
        256: dict(block_tokens=2, block_heads=16, num_warps=8),
        512: dict(block_tokens=1, block_heads=16, num_warps=8),
    },
}


def default_config(args: Mapping[str, Any], device_kind: str | None = None) -> Config:
    """The launch knobs for ``args["x"]`` (``[batch, seq, heads, head_dim]``, anything with a
    shape) on ``device_kind``, from :data:`TUNED`. When the (padded) head count is below the
    table's ``block_heads``, a program takes proportionally more tokens instead."""
    _, _, heads, head_dim = args["x"].shape
    config = Config(**_common.tuned(TUNED, device_kind, _common.next_pow2(head_dim)))
    block_heads = min(config.block_heads, _common.next_pow2(heads))
    return dataclasses.replace(
        config, block_heads=block_heads,
        block_tokens=config.block_tokens * (config.block_heads // block_heads))


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
            interleaved, attention_factor):
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
    if attention_factor != 1.0:  # yarn / longrope: the multiplier on cos and sin
        cos, sin = cos * attention_factor, sin * attention_factor

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
                                             "num_warps", "num_stages", "interpret",
                                             "attention_factor"))
def rope_forward(x, positions, inv_freq, *, interleaved, block_tokens, block_heads,
                 num_warps, num_stages, interpret=False, attention_factor=1.0):
    """The kernel alone (no VJP).

    Args:
      x: ``[batch, seq, heads, head_dim]`` float32/bfloat16/float16, head_dim even.
      positions: int ``[batch, seq]``.
      inv_freq: float32 ``[head_dim // 2]``, the call's frequencies
        (:func:`forge_jax.ops.rope.call_inverse_frequencies`).
      interleaved: the pairing convention of :func:`forge_jax.rope`.
      block_tokens, block_heads: tokens and heads per program (powers of two).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas' interpreter (any platform).
      attention_factor: the multiplier on cos and sin (yarn, longrope; 1 otherwise).

    Returns:
      The rotated ``x`` (shape and dtype of ``x``).
    """
    _compat.filter_triton_deprecation()
    batch, seq, heads, head_dim = x.shape
    tokens = batch * seq
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    out = _common.triton_call(
        functools.partial(_kernel, block_tokens=block_tokens, block_heads=block_heads,
                          half_pad=_common.next_pow2(head_dim // 2), interleaved=interleaved,
                          attention_factor=float(attention_factor)),
        grid=(pl.cdiv(tokens, block_tokens), pl.cdiv(heads, block_heads)),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, head_dim), x.dtype),
        num_warps=num_warps, num_stages=num_stages,
        interpret=interpret,
        name="forge_jax_rope",
        cost_estimate=_cost.elementwise(x.size, flops=4, transcendentals=2, io=(x, x)),
    )(positions.reshape(tokens), inv_freq, x.reshape(tokens, heads, head_dim))
    return out.reshape(x.shape)


def _rope_forward(x, positions, *, theta, scaling, interleaved, **knobs):
    # The call's frequencies (longrope and dynamic NTK pick or compute them from the
    # largest position) and the scaling's multiplier on cos/sin.
    inv_freq = call_inverse_frequencies(positions, x.shape[-1], theta, scaling)
    factor = 1.0 if scaling is None else scaling.resolved_attention_factor
    return rope_forward(x, positions, inv_freq, interleaved=interleaved,
                        attention_factor=factor, **knobs)


_rope = with_reference_vjp(_rope_forward, rope_xla, static=("theta", "scaling", "interleaved"))


def rope(x, positions, *, theta, scaling, interleaved, block_tokens=None, block_heads=None,
         num_warps=None, num_stages=None, interpret=False):
    """:func:`forge_jax.rope` through the kernel; differentiable in ``x`` (XLA VJP).

    Args:
      x, positions, theta, scaling, interleaved: as :func:`forge_jax.rope`.
      block_tokens, block_heads, num_warps, num_stages: override the tuning
        table's entry.
      interpret: run in Pallas' interpreter (any platform).
    """
    config = _common.with_knobs(default_config({"x": x}, _common.device_kind(interpret)),
                                block_tokens=block_tokens, block_heads=block_heads,
                                num_warps=num_warps, num_stages=num_stages)
    return _rope(x, positions, theta=theta, scaling=scaling, interleaved=interleaved,
                 interpret=interpret, **dataclasses.asdict(config))


def configs(args: Mapping[str, Any]) -> list[dict[str, int]]:
    """What :func:`forge_jax.autotune` times besides the defaults: tokens per program at
    the table's head block, 4 and 8 warps."""
    del args
    return [dict(block_tokens=t, num_warps=w) for t in (1, 2, 4, 8) for w in (4, 8)]


_registration.register(
    "rope", rope, backend="gpu", supports=supports, verified=VERIFIED,
    description="cos/sin from positions in-kernel, float32 angles", configs=configs,
    interpret_configs=lambda args: [dict(block_tokens=2)])
