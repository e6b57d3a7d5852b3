"""forge_jax: functional JAX kernels for LLM inference.

Pure ops that run under ``jax.jit``, ``vmap`` and ``grad`` on every platform
through XLA, with Pallas kernels swapped in by the dispatch registry where the
hardware allows. See README.md for a tour.
"""

from forge_jax import (
    aot,
    autotune_cache,
    autotuning,
    backends,
    dispatch,
    kv_cache,
    quant,
    registry,
    sharding,
    targets,
    tolerances,
)
from forge_jax._checks import debug_checks
from forge_jax.autotuning import autotune
from forge_jax.dispatch import ImplementationError, explain, use_implementation
from forge_jax.ops import (
    RopeScaling,
    attention,
    causal_conv1d,
    conv2d,
    copy_pages,
    embedding,
    gated_delta_gates,
    gated_delta_rule,
    gelu_tanh_mul,
    grouped_matmul,
    matmul,
    mla_attention,
    mla_paged_attention,
    mla_paged_write,
    moe,
    moe_permute,
    moe_route,
    moe_unpermute,
    paged_attention,
    paged_gather,
    paged_write,
    ragged_paged_attention,
    rms_norm,
    rope,
    rope_cos_sin,
    silu_mul,
    softmax,
)
from forge_jax.quant import QuantizedArray, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "ImplementationError", "RopeScaling", "attention", "backends", "conv2d", "dispatch",
    "embedding",
    "explain", "gelu_tanh_mul", "grouped_matmul", "matmul", "rms_norm", "rope", "rope_cos_sin",
    "silu_mul", "softmax", "moe", "moe_permute", "moe_route", "moe_unpermute",
    "tolerances", "use_implementation", "autotune", "autotuning",
    "copy_pages", "kv_cache", "paged_attention", "paged_gather", "paged_write",
    "ragged_paged_attention", "sharding", "targets", "aot", "registry", "autotune_cache",
    "debug_checks", "QuantizedArray", "dequantize", "quantize", "quant",
    "mla_attention", "mla_paged_attention", "mla_paged_write",
    "causal_conv1d", "gated_delta_gates", "gated_delta_rule",
]
