"""The op calls a Llama model makes in :func:`~forge_jax.generation.loop.generate` (and
``forge-jax generate`` / ``chat``), at the shapes and dtype its config and the generation plan
give them: what ``forge-jax tune`` times with ``fj.autotune`` so that auto selection knows the
fastest implementation at exactly the signatures the model dispatches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from forge_jax.models.llama_model import LlamaConfig


def op_calls(config: LlamaConfig, *, batch: int, seq_len: int, dtype: Any,
             rng: np.random.Generator, max_new_tokens: int = 256,
             page_size: int = 16) -> list[tuple[str, tuple, dict]]:
    """The ops of ``generate``'s prefill step (a prompt of ``seq_len`` tokens) and decode step
    (one token) with the paged KV cache, on random inputs: each distinct (op, signature) once.

    The shapes are those :func:`~forge_jax.generation.loop.generate` plans: the batch
    padded to a power of two, the prompt to its bucket (``generation.prompt_bucket``), a page
    pool of ``padded batch * pages per sequence`` pages for ``seq_len + max_new_tokens``
    positions, the weights and the cache in ``dtype`` (generate's default: the model's).

    Args:
      config: the model's ``LlamaConfig``.
      batch: prompts per call, ``b`` (padded as generate pads it).
      seq_len: tokens of the longest prompt (padded to its bucket ``t``).
      dtype: the model's compute dtype (that of the weights, activations and cache).
      rng: draws the inputs (floats in float32, then cast to ``dtype``).
      max_new_tokens, page_size: as given to ``generate`` (they size the page pool).

    Returns:
      ``(op name, positional arguments, keyword arguments)`` per call, the prefill's first:
      ``embedding``; ``rms_norm`` without and with a residual; ``matmul`` of the fused q/k/v,
      output, fused gate/up and down projections (``[b t, in] x [out, in]^T``) and of the
      output head at the last position (float32 logits); ``rope`` of queries and keys;
      ``paged_write`` of the step's keys and values into the pool; ``attention`` of the
      prompt over its own keys (prefill) and ``paged_attention`` of the query over the pool
      (decode); ``silu_mul``.
    """
    from forge_jax.generation.loop import cache_plan

    c = config
    dtype = jnp.dtype(dtype)
    b, bucket, _, max_pages = cache_plan(batch, seq_len, max_new_tokens, "paged", page_size)
    num_pages = b * max_pages
    heads, kv_heads, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rot = c.rotary_dim  # RoPE's dims (all of head_dim but with Phi-3's partial rotary)
    act = "gelu_tanh_mul" if c.hidden_act == "gelu_pytorch_tanh" else "silu_mul"
    q_dim, kv_dim = heads * hd, kv_heads * hd

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    def linear(m, out_features, in_features, bias, out_dtype=dtype):
        kw = dict(trans_b=True, out_dtype=out_dtype)
        if bias:
            kw.update(beta=1.0, c=normal(out_features))
        return ("matmul", (normal(m, in_features), normal(out_features, in_features)), kw)

    block_tables = jnp.arange(num_pages, dtype=jnp.int32).reshape(b, max_pages)
    pages = normal(kv_heads, num_pages, page_size, hd)
    calls = []
    for t, start in ((bucket, 0), (1, seq_len)):  # prefill, then decode (one token)
        x = normal(b, t, c.hidden_size)
        positions = jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))
        slots = (block_tables[:, :, None] * page_size
                 + jnp.arange(page_size, dtype=jnp.int32)).reshape(b, -1)[:, start:start + t]
        lengths = jnp.full((b,), start + t, jnp.int32)
        kv = normal(b * t, kv_heads, hd)
        q = normal(b, t, heads, hd)
        ids = jnp.asarray(rng.integers(0, c.vocab_size, (b, t)), jnp.int32)
        rope = dict(theta=c.rope_theta, scaling=c.rope_scaling)
        calls += [
            ("embedding", (normal(c.vocab_size, c.hidden_size), ids), {}),
            ("rms_norm", (x, normal(c.hidden_size)), dict(eps=c.rms_norm_eps)),
            linear(b * t, q_dim + 2 * kv_dim, c.hidden_size, c.attention_bias or c.qkv_bias),
            ("rope", (normal(b, t, kv_heads, rot), positions), rope),
            ("paged_write", (pages, pages, kv, kv, slots.reshape(-1)), {}),
        ]
        # The prefill's last layer queries with each prompt's last token alone (see
        # Llama.forward_cached): its queries, attention and MLP have one row per prompt.
        rows = [t] if start else [t, 1] if c.num_hidden_layers > 1 else [1]
        for n in rows:
            xn = normal(b, n, c.hidden_size)
            qn = q[:, -n:]
            if start:  # decode: the query over the pool
                attention = ("paged_attention", (qn, pages, pages, block_tables, lengths),
                             dict(q_positions=positions))
            elif n == t:  # the prompts attend to themselves (a new cache: empty_cache)
                attention = ("attention", (qn, normal(b, t, kv_heads, hd),
                                           normal(b, t, kv_heads, hd)), dict(causal=True))
            else:  # each prompt's last token over the prompt
                attention = ("attention", (qn, normal(b, t, kv_heads, hd),
                                           normal(b, t, kv_heads, hd)),
                             dict(causal=True, q_positions=positions[:, -1:]))
            calls += [
                ("rope", (qn[..., :rot], positions[:, -n:]), rope),
                attention,
                linear(b * n, c.hidden_size, q_dim, c.attention_bias),
                ("rms_norm", (xn, normal(c.hidden_size)), dict(eps=c.rms_norm_eps, residual=xn)),
                linear(b * n, 2 * c.intermediate_size, c.hidden_size, c.mlp_bias),
                (act, (normal(b, n, c.intermediate_size),) * 2, {}),
                linear(b * n, c.hidden_size, c.intermediate_size, c.mlp_bias),
            ]
        calls.append(
            linear(b, c.vocab_size, c.hidden_size, False, out_dtype=jnp.dtype(jnp.float32)))
    return _distinct(calls)


def _distinct(calls):
    """``calls`` without repeats: one per (op, argument signature), as the autotune cache
    keys them."""
    from forge_jax import dispatch
    from forge_jax.autotune_cache import signature

    seen, out = set(), []
    for op, args, kwargs in calls:
        key = (op, signature(dispatch.bind(op, *args, **kwargs)))
        if key not in seen:
            seen.add(key)
            out.append((op, args, kwargs))
    return out
