"""The op calls a Llama model makes, at the shapes its config gives them: what
``forge-jax tune`` times with ``fj.autotune`` so that auto selection knows the fastest
implementation at exactly those shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from forge_jax.models.llama_model import LlamaConfig


def op_calls(config: LlamaConfig, *, batch: int, seq_len: int, dtype: Any,
             rng: np.random.Generator) -> list[tuple[str, tuple, dict]]:
    """The ops of a prefill step of ``seq_len`` tokens and of a decode step (one token), on
    standard-normal inputs: each distinct (op, shape, keyword) combination once.

    Args:
      config: the model's ``LlamaConfig``.
      batch: sequences per step, ``b``.
      seq_len: tokens of the prefill, ``t``; the decode step has ``t = 1`` (and is not
        repeated when ``seq_len`` is 1).
      dtype: the dtype of every array.
      rng: draws the inputs (in float32, then cast to ``dtype``).

    Returns:
      ``(op name, positional arguments, keyword arguments)`` per call, the prefill's first:
      ``rms_norm`` of x ``[b, t, hidden]`` by a weight ``[hidden]``, without and with a
      residual; ``silu_mul`` of two ``[b, t, intermediate]``; ``rope`` of the queries
      ``[b, t, heads, head_dim]`` and of the keys ``[b, t, kv_heads, head_dim]`` at
      positions ``[b, t]`` (int32); and for the prefill only, causal ``attention`` of
      queries, keys and values.
    """
    c, b = config, batch

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    calls = []
    for t in dict.fromkeys((seq_len, 1)):  # prefill, then decode (one token)
        x = normal(b, t, c.hidden_size)
        w = normal(c.hidden_size)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        q = normal(b, t, c.num_attention_heads, c.head_dim)
        kv = normal(b, t, c.num_key_value_heads, c.head_dim)
        calls += [
            ("rms_norm", (x, w), dict(eps=c.rms_norm_eps)),
            ("rms_norm", (x, w), dict(eps=c.rms_norm_eps, residual=x)),
            ("silu_mul", (normal(b, t, c.intermediate_size),) * 2, {}),
            ("rope", (q, positions), dict(theta=c.rope_theta, scaling=c.rope_scaling)),
            ("rope", (kv, positions), dict(theta=c.rope_theta, scaling=c.rope_scaling)),
        ]
        if t > 1:
            calls.append(("attention", (q, kv, kv), dict(causal=True)))
    return calls
