"""The decoder families (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3) against Hugging
Face transformers: one model, the families' differences as config data.

Each family's checkpoint is written by transformers itself (``XxxForCausalLM(config)
.save_pretrained``) at a tiny size with the fields that matter set away from their
defaults: odd head counts, GQA, head_dim apart from hidden / heads, windows shorter than the
prompt, soft caps that bite, partial rotary, tied and untied heads, biases. forge_jax's
logits must match transformers' within the float32 tolerance and greedy continuations
must be identical with both caches. Negative controls show that each such field changes
the logits (a model that ignored it would fail), and a census of each family's
transformers config checks that every field is read, irrelevant or refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from cases import hf_families
from cases.cli import run
from cases.hf_families import LOGITS_TOL, forge_logits, hf_greedy, hf_logits, save_checkpoint
from flax import nnx

from forge_jax.models import families, llama
from forge_jax.text import api as text

SEQ = 24  # longer than every window below

# family -> (transformers config class, causal LM class, config kwargs, fields whose removal
# must change the logits: a negative control per feature the checkpoint uses).
CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                   intermediate_size=96, tie_word_embeddings=True, use_sliding_window=True,
                   sliding_window=5, max_window_layers=1, rope_theta=1000.0),
              {"qkv_bias": False, "sliding_window": None}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                   intermediate_size=96, attention_bias=True, tie_word_embeddings=False),
              {"qk_norm": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, sliding_window=6),
                {"sliding_window": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                    intermediate_size=96, query_pre_attn_scalar=24, sliding_window=6,
                    attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
               {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                "sliding_window": None, "query_pre_attn_scalar": None}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, query_pre_attn_scalar=20,
                         sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={
                             "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
                    {"rope_local_theta": None, "sliding_window": None, "qk_norm": False}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, sliding_window=7, partial_rotary_factor=0.5,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2),
             {"partial_rotary_factor": 1.0, "sliding_window": None}),
}
BASE = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5)


@functools.cache
def _checkpoint(name: str, root: pathlib.Path, tokenizer: pathlib.Path, vocab: int,
                dtype: str = "float32"):
    """The family's tiny random checkpoint, saved by transformers in ``root/name``, and
    transformers' model loaded back from it (so the reference reads the same files)."""
    config_cls, model_cls, kwargs, _ = CASES[name]
    directory = root / f"{name}-{dtype}"
    ref = save_checkpoint(directory, config_cls, model_cls,
                          dict(vocab_size=vocab, **BASE, **kwargs),
                          seed=sorted(CASES).index(name), dtype=dtype, tokenizer=tokenizer,
                          gemma_norms=name.startswith("gemma"))
    return directory, ref


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("families")
    tok_dir, vocab = tokenizer_files

    def get(name, dtype="float32"):
        directory, ref = _checkpoint(name, root, tok_dir, vocab, dtype)
        return directory, ref, vocab
    return get


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_family_matches_transformers(hf, checkpoints, name):
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory)
    assert model.config.model_type == name
    tokens = _tokens(vocab)
    expected = hf_logits(ref, tokens)
    logits = forge_logits(model, tokens)
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0  # not near-uniform logits

    # Prompts longer than every window, so that the cached decode steps slide too.
    prompts = [tokens[0, :11].tolist(), tokens[1, :7].tolist()]
    want = [hf_greedy(ref, p, 6) for p in prompts]
    for cache in ("paged", "contiguous"):
        got = llama.generate(model, prompts, 6, eos_token_id=(), cache=cache, page_size=4)
        assert got == want, cache


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_family_feature_changes_the_logits(hf, checkpoints, name):
    """Negative controls: the model with one of the family's fields set back to Llama's
    (or to None) must miss transformers' logits by far more than the tolerance."""
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory)
    tokens = _tokens(vocab, seed=1)
    expected = hf_logits(ref, tokens)
    for field, value in CASES[name][3].items():
        change = {field: value} if field != "sliding_window" else {field: value,
                                                                   "layer_types": None}
        wrong = _with_config(model, dataclasses.replace(model.config, **change))
        miss = np.abs(forge_logits(wrong, tokens) - expected).max()
        assert miss > 50 * LOGITS_TOL.atol, (field, miss)


def _with_config(model, config):
    """A model of ``config`` holding ``model``'s weights (those it has: without
    ``qk_norm`` no q and k norms, without ``qkv_bias`` no q/k/v bias)."""
    wrong = llama.Llama(config, rngs=nnx.Rngs(0))
    mine = {k for k, _ in nnx.to_flat_state(nnx.state(wrong))}
    nnx.update(wrong, nnx.from_flat_state(
        [(k, v) for k, v in nnx.to_flat_state(nnx.state(model)) if k in mine]))
    return wrong


def test_gemma2_bfloat16(hf, checkpoints):
    """A bfloat16 checkpoint in bfloat16 compute: within bfloat16's tolerance of
    transformers' float32 run on the same (upcast) weights."""
    directory, ref, vocab = checkpoints("gemma2", "bfloat16")
    model = llama.from_pretrained(directory, dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    tokens = _tokens(vocab, seed=2)
    expected = hf_logits(ref, tokens)
    logits = forge_logits(model, tokens)
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()
    assert all(len(r) == 4 for r in llama.generate(model, [tokens[0, :9].tolist()], 4))


def test_phi3_fused_checkpoint_round_trips(hf, checkpoints):
    """Phi-3's fused qkv_proj / gate_up_proj tensors load and export under their names."""
    from safetensors.numpy import load_file

    directory, _, _ = checkpoints("phi3")
    model = llama.from_pretrained(directory)
    saved = load_file(str(directory / "model.safetensors"))
    exported = llama.hf_state_dict(model)
    assert "model.layers.0.self_attn.qkv_proj.weight" in exported
    assert "model.layers.0.mlp.gate_up_proj.weight" in exported
    assert set(exported) == set(saved)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, saved[name].astype(np.float32), err_msg=name)


def test_phi3_on_a_mesh_matches_transformers(hf, checkpoints):
    """Loaded over tp=4 (each of the 2 KV heads stored twice, Phi-3's fused tensors split
    into the groups of the tensor axis): transformers' greedy tokens."""
    from forge_jax import sharding

    directory, ref, vocab = checkpoints("phi3")
    model = llama.from_pretrained(directory, mesh=sharding.make_mesh("tp=4"))
    assert model.layout.kv_repeat == 2
    prompts = [_tokens(vocab, seed=3)[0, :10].tolist()]
    assert llama.generate(model, prompts, 5, eos_token_id=()) == [
        hf_greedy(ref, prompts[0], 5)]


def test_chat_matches_transformers(hf, checkpoints):
    """A chat turn with a Qwen2 checkpoint: transformers' chat template rendering and
    greedy reply, decoded by its tokenizer, are what ``text.chat`` answers."""
    _, transformers = hf
    directory, ref, _ = checkpoints("qwen2")
    messages = [{"role": "user", "content": "Hello there! How are you today?"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_tok.decode(hf_greedy(ref, ids, 6), skip_special_tokens=True)
    model = llama.from_pretrained(directory)
    got = text.chat(model, text.load_tokenizer(directory), messages, max_new_tokens=6,
                    eos_token_id=())
    assert want and got == want


# --------------------------------------------------------------------------------------
# Config fields: each read, irrelevant or refused

@pytest.mark.parametrize("name", sorted(CASES))
def test_every_config_field_is_handled_irrelevant_or_refused(hf, name):
    assert hf_families.unknown_config_fields(hf[1], name, CASES[name][0]) == []


REFUSALS = {
    "gemma2": ("use_bidirectional_attention", True),
    "gemma3_text": ("use_bidirectional_attention", True),
    "mistral": ("layer_types", ["full_attention", "sliding_attention"]),
    # yarn and longrope are read (tests/test_families_recent.py); a key of another kind,
    # or a missing one, is refused.
    "qwen3": ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                  "low_freq_factor": 1.0}),
    "phi3": ("rope_scaling", {"type": "longrope", "short_factor": [1.0] * 8}),
    "qwen2": ("partial_rotary_factor", 0.5),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_unimplemented_settings_are_refused_by_name(hf, name):
    _, transformers = hf
    raw = getattr(transformers, CASES[name][0])(**BASE, **CASES[name][2]).to_dict()
    raw["architectures"] = [CASES[name][1]]
    llama.LlamaConfig.from_hf(raw)  # the plain config reads
    key, value = REFUSALS[name]
    raw[key] = value
    if key == "rope_scaling":
        raw.pop("rope_parameters", None)
    with pytest.raises(ValueError) as info:
        llama.LlamaConfig.from_hf(raw)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    words = {"rope_parameters": "yarn", "rope_scaling": "longrope"}
    assert words.get(key, key) in message, message


# transformers 4's config.json (the format of most checkpoints on the Hub): top-level RoPE
# keys, no layer_types (the family's default pattern), Gemma 3's rope_local_base_freq and
# sliding_window_pattern.
OLD_FORMAT = {
    "gemma3_text": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                        rope_local_base_freq=50.0, sliding_window_pattern=2),
    "gemma2": dict(rope_theta=10000.0),
    "qwen2": dict(rope_theta=1000.0),
    "phi3": dict(rope_theta=10000.0, partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("name", sorted(OLD_FORMAT))
def test_transformers4_config_format_reads_the_same(hf, checkpoints, name):
    """The transformers-4 keys give the config that the transformers-5 file (checked
    against transformers above) gives."""
    directory, _, _ = checkpoints(name)
    raw = json.loads((directory / "config.json").read_text())
    assert "rope_parameters" in raw
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    old.update(OLD_FORMAT[name])
    assert llama.LlamaConfig.from_hf(old) == llama.load_config(directory)


def test_mismatched_architecture_is_refused():
    with pytest.raises(ValueError, match=r"model_type='qwen2'.*MistralForCausalLM"):
        llama.LlamaConfig.from_hf(dict(model_type="qwen2", architectures=["MistralForCausalLM"],
                                       vocab_size=8, hidden_size=8, intermediate_size=8,
                                       num_hidden_layers=1, num_attention_heads=1))


def test_quantized_checkpoints_are_refused_in_every_family():
    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=1, quantization_config={"quant_method": "awq", "bits": 4})
    for fam in families.FAMILIES.values():
        with pytest.raises(ValueError, match="quantization_config="):
            llama.LlamaConfig.from_hf(dict(base, model_type=fam.model_type,
                                           architectures=[fam.architecture]))


# --------------------------------------------------------------------------------------
# The command line

def test_cli_generates_text_with_every_family(hf, checkpoints, capsys):
    for name in sorted(CASES):
        directory, ref, _ = checkpoints(name)
        rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--prompt",
                           "Hello there", "--max-new-tokens", "1", "--no-stream")
        assert rc == 0, (name, err)
        assert out.strip(), (name, out, err)
        assert f": {name}, 2 layers" in out + err, (name, out, err)

