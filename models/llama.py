"""A Llama-family decoder in Flax NNX, built only from forge_jax ops.

Covers what Hugging Face's ``LlamaForCausalLM`` configs describe: multi-head, grouped
and multi-query attention, ``head_dim`` different from ``hidden_size //
num_attention_heads``, tied or separate output embeddings, optional attention and MLP
biases, and RoPE with no scaling or with the ``linear`` and ``llama3`` scalings; and,
as data in the same config, the Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 (text) and
Phi-3 families (:mod:`forge_jax.models.families`). Anything else (another architecture,
another rope type, another activation) is refused when the config is read, never run
wrongly.

Every numerical step is a forge_jax op (``fj.embedding``, ``fj.rms_norm`` with the
fused residual add, ``fj.rope``, ``fj.attention`` or the KV cache's ``attend``,
``fj.silu_mul``, ``fj.matmul``), so ``fj.use_implementation(...)`` switches the whole
model.

Usage::

    from forge_jax.models import llama
    model = llama.from_pretrained("path/to/hf_llama_dir")
    logits = model(tokens)                                  # [batch, seq, vocab]
    new_tokens = llama.generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=16)

The code lives in four modules, one per concern, re-exported here:
:mod:`forge_jax.models.llama_model` (the config and the layers),
:mod:`forge_jax.models.llama_checkpoint` (Hugging Face checkpoints),
:mod:`forge_jax.models.steps` (the jitted prefill and decode steps, explicit KV cache in
and out) and :mod:`forge_jax.models.generation` (the generation loop); the text API
(:func:`load_tokenizer`, :func:`generate_text`, :func:`chat`) lives in
:mod:`forge_jax.models.text` and the multi-turn chat that keeps its KV cache in
:mod:`forge_jax.models.chat_session`.
"""

from forge_jax.models.generation import (  # noqa: F401
    GenerationStats,
    check_generation_fits,
    check_sequence_length,
    generate,
    generate_with_stats,
)
from forge_jax.models.llama_checkpoint import (  # noqa: F401
    CheckpointError,
    from_pretrained,
    hf_state_dict,
    load_config,
)
from forge_jax.models.llama_model import (  # noqa: F401
    SUPPORTED_ARCHITECTURES,
    Linear,
    Llama,
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    TensorLayout,
)
from forge_jax.models.steps import decode_step, prefill_step  # noqa: F401
from forge_jax.models.text import (  # noqa: F401  (the text API, also in models.text)
    chat,
    generate_text,
    load_tokenizer,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES", "CheckpointError", "GenerationStats", "Linear", "Llama",
    "LlamaAttention", "LlamaConfig", "LlamaDecoderLayer", "LlamaMLP", "RMSNorm",
    "check_generation_fits", "check_sequence_length", "decode_step", "from_pretrained",
    "generate", "generate_with_stats", "hf_state_dict", "load_config", "prefill_step",
    "TensorLayout",
    "chat", "generate_text", "load_tokenizer",
]
