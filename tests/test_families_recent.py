"""The recent decoder variants against Hugging Face transformers: SmolLM3 (NoPE layers),
Qwen3 with YaRN and Phi-3 with LongRoPE scaling.

As in ``tests/test_families.py``, each checkpoint is written by transformers itself at a
tiny size with the fields that matter set away from their defaults (NoPE layers that
slide, a window shorter than the prompt, an original context shorter than the prompt so
that the scaled frequencies are the ones used); logits must match transformers' within
the float32 tolerance, greedy continuations be identical with both caches and through
the serving engine, and negative controls show each feature changes the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import numpy as np
import pytest
from cases import hf_families
from cases.hf_families import LOGITS_TOL, forge_logits, hf_greedy, hf_logits, save_checkpoint
from flax import nnx

from forge_jax.generation import generate
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama
from forge_jax.serving import engine as serving
from forge_jax.text import api as text

SEQ = 24  # longer than every window and every original context below


def _no_attention_factor(config):
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(
        config.rope_scaling, attention_factor=1.0))


def _short_only(config):
    s = config.rope_scaling
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(
        s, long_factor=s.short_factor))


# name -> (transformers config class, causal LM class, config kwargs, model_type, the
# negative controls: name -> the config without the feature, which must miss the logits).
# The prompts (13 and 11 tokens) are past each original context: both the long-context
# frequencies and, for LongRoPE, the long factors are the ones used.
CASES = {
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=96, no_rope_layers=[1, 0, 1], use_sliding_window=True,
                     sliding_window=6, num_hidden_layers=3, rope_theta=500.0,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2),
                "smollm3", {"nope_layers": lambda c: dataclasses.replace(c, nope_layers=()),
                            "sliding_window": lambda c: dataclasses.replace(
                                c, sliding_window=None, layer_types=None)}),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=24, intermediate_size=96,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0,
                                         "original_max_position_embeddings": 8,
                                         "beta_fast": 4.0, "beta_slow": 0.25}),
                   "qwen3", {"rope_scaling": lambda c: dataclasses.replace(c, rope_scaling=None),
                             "attention_factor": _no_attention_factor}),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=96, partial_rotary_factor=0.5,
                           original_max_position_embeddings=10, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0,
                                            "short_factor": [1.0, 1.5, 2.0, 3.0],
                                            "long_factor": [1.5, 3.0, 5.0, 9.0]}),
                      "phi3", {"long_factor": _short_only,
                               "attention_factor": _no_attention_factor}),
}
BASE = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5)


@functools.cache
def _checkpoint(name: str, root: pathlib.Path, tokenizer: pathlib.Path, vocab: int):
    config_cls, model_cls, kwargs, _, _ = CASES[name]
    directory = root / name
    ref = save_checkpoint(directory, config_cls, model_cls,
                          {"vocab_size": vocab, **BASE, **kwargs},
                          seed=20 + sorted(CASES).index(name), tokenizer=tokenizer)
    return directory, ref


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("recent_families")
    tok_dir, vocab = tokenizer_files
    return lambda name: _checkpoint(name, root, tok_dir, vocab) + (vocab,)


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


def _with_config(model, config):
    """A model of ``config`` holding ``model``'s weights."""
    wrong = llama.Llama(config, rngs=nnx.Rngs(0))
    nnx.update(wrong, nnx.state(model))
    return wrong


def _engine_tokens(model, directory, prompts, max_tokens):
    """The serving engine's greedy tokens (no end-of-sequence stop)."""
    engine = serving.Engine(model, text.load_tokenizer(directory), serving.EngineConfig(
        max_batch_tokens=16, min_batch_tokens=8, num_pages=32, eos_token_ids=(),
        cache=CacheSpec(page_size=4)))
    streams = [engine.submit(p, serving.RequestParams(max_tokens=max_tokens)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.result()[0] for s in streams]


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_matches_transformers(checkpoints, name):
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory)
    assert model.config.model_type == CASES[name][3]
    tokens = _tokens(vocab)
    expected = hf_logits(ref, tokens)
    np.testing.assert_allclose(forge_logits(model, tokens), expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0  # not near-uniform logits

    # Negative controls: each feature set back misses transformers by far.
    for field, without in CASES[name][4].items():
        wrong = _with_config(model, without(model.config))
        miss = np.abs(forge_logits(wrong, tokens) - expected).max()
        assert miss > 50 * LOGITS_TOL.atol, (field, miss)

    # Prompts past the windows and the original contexts; decode steps slide too.
    prompts = [tokens[0, :13].tolist(), tokens[1, :11].tolist()]
    want = [hf_greedy(ref, p, 6) for p in prompts]
    for kind in ("paged", "contiguous"):
        spec = CacheSpec(kind=kind, page_size=4)
        assert generate(model, prompts, 6, eos_token_id=(), cache=spec) == want, kind
    assert _engine_tokens(model, directory, prompts, 6) == want


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_config_field_is_handled_irrelevant_or_refused(hf, name):
    model_type = CASES[name][3]
    assert hf_families.unknown_config_fields(hf[1], model_type, CASES[name][0]) == []


def test_smollm3_nope_layers_from_the_interval(hf):
    """Without ``no_rope_layers`` every ``no_rope_layer_interval``-th layer is NoPE, and
    with ``use_sliding_window`` those slide, as transformers resolves it."""
    _, transformers = hf
    raw = transformers.SmolLM3Config(**dict(BASE, hidden_size=32, num_attention_heads=2,
                                            num_key_value_heads=1, pad_token_id=0,
                                            intermediate_size=32, num_hidden_layers=6,
                                            no_rope_layer_interval=3, use_sliding_window=True,
                                            sliding_window=4)).to_dict()
    raw["architectures"] = ["SmolLM3ForCausalLM"]
    config = llama.LlamaConfig.from_hf(raw)
    assert config.nope_layers == (2, 5)
    assert [config.layer_window(i) for i in range(6)] == [None, None, 4, None, None, 4]
    del raw["no_rope_layers"], raw["layer_types"]
    assert llama.LlamaConfig.from_hf(raw) == config
    with pytest.raises(ValueError, match=r"no_rope_layers=\[1, 2\] must give 6 layers"):
        llama.LlamaConfig.from_hf(dict(raw, no_rope_layers=[1, 2]))
    raw["use_sliding_window"] = False
    assert llama.LlamaConfig.from_hf(raw).sliding_window is None
