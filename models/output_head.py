"""What every decoder family shares around its layers: the token check and the output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import forge_jax as fj


def check_tokens(tokens, vocab_size):
    """Refuses ``tokens`` that are not an int ``[batch, seq]`` array."""
    del vocab_size  # ids are checked where they are concrete (generation's prompt checks)
    if not hasattr(tokens, "dtype") or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an int array, got {tokens!r:.80}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got tokens.shape={tokens.shape}")


def output_logits(hidden, lm_head, embed_tokens, dtype, softcap=None):
    """A decoder's output head: float32 logits ``[..., vocab]`` of ``hidden``
    ``[..., hidden_size]`` through ``lm_head`` (a ``Linear``), or through the embedding
    table ``embed_tokens`` (tied, in ``dtype``) when it is None; ``softcap`` (Gemma 2 and 4):
    ``softcap * tanh(logits / softcap)``, in float32."""
    with jax.named_scope("lm_head"):
        if lm_head is not None:
            logits = lm_head(hidden, out_dtype=jnp.float32)
        else:
            lead = hidden.shape[:-1]
            table = embed_tokens[...].astype(dtype)  # [vocab, hidden]
            logits = fj.matmul(hidden.reshape(-1, hidden.shape[-1]), table, trans_b=True,
                               out_dtype=jnp.float32).reshape(*lead, table.shape[0])
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        return logits
