"""``"cudnn"``: :func:`forge_jax.attention` through
``jax.nn.dot_product_attention(..., implementation="cudnn")``, cuDNN's flash attention (a
library call, not a kernel of ours: hence the module's name).

cuDNN aligns its causal mask top-left (query ``t`` sees keys ``j <= t``) and knows
per-sequence key counts (``key_value_seq_lengths``) and a left window
(``local_window_size``). forge_jax's contract (the docstring of
:mod:`forge_jax.ops.attention`) aligns bottom-right per sequence, so this implementation
serves exactly the calls where the two say the same thing, and :func:`supports` names
every other one:

* causal, ``q_len == kv_len``, no ``kv_lengths`` or ``q_positions``: the two alignments
  coincide; a sliding window ``w`` is cuDNN's left window ``w - 1`` (the query sees
  itself and ``w - 1`` keys before it);
* causal, one query per sequence (decode), no ``q_positions`` or window: the query sits at
  the last valid key, so it sees exactly the ``kv_lengths[b]`` (or ``kv_len``) keys of its
  sequence: cuDNN's padding mask, not its causal one;
* not causal, no window: every valid key is visible, whatever the positions.

Around the call: key and value slots past ``kv_lengths[b]`` are zeroed before cuDNN reads
them (the contract's "hidden NaN never reaches the output" for uninitialised cache
memory), and a sequence with no valid key returns zeros (cuDNN is never asked to take a
softmax over nothing). The backward pass is the XLA reference's VJP, as for the flash
kernels (:func:`~forge_jax.pallas_kernels._vjp.with_reference_vjp`).

Op: :func:`forge_jax.ops.attention.attention`; reference: its XLA implementation
:func:`forge_jax.ops.attention.attention_xla`. No launch knobs: cuDNN chooses its own.
Registered (bottom of this module) as ``"cudnn"`` on GPU, by name until :data:`VERIFIED`
names a GPU. Tests: ``tests/test_jax_nn_attention.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax import backends, registry
from forge_jax.ops.attention import default_positions
from forge_jax.pallas_kernels import _attention_common, _registration
from forge_jax.pallas_kernels._vjp import with_reference_vjp
from forge_jax.pallas_kernels.gpu import _common

# Where this implementation was compiled, checked against the contract and measured faster
# than XLA: none yet (no GPU has run it). Until a record names a GPU it runs by name only.
VERIFIED: dict[str, str] = {}
PRIORITY = 20  # above the Pallas kernel once verified: cuDNN is NVIDIA's tuned kernel
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def max_head_dim(cc: tuple[int, int]) -> int:
    """cuDNN's largest head dim on compute capability ``cc``: 256 from Hopper on, else 128."""
    return 256 if cc >= (9, 0) else 128


def device_reason(platform: str) -> str | None:
    """``None`` if cuDNN flash attention can run on ``platform`` here, else why not."""
    if platform != "gpu":
        return f"cuDNN attention runs on a GPU, not on {platform}"
    cc = _common.capability(backends.gpu_compute_capability())
    if cc is None:
        return "no GPU device in this process"
    if cc < _common.MIN_CAPABILITY:
        return (f"cuDNN flash attention needs compute capability >= 8.0 (Ampere); this GPU "
                f"has {cc[0]}.{cc[1]} (T4-class)")
    return None


def shape_reason(args: Mapping[str, Any], cc: tuple[int, int]) -> str | None:
    """``None`` if cuDNN can compute these :func:`forge_jax.attention` arguments exactly on
    compute capability ``cc``, else the sentence :func:`forge_jax.explain` shows."""
    q, k, v = args["q"], args["k"], args["v"]
    dtypes = {jnp.dtype(a.dtype) for a in (q, k, v)}
    if len(dtypes) > 1:
        return (f"q.dtype={jnp.dtype(q.dtype).name}, k.dtype={jnp.dtype(k.dtype).name}, "
                f"v.dtype={jnp.dtype(v.dtype).name}: cuDNN needs one dtype")
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"q.dtype={jnp.dtype(q.dtype).name}: cuDNN flash attention takes float16/bfloat16"
    head_dim, limit = q.shape[-1], max_head_dim(cc)
    if head_dim % 8:
        return f"head_dim={head_dim} is not a multiple of 8, as cuDNN needs"
    if head_dim > limit:
        where = "from Hopper on" if cc >= (9, 0) else "before Hopper (compute capability 9.0)"
        return f"head_dim={head_dim} > {limit}, cuDNN's limit {where}"
    if args["logits_soft_cap"] is not None:
        return f"logits_soft_cap={args['logits_soft_cap']}: cuDNN has no logit soft cap"
    q_len, kv_len = q.shape[1], k.shape[1]
    positions, lengths = args["q_positions"], args["kv_lengths"]
    window = args["sliding_window"]
    if not args["causal"]:
        if window is not None:
            return ("a sliding window without the causal mask depends on the query positions; "
                    "cuDNN's window is top-left and causal only")
        return None
    if positions is not None:
        return ("explicit q_positions with the causal mask: cuDNN's causal mask is top-left "
                "(query t sees keys j <= t) and takes no positions")
    if q_len == 1:
        if window is not None:
            return ("a sliding window for a decode query sits at the end of each sequence; "
                    "cuDNN's window is top-left")
        return None
    if q_len != kv_len:
        return (f"causal with q_len={q_len} != kv_len={kv_len}: forge_jax aligns the causal "
                "mask bottom-right, cuDNN top-left; they coincide only for q_len == kv_len "
                "(or one query per sequence)")
    if lengths is not None:
        return ("causal with kv_lengths and several queries: the bottom-right positions shift "
                "per sequence by kv_lengths, which cuDNN's top-left mask cannot express")
    return None


def supports(args: Mapping[str, Any], platform: str) -> str | None:
    """``None`` if the ``"cudnn"`` implementation serves these arguments on ``platform``."""
    reason = device_reason(platform)
    if reason is not None:
        return reason
    if args.get("sinks") is not None:
        return ("sinks=: jax.nn.dot_product_attention (JAX 0.10 to 0.12) takes no sink "
                "logits (joining them through its return_residual logsumexp is not "
                "implemented in this record)")
    if args.get("attention_chunk_size") is not None:
        return ("attention_chunk_size=: jax.nn.dot_product_attention's is_causal and "
                "local_window_size cannot express a chunked mask; only a mask= array can, a "
                "[batch, q_len, kv_len] tensor this record does not build")
    return shape_reason(args, _common.capability(backends.gpu_compute_capability()))


def cudnn_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``jax.nn.dot_product_attention`` that compute these (served)
    :func:`forge_jax.attention` arguments: ``is_causal``, ``key_value_seq_lengths`` and
    ``local_window_size`` (the latter two may be None)."""
    q_len = args["q"].shape[1]
    causal = args["causal"] and q_len > 1  # decode: the padding mask is the causal one
    window = args["sliding_window"]
    lengths = args["kv_lengths"]
    if lengths is not None:
        # At least one key: a sequence without one is answered with zeros around the call.
        lengths = jnp.clip(lengths.astype(jnp.int32), 1, args["k"].shape[1])
    return dict(is_causal=causal, key_value_seq_lengths=lengths,
                local_window_size=None if window is None
                else (min(window, args["k"].shape[1]) - 1, 0))


def _forward(q, k, v, kv_lengths, *, scale, causal, sliding_window, implementation):
    args = dict(q=q, k=k, v=v, causal=causal, kv_lengths=kv_lengths,
                sliding_window=sliding_window)
    mapped = cudnn_arguments(args)
    if kv_lengths is not None:
        # Slots past a sequence's length may hold NaN (recycled cache memory): cuDNN's
        # padding mask hides their logits, but 0 * NaN in p @ v would still leak.
        valid = jnp.arange(k.shape[1])[None, :, None, None] < kv_lengths[:, None, None, None]
        zero = jnp.zeros((), k.dtype)
        k, v = jnp.where(valid, k, zero), jnp.where(valid, v, zero)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation,
                                       **mapped)
    if kv_lengths is not None:
        # A query that sees no key returns zeros (the contract).
        out = jnp.where((kv_lengths > 0)[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out


def _reference(q, k, v, kv_lengths, *, scale, causal, sliding_window):
    """The XLA reference at the positions and lengths this call stands for."""
    positions = default_positions(q.shape[0], q.shape[1], k.shape[1], kv_lengths)
    lengths = (jnp.full((q.shape[0],), k.shape[1], jnp.int32) if kv_lengths is None
               else kv_lengths)
    return _attention_common.explicit_reference(
        q, k, v, positions, lengths, scale=scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=None)


_attention = with_reference_vjp(_forward, _reference,
                                static=("scale", "causal", "sliding_window"))


def cudnn_attention(q, k, v, *, scale=None, causal=True, q_positions=None, kv_lengths=None,
                    sliding_window=None, logits_soft_cap=None, implementation="cudnn"):
    """:func:`forge_jax.attention` through cuDNN, for the arguments :func:`supports` accepts.

    Args:
      q: ``[batch, q_len, q_heads, head_dim]`` float16/bfloat16.
      k, v: ``[batch, kv_len, kv_heads, head_dim]`` in ``q.dtype`` (GQA/MQA allowed).
      scale, causal, q_positions, kv_lengths, sliding_window, logits_soft_cap: as in the op;
        ``q_positions`` is only accepted where it changes nothing (not causal, no window).
      implementation: ``jax.nn.dot_product_attention``'s backend: "cudnn", or "xla" to run
        the same argument mapping on any platform (how the mapping is tested on CPU).

    Returns:
      ``[batch, q_len, q_heads, head_dim]`` in ``q.dtype``; differentiable in q, k, v.
    """
    if logits_soft_cap is not None:
        raise ValueError(f"{logits_soft_cap=}: cuDNN has no logit soft cap")
    del q_positions  # served only where it changes nothing (supports)
    if q.size == 0 or k.shape[1] == 0:  # nothing to launch; a query with no keys gets zeros
        return jnp.zeros(q.shape, q.dtype)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if kv_lengths is not None:
        kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, k.shape[1])
    with jax.named_scope("cudnn_attention"):
        return _attention(q, k, v, kv_lengths, scale=scale, causal=bool(causal),
                          sliding_window=sliding_window, implementation=implementation)


_registration.add(registry.Implementation(
    op="attention", name="cudnn", fn=cudnn_attention, platforms=frozenset({"gpu"}),
    priority={"gpu": PRIORITY}, verified=VERIFIED, supports=supports,
    available=lambda: device_reason("gpu"),
    description="cuDNN flash attention via jax.nn.dot_product_attention (f16/bf16; "
                "bottom-right causal only where it coincides with cuDNN's top-left)"))
