"""Reading checkpoints into a :class:`~forge_jax.models.llama_model.Llama`: Hugging Face
safetensors directories (:mod:`~forge_jax.models.checkpoints.hf`, with the parameter names in
:mod:`~forge_jax.models.checkpoints.hf_names`), GGUF files
(:mod:`~forge_jax.models.checkpoints.gguf`), FP8 checkpoints
(:mod:`~forge_jax.models.checkpoints.fp8`), the Hub (:mod:`~forge_jax.models.checkpoints.hub`),
quantizing while loading (:mod:`~forge_jax.models.checkpoints.quantize`) and a checkpoint's
``generation_config.json`` (:mod:`~forge_jax.models.checkpoints.generation_config`).
"""

from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.checkpoints.hf import from_pretrained, load_config

__all__ = ["CheckpointError", "GenerationConfig", "from_pretrained", "load_config"]
