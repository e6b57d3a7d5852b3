"""Tiny random-weight checkpoints of the decoder families, written by Hugging Face
transformers itself, and transformers' logits and greedy tokens to compare with
(``tests/test_families.py``, ``tests/test_families_moe.py``).

transformers and torch are imported inside the functions: the test modules skip without
them (the ``hf`` fixture of ``conftest.py``).
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from cases.chat_checkpoint import TEMPLATE, build_tokenizer

# forge_jax's logits against transformers' float32 logits.
LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tokenizer(directory: pathlib.Path) -> int:
    """A byte-level BPE tokenizer with a chat template in ``directory``; its vocab size."""
    tok = build_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
         "eos_token": "</s>", "model_max_length": 128, "chat_template": TEMPLATE}))
    return tok.get_vocab_size()


def save_checkpoint(directory: pathlib.Path, config_cls: str, model_cls: str, kwargs: dict, *,
                    seed: int, dtype: str = "float32", tokenizer: pathlib.Path | None = None,
                    gemma_norms: bool = False, stds: dict[str, float] | None = None):
    """``model_cls(config_cls(**kwargs))`` with random weights (large enough that the
    logits are far from uniform; norms around 1, or around 0 with ``gemma_norms``, as
    Gemma stores ``weight - 1``), saved by transformers in ``dtype`` to ``directory``
    with ``tokenizer``'s files; returns transformers' float32 model loaded back from
    the files (so the reference reads what forge_jax reads). ``stds``: the standard
    deviation of the tensors whose names end with a key (e.g. gpt-oss's ``"sinks"``)."""
    import torch
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = next((v for k, v in (stds or {}).items() if name.endswith(k)), None)
            if std is not None:
                p.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if gemma_norms else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25 if p.ndim > 1 else 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    for file in TOKENIZER_FILES if tokenizer is not None else ():
        (directory / file).write_bytes((tokenizer / file).read_bytes())
    ref = getattr(transformers, model_cls).from_pretrained(directory, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


def hf_logits(ref, tokens) -> np.ndarray:
    """transformers' float32 logits ``[batch, seq, vocab]`` of int ``tokens [batch, seq]``."""
    import torch

    with torch.no_grad():
        return ref(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def hf_greedy(ref, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """transformers' greedy continuation of one prompt, stopping at ``eos`` (an id or ids;
    None: no end-of-sequence stop)."""
    import torch

    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(state, tokens, *, graphdef):
    return nnx.merge(graphdef, state)(tokens)


def forge_logits(model, tokens) -> np.ndarray:
    """forge_jax's logits of a model (its full forward, jitted) as NumPy."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(state, jnp.asarray(tokens, jnp.int32), graphdef=graphdef))


def unknown_config_fields(transformers, name: str, config_class: str) -> list[str]:
    """The fields of transformers' default ``config_class`` that family ``name`` neither
    handles nor refuses and that are not irrelevant to every family, sorted."""
    from forge_jax.models import families

    family = families.FAMILIES[name]
    fields = set(getattr(transformers, config_class)().to_dict())
    return sorted(fields - family.handled - families.IRRELEVANT - set(family.refused))
