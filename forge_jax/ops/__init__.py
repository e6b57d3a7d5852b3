"""The public ops, one module per family; each module holds the op and its XLA reference.

The dtype rule (every op, every implementation)
-----------------------------------------------
An op's *compute inputs* share one float dtype, and its result is in that dtype (or in
``out_dtype`` where the op takes one). A mix raises TypeError naming both dtypes, before
any work and whatever ``jax_numpy_dtype_promotion`` says: the ops never promote one input
or round another silently (cast explicitly). The compute inputs are: ``matmul``'s ``a``
and ``b``; ``rms_norm``'s ``x`` and ``residual`` (their sum is rounded to ``x.dtype``);
``silu_mul``'s and ``gelu_tanh_mul``'s ``gate`` and ``up``; ``grouped_matmul``'s and
``conv2d``'s ``x`` and ``w``; ``paged_write``'s new ``k`` and ``v``. ``rope``, ``softmax`` and
``embedding`` have one float input, whose dtype the result keeps; ``moe_route``'s weights are
float32 whatever its logits' dtype (routing weights are probabilities, kept in float32 to be
combined).

Two kinds of inputs are *storage*, not compute: any float dtype is accepted, read exactly
into the op's float32 math, and the result keeps the compute dtype.

* **Parameters** that scale or shift the result: ``rms_norm``'s ``weight`` and
  ``matmul``'s ``c`` (e.g. float32 weights with bfloat16 activations, as a model's
  ``param_dtype`` gives).
* **KV caches**: ``attention``'s ``k`` and ``v`` and the paged pools ``k_pages`` and
  ``v_pages`` (``paged_attention``, ``ragged_paged_attention``, ``copy_pages``,
  ``paged_gather``), stored in the cache's own dtype (e.g. a bfloat16 cache with float32
  queries). The keys and values of one cache share one dtype (a mix raises TypeError);
  the queries may differ. ``paged_write`` stores new keys and values in the pools' dtype.
  A pool may also be quantized: an int8 or fp8 ``QuantizedArray`` with a scale per token and
  KV head (:mod:`forge_jax.ops.kv_quant`), K and V in one format; ``paged_write`` quantizes
  into it and the attention ops dequantize what they read, with float32 math. On TPU a
  float pool of head_dim 64 may be stored folded, two tokens per 128-lane row
  (``FoldedPages``, :mod:`forge_jax.ops.kv_fold`); the ops read and write it by its
  logical shape.
"""

from forge_jax.ops import quantized_matmul_cpu  # noqa: F401  (registers the CPU kernel)
from forge_jax.ops.activation import gelu_tanh_mul, silu_mul, softmax
from forge_jax.ops.attention import attention
from forge_jax.ops.conv import conv2d
from forge_jax.ops.embedding import embedding
from forge_jax.ops.gated_delta import causal_conv1d, gated_delta_gates, gated_delta_rule
from forge_jax.ops.grouped_matmul import grouped_matmul
from forge_jax.ops.matmul import matmul
from forge_jax.ops.mla import mla_attention, mla_paged_attention, mla_paged_write
from forge_jax.ops.moe import moe, moe_permute, moe_route, moe_unpermute
from forge_jax.ops.norm import rms_norm
from forge_jax.ops.paged import copy_pages, paged_attention, paged_gather, paged_write
from forge_jax.ops.ragged import ragged_paged_attention
from forge_jax.ops.rope import RopeScaling, rope, rope_cos_sin, yarn_mscale

__all__ = [
    "RopeScaling", "attention", "conv2d", "embedding", "grouped_matmul", "matmul", "rms_norm",
    "rope", "rope_cos_sin", "yarn_mscale",
    "silu_mul", "gelu_tanh_mul", "softmax", "moe", "moe_permute", "moe_route", "moe_unpermute",
    "copy_pages", "paged_attention", "paged_gather", "paged_write",
    "ragged_paged_attention",
    "mla_attention", "mla_paged_attention", "mla_paged_write",
    "causal_conv1d", "gated_delta_gates", "gated_delta_rule",
]
