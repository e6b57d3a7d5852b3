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

    from forge_jax import generation
    new_tokens = generation.generate(model, [[1, 2, 3], [1, 5]], max_new_tokens=16)

The model lives in :mod:`forge_jax.models.llama_model` (the config and the layers) and its
checkpoints in :mod:`forge_jax.models.checkpoints`, both re-exported here. Generating with it
is the runtime's: :mod:`forge_jax.generation` (the steps and the generate loop) and
:mod:`forge_jax.text` (tokenizer, chat templates, the text API). The generation names this
module used to re-export (``generate``, ``generate_text``, ...) still resolve, with a
``DeprecationWarning`` naming their new home, for one release.
"""

from forge_jax._moved import forward
from forge_jax.models.checkpoints.hf import (  # noqa: F401
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

# Moved to the runtime (forge_jax.generation, forge_jax.text): old name -> new module.
_MOVED = {
    **dict.fromkeys(("GenerationStats", "check_generation_fits", "check_sequence_length",
                     "generate", "generate_with_stats", "decode_step", "prefill_step"),
                    "forge_jax.generation"),
    **dict.fromkeys(("chat", "generate_text", "load_tokenizer"), "forge_jax.text"),
}
_FORWARDS = {new: forward(__name__, new) for new in set(_MOVED.values())}


def __getattr__(name: str):
    if name in _MOVED:
        return _FORWARDS[_MOVED[name]](name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SUPPORTED_ARCHITECTURES", "CheckpointError", "Linear", "Llama", "LlamaAttention",
    "LlamaConfig", "LlamaDecoderLayer", "LlamaMLP", "RMSNorm", "TensorLayout",
    "from_pretrained", "hf_state_dict", "load_config",
]
