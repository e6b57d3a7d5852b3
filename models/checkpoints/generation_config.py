"""A checkpoint's ``generation_config.json`` (its eos ids, sampling defaults and
``max_new_tokens``) and the error every checkpoint reader raises.

Data only: checkpoint loading (:mod:`forge_jax.models.checkpoints.hf`) reads it into
``model.generation_config``; the runtime turns it into settings
(:func:`forge_jax.generation.settings.sampling_params`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any


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
        problem = _sampling_problem(config)
        if problem:
            raise CheckpointError(f"{where}: {problem}")
        return config


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _sampling_problem(c: GenerationConfig) -> str | None:
    """What is wrong with the file's sampling values, in the words of
    :class:`forge_jax.generation.SamplingParams`, or None."""
    if c.temperature is not None and (not _is_number(c.temperature) or c.temperature < 0
                                      or c.temperature != c.temperature):
        return f"temperature must be a number >= 0, got {c.temperature!r}"
    if c.top_k is not None and (isinstance(c.top_k, bool) or not isinstance(c.top_k, int)
                                or not 0 < c.top_k < 2**31):
        return f"top_k must be a positive int or None, got {c.top_k!r}"
    if c.top_p is not None and (not _is_number(c.top_p) or not 0.0 < c.top_p <= 1.0):
        return f"top_p must be in (0, 1] or None, got {c.top_p!r}"
    if c.min_p is not None and (not _is_number(c.min_p) or not 0.0 <= c.min_p <= 1.0):
        return f"min_p must be in [0, 1] or None, got {c.min_p!r}"
    penalty = c.repetition_penalty
    if penalty is not None and (not _is_number(penalty) or not 0.0 < penalty < float("inf")):
        return f"repetition_penalty must be a finite number > 0 or None, got {penalty!r}"
    return None


def load_generation_config(path: str | os.PathLike) -> GenerationConfig | None:
    """``path/generation_config.json`` (a local directory) as a :class:`GenerationConfig`,
    or None if absent. :func:`forge_jax.text.api.load_generation_config` also takes a Hub
    repository id."""
    file = pathlib.Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    return GenerationConfig.from_dict(raw, where=str(file))
