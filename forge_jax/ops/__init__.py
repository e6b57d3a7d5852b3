"""The public ops, one module per family; each module holds the op and its XLA reference."""

from forge_jax.ops.activation import silu_mul, softmax
from forge_jax.ops.attention import attention
from forge_jax.ops.embedding import embedding
from forge_jax.ops.matmul import matmul
from forge_jax.ops.norm import rms_norm
from forge_jax.ops.paged import copy_pages, paged_attention, paged_gather, paged_write
from forge_jax.ops.ragged import ragged_paged_attention
from forge_jax.ops.rope import RopeScaling, rope, rope_cos_sin

__all__ = [
    "RopeScaling", "attention", "embedding", "matmul", "rms_norm", "rope", "rope_cos_sin",
    "silu_mul", "softmax",
    "copy_pages", "paged_attention", "paged_gather", "paged_write",
    "ragged_paged_attention",
]
