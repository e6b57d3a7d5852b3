"""What the chunked gated delta-rule kernels (TPU and GPU) read, prepared once in XLA.

The per-token work of :func:`forge_jax.gated_delta_rule` that needs no chunk (the L2 norms,
the query scale, the padding of a variable-length batch and of the last chunk, the
cumulative log decay inside each chunk) runs here, and the kernels receive head-major
float32 arrays whose chunk of ``chunk`` tokens is one block:

* ``q``, ``k``: ``[batch, k_heads, tokens, dk]`` (normalised, ``q`` scaled; a value head
  reads its key head through the kernel's index map, nothing is repeated);
* ``v``: ``[batch, v_heads, tokens, dv]``;
* ``cum``: ``[batch, v_heads, tokens, 1]``, the log decay from the chunk's start through each
  token, and ``cum_row`` the same laid out ``[batch, v_heads, chunks, 1, chunk]`` (the
  kernels need it along both axes of the chunk's ``[chunk, chunk]`` decay matrix);
* ``beta``: ``[batch, v_heads, tokens, 1]``.

Padded tokens are zero vectors with ``g = beta = 0``: they leave the state as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from forge_jax.ops import gated_delta


def head_major(q, k, v, g, beta, lengths, *, scale, qk_l2norm, chunk):
    """The kernels' inputs (module docstring) and ``valid`` ``[batch, seq]``."""
    f32 = jnp.float32
    batch, seq = q.shape[:2]
    valid = gated_delta.valid_tokens(lengths, batch, seq)
    q, k, v = (x.astype(f32) for x in (q, k, v))
    if qk_l2norm:
        q, k = gated_delta.l2norm(q), gated_delta.l2norm(k)
    q = q * scale
    vec = valid[:, :, None, None]
    q, k, v = (jnp.where(vec, x, 0.0) for x in (q, k, v))
    g, beta = (jnp.where(valid[:, :, None], x.astype(f32), 0.0) for x in (g, beta))
    pad = -seq % chunk
    tokens = seq + pad
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
               for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1) for x in (g, beta))
    heads = g.shape[1]
    cum = jnp.cumsum(g.reshape(batch, heads, tokens // chunk, chunk), axis=-1)
    cum_row = cum[:, :, :, None, :]
    return (q, k, v, cum.reshape(batch, heads, tokens, 1), cum_row, beta[..., None]), valid


def finish(out, new_state, valid, v, state):
    """The op's results from the kernel's ``out`` ``[batch, v_heads, tokens, dv]`` and state."""
    seq = v.shape[1]
    out = out[:, :, :seq].transpose(0, 2, 1, 3)
    out = jnp.where(valid[:, :, None, None], out, 0.0).astype(v.dtype)
    return out, new_state.astype(jnp.float32 if state is None else state.dtype)


def initial_state(state, batch, v_heads, dk, dv):
    return (jnp.zeros((batch, v_heads, dk, dv), jnp.float32) if state is None
            else state.astype(jnp.float32))


def reference(q, k, v, g, beta, state, lengths, *, scale, qk_l2norm, chunk_size):
    """The op's XLA implementation with every array positional (the kernels' VJP)."""
    return gated_delta.gated_delta_rule_xla(q, k, v, g, beta, state=state, lengths=lengths,
                                            scale=scale, qk_l2norm=qk_l2norm,
                                            chunk_size=chunk_size)


def levels(chunk: int) -> int:
    """Squarings of the Neumann product that inverts a chunk's ``I + L``: ``L`` is strictly
    lower triangular, so ``L^chunk = 0`` and ``(I + L)^-1 = prod_{i < levels} (I +
    (-L)^(2^i))`` with ``2^levels >= chunk``."""
    return max(1, (chunk - 1).bit_length())


def cost(q, v, *, chunk: int) -> jax.Array:
    """flops, transcendentals and bytes of one chunked pass (for ``cost_estimate``)."""
    batch, v_heads, tokens, dv = v.shape
    dk = q.shape[-1]
    chunks = batch * v_heads * tokens // chunk
    c = chunk
    flops = chunks * (2 * c * c * dk * 2                       # k k^T, q k^T
                      + 2 * c * c * c * 2 * (levels(c) - 1)    # the Neumann squarings
                      + 2 * c * c * (dv + dk)                  # u, w
                      + 2 * c * dk * dv * 4 + 2 * c * c * dv)  # state reads, update, attn
    return flops, chunks * (c * c + 2 * c)
