"""A checkpoint's ``generation_config.json`` (its eos ids, sampling defaults and
``max_new_tokens``) and the error every checkpoint reader raises.

A leaf of the models package: checkpoint loading (:mod:`forge_jax.models.llama_checkpoint`)
and the text API (:mod:`forge_jax.models.text`) both read it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from forge_jax.models import sampling as sampling_lib


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message names the file or tensor."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """A checkpoint's ``generation_config.json``: the defaults of :func:`generate_text`
    and :func:`chat`, each overridden by the caller's argument when given.

    Attributes:
      eos_token_id: the ids that end a sequence (empty: none given).
      do_sample: False: greedy decoding unless the caller gives a temperature.
      temperature, top_k, top_p, min_p, repetition_penalty: transformers' meanings;
        None when the file does not set them.
      max_new_tokens: None when the file does not set it.
    """

    eos_token_id: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, where: str = "generation_config") -> (
            GenerationConfig):
        eos = raw.get("eos_token_id")
        eos = () if eos is None else (eos,) if isinstance(eos, int) else eos
        if not isinstance(eos, list | tuple) or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise CheckpointError(f"{where}: eos_token_id must be an int or a list of ints, "
                                  f"got {raw.get('eos_token_id')!r}")
        config = cls(eos_token_id=tuple(eos), do_sample=bool(raw.get("do_sample", False)),
                     **{k: raw.get(k) for k in ("temperature", "top_k", "top_p", "min_p",
                                                "repetition_penalty", "max_new_tokens")})
        n = config.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise CheckpointError(f"{where}: max_new_tokens must be an int >= 1, got {n!r}")
        if config.top_k == 0:  # transformers' "no top-k"
            config = dataclasses.replace(config, top_k=None)
        try:
            config.sampling_params()
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return config

    def sampling_params(self, *, temperature=None, top_k=None, top_p=None, min_p=None,
                        repetition_penalty=None) -> sampling_lib.SamplingParams:
        """The caller's values where given (not None), this config's elsewhere. Without a
        caller's temperature, ``do_sample=True`` or a caller's ``top_k`` (other than 0),
        ``top_p`` or ``min_p`` samples at the config's temperature (1.0 if unset): a
        filter asks for sampling, and is not dropped for greedy decoding. Otherwise it is
        greedy. ``top_k=0`` turns top-k off."""
        if temperature is None:
            temperature = (1.0 if self.temperature is None else self.temperature) \
                if self.do_sample or implies_sampling(top_k, top_p, min_p) else 0.0
        top_k = self.top_k if top_k is None else top_k
        return sampling_lib.SamplingParams(
            temperature, None if top_k == 0 else top_k, self.top_p if top_p is None else top_p,
            self.min_p if min_p is None else min_p,
            self.repetition_penalty if repetition_penalty is None else repetition_penalty)


def implies_sampling(top_k=None, top_p=None, min_p=None) -> bool:
    """Whether a caller's filters ask for sampling: any of ``top_k`` (other than 0, which
    turns top-k off), ``top_p`` or ``min_p`` given. Without a temperature they sample at
    the generation config's temperature, else 1.0 (:meth:`GenerationConfig.sampling_params`)."""
    return (top_k is not None and top_k != 0) or top_p is not None or min_p is not None


def load_generation_config(path: str | os.PathLike) -> GenerationConfig | None:
    """``path/generation_config.json`` (a local directory) as a :class:`GenerationConfig`,
    or None if absent. :func:`forge_jax.models.text.load_generation_config` also takes a Hub
    repository id."""
    file = pathlib.Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    return GenerationConfig.from_dict(raw, where=str(file))
