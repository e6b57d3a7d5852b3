"""Generation settings: a checkpoint's defaults merged with the caller's values.

The one place where a checkpoint's ``generation_config.json`` (data, read by
:mod:`forge_jax.models.checkpoints`) becomes the runtime's :class:`SamplingParams`.
"""

from __future__ import annotations

from forge_jax.generation.sampling import SamplingParams
from forge_jax.models.checkpoints.generation_config import GenerationConfig


def implies_sampling(top_k=None, top_p=None, min_p=None) -> bool:
    """Whether a caller's filters ask for sampling: any of ``top_k`` (other than 0, which
    turns top-k off), ``top_p`` or ``min_p`` given. Without a temperature they sample at
    the generation config's temperature, else 1.0 (:func:`sampling_params`)."""
    return (top_k is not None and top_k != 0) or top_p is not None or min_p is not None


def sampling_params(config: GenerationConfig | None = None, *, temperature=None, top_k=None,
                    top_p=None, min_p=None, repetition_penalty=None) -> SamplingParams:
    """The caller's values where given (not None), ``config``'s elsewhere. Without a
    caller's temperature, ``do_sample=True`` or a caller's ``top_k`` (other than 0),
    ``top_p`` or ``min_p`` samples at the config's temperature (1.0 if unset): a filter
    asks for sampling, and is not dropped for greedy decoding. Otherwise it is greedy.
    ``top_k=0`` turns top-k off."""
    config = config or GenerationConfig()
    if temperature is None:
        temperature = (1.0 if config.temperature is None else config.temperature) \
            if config.do_sample or implies_sampling(top_k, top_p, min_p) else 0.0
    top_k = config.top_k if top_k is None else top_k
    return SamplingParams(
        temperature, None if top_k == 0 else top_k, config.top_p if top_p is None else top_p,
        config.min_p if min_p is None else min_p,
        config.repetition_penalty if repetition_penalty is None else repetition_penalty)
