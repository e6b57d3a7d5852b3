"""Memory awareness: estimate what inference needs, and check it fits before allocating.

``estimate_inference_memory`` counts the bytes of a Llama-family model's weights, of a
KV cache for a batch and length, and of the largest transient activations of a
prefill. ``check_fits`` compares a number of bytes with what the device has free and
raises :class:`InsufficientMemoryError` ("needs X GiB, device has Y GiB free") instead
of letting the allocation crash with an out-of-memory error.

Free memory comes from ``device.memory_stats()`` where the platform reports it (GPU,
TPU: ``bytes_limit - bytes_in_use``); on CPU, where it does not, from the operating
system: ``MemAvailable`` in ``/proc/meminfo`` (or ``os.sysconf``), lowered to the
cgroup limit of a container when one is set.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from forge_jax.ops import kv_quant
from forge_jax.quant import bits_per_value

GIB = 1024 ** 3


class InsufficientMemoryError(MemoryError):
    """The device lacks the memory a step needs. Attributes: ``required``, ``available`` (bytes)."""

    def __init__(self, message: str, *, required: int, available: int):
        super().__init__(message)
        self.required = required
        self.available = available


@dataclasses.dataclass(frozen=True)
class InferenceMemory:
    """Bytes needed for inference.

    Attributes:
      weights: the parameters in their storage dtype.
      kv_cache: K and V of every layer for ``batch * max_len`` tokens.
      activations: the largest transient buffers of a prefill (hidden states, the
        MLP's intermediate, attention logits, output logits), a rough upper estimate.
    """

    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def __str__(self) -> str:
        return (f"weights {self.weights / GIB:.3f} GiB + KV cache {self.kv_cache / GIB:.3f} GiB"
                f" + activations {self.activations / GIB:.3f} GiB = {self.total / GIB:.3f} GiB")


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def estimate_inference_memory(config: Any, *, batch: int, max_len: int, prefill_len: int | None
                              = None, param_dtype=jnp.float32, dtype=jnp.float32,
                              cache_dtype=None, quantize: str | None = None,
                              group_size: int | None = None,
                              kv_cache_dtype: str | None = None) -> InferenceMemory:
    """Estimates the memory of running a Llama-family model.

    Args:
      config: a ``forge_jax.models.llama.LlamaConfig`` or a Hugging Face ``config.json`` dict
        (anything with the HF field names: ``vocab_size``, ``hidden_size``,
        ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, and
        optionally ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``,
        ``attention_bias``, ``mlp_bias``).
      batch: sequences decoded together.
      max_len: tokens per sequence the cache holds (prompt + new tokens).
      prefill_len: tokens per sequence in one prefill step (default ``max_len``).
      param_dtype: storage dtype of the weights.
      dtype: compute dtype of activations.
      cache_dtype: KV cache dtype (default ``dtype``).
      quantize: ``"int8"``, ``"int4"`` or ``"fp8"``: the linear layers' weights (not the
        embedding nor the norms) are counted at that format's bytes, float32 scales
        included (:func:`forge_jax.quant.bits_per_value`), as ``from_pretrained(...,
        quantize=...)`` stores them.
      group_size: the quantization group along the in axis (int4 default 32; int8 and
        fp8: one scale per output channel).
      kv_cache_dtype: ``"int8"`` or ``"fp8"``: a quantized KV cache, counted at a byte per
        value plus a float32 scale per token and KV head (:mod:`forge_jax.ops.kv_quant`).

    Returns:
      An :class:`InferenceMemory` (bytes).
    """
    vocab, hidden = _get(config, "vocab_size"), _get(config, "hidden_size")
    inter, layers = _get(config, "intermediate_size"), _get(config, "num_hidden_layers")
    heads = _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim", hidden // heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    per_layer = (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden  # attention projections
                 + 2 * hidden)  # two norms
    if _get(config, "qk_norm", False):  # Qwen3, Gemma 3: a norm over each head of q and k
        per_layer += 2 * head_dim
    if _get(config, "sandwich_norms", False):  # Gemma: two more norms per layer
        per_layer += 2 * hidden
    mlp_params, mlp_linear = _mlp_params(config, hidden, inter, layers)  # all layers' MLPs
    if _get(config, "attention_bias", False):
        per_layer += 2 * q_dim + 2 * kv_dim - q_dim + hidden
    elif _get(config, "qkv_bias", False):  # Qwen2: q, k and v only
        per_layer += q_dim + 2 * kv_dim
    if _get(config, "mlp_bias", False):
        per_layer += 2 * inter + hidden
    params = vocab * hidden + layers * per_layer + mlp_params + hidden
    if not _get(config, "tie_word_embeddings", False):
        params += hidden * vocab
    weights = params * _itemsize(param_dtype)
    if quantize is not None:
        linear = layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden) + mlp_linear
        if not _get(config, "tie_word_embeddings", False):
            linear += hidden * vocab
        group = group_size or (32 if quantize == "int4" else None)
        bits = bits_per_value(quantize, group_size=group, columns=hidden)
        weights -= linear * _itemsize(param_dtype)
        weights += linear * bits / 8

    cache_dtype = dtype if cache_dtype is None else cache_dtype
    kv_cache = 2 * layers * batch * max_len * kv_dim * kv_quant.bytes_per_value(
        kv_cache_dtype, cache_dtype, head_dim)

    t = max_len if prefill_len is None else prefill_len
    act = _itemsize(dtype)
    tokens = batch * t
    # Live at the MLP: residual, normed input, gate, up, product; at attention: q, k, v,
    # float32 logits and probabilities over the cache, the gathered keys and values.
    mlp = tokens * (2 * hidden + 3 * inter) * act
    attn = (tokens * (2 * hidden + q_dim + 2 * kv_dim) * act
            + 2 * batch * heads * t * max_len * 4 + 2 * batch * max_len * kv_dim * 4)
    logits = batch * vocab * 4 * 2
    activations = max(mlp, attn) + logits
    return InferenceMemory(weights=int(weights), kv_cache=int(kv_cache),
                           activations=int(activations))


def _mlp_params(config: Any, hidden: int, inter: int, layers: int) -> tuple[int, int]:
    """The parameters of every layer's MLP: dense (``3 * hidden * intermediate_size``)
    or, in a mixture of experts' sparse layers, the experts, the router and a shared
    expert (the layers LlamaConfig.is_moe names; for a dict, by the same rule); and how
    many of them ``quantize=`` quantizes (all but the routers and the shared-expert gate)."""
    experts = _get(config, "num_experts", 0) or _get(config, "num_local_experts", 0)
    if not experts:
        return layers * 3 * hidden * inter, layers * 3 * hidden * inter
    moe_inter = _get(config, "moe_intermediate_size", inter)
    step = _get(config, "decoder_sparse_step", 1)
    dense = set(_get(config, "mlp_only_layers", ()))
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = _get(config, "shared_expert_intermediate_size", 0)
    per_moe = experts * (3 * hidden * moe_inter + hidden) + (
        3 * hidden * shared + hidden if shared else 0)
    gates = experts * hidden + (hidden if shared else 0)  # routers, shared-expert gate
    dense = (layers - sparse) * 3 * hidden * inter
    return dense + sparse * per_moe, dense + sparse * (per_moe - gates)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _host_available_bytes() -> int | None:
    """Available physical memory of this host (or container), in bytes."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    # A container's limit (cgroup v2, then v1) may be lower than the host's free memory.
    for limit_file, usage_file in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:
            available = min(available, max(limit - usage, 0))
            break
    return available


def device_free_bytes(device: jax.Device | None = None) -> tuple[int | None, str]:
    """(free bytes or None if unknown, a description of where the figure comes from)."""
    device = jax.devices()[0] if device is None else device
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None.
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"{device.platform} device {device.id}"
    if device.platform == "cpu":
        return _host_available_bytes(), "host memory (CPU)"
    return None, f"{device.platform} device {device.id} (memory not reported)"


def check_fits(required_bytes: int, *, device: jax.Device | None = None, what: str = "this step"
               ) -> None:
    """Raises :class:`InsufficientMemoryError` if ``required_bytes`` exceed the free memory.

    Does nothing when the free memory cannot be determined.

    Args:
      required_bytes: bytes about to be allocated.
      device: the device (default: JAX's first device).
      what: what needs the memory, for the message (e.g. "a KV cache for batch 8 x 4096").
    """
    free, where = device_free_bytes(device)
    if free is None or required_bytes <= free:
        return
    raise InsufficientMemoryError(
        f"{what} needs {required_bytes / GIB:.2f} GiB, {where} has {free / GIB:.2f} GiB free; "
        f"reduce the batch, the prompt length or max_new_tokens, or use a smaller dtype",
        required=int(required_bytes), available=int(free))
