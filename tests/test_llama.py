"""The Llama model against Hugging Face transformers, and checkpoint loading.

Parity: tiny random-weight ``LlamaForCausalLM`` configs (MHA, GQA, MQA, tied and
untied embeddings, head_dim != hidden / heads, biases, linear and llama3 RoPE
scaling, the old and the transformers-5 config formats) are saved with
``save_pretrained`` (safetensors), loaded with :func:`forge_jax.models.llama.from_pretrained`,
and must give transformers' logits within the float32 tolerance and the same greedy
continuations. Those tests skip where torch/transformers are not installed; the
loading-error tests write their checkpoints with safetensors alone and always run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from cases.hf_families import forge_logits, hf_greedy, hf_logits
from flax import nnx
from safetensors.numpy import load_file, save_file

import forge_jax as fj
from forge_jax.models import llama

# A whole model is ~30 sequential float32 ops deep; its logits (of order 1-10) may stray
# by a few float32 ulps per op from transformers' (different summation order).
LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

# name -> (config overrides, rope_theta, rope scaling dict or None, config format)
PARITY_CASES = {
    "mha_untied": (dict(num_key_value_heads=4), 10000.0, None, "rope_parameters"),
    "gqa_tied": (dict(num_key_value_heads=2, tie_word_embeddings=True), 10000.0, None,
                 "old_keys"),
    "mqa_head_dim_biases": (dict(num_key_value_heads=1, head_dim=32, attention_bias=True,
                                 mlp_bias=True), 10000.0, None, "rope_parameters"),
    "linear_old_keys": (dict(num_key_value_heads=2), 10000.0,
                        {"rope_type": "linear", "factor": 4.0}, "old_keys"),
    "linear_rope_parameters": (dict(num_key_value_heads=2, tie_word_embeddings=True), 1000.0,
                               {"rope_type": "linear", "factor": 2.0}, "rope_parameters"),
    "llama3_old_keys": (dict(num_key_value_heads=2), 500000.0, LLAMA3, "old_keys"),
    "llama3_rope_parameters": (dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True),
                               500000.0, LLAMA3, "rope_parameters"),
}


def _rewrite_config(directory: pathlib.Path, fmt: str, theta: float, scaling: dict | None):
    """Writes config.json in one of the two formats found in the wild."""
    file = directory / "config.json"
    config = json.loads(file.read_text())
    config.pop("rope_parameters", None)
    config.pop("rope_theta", None)
    config.pop("rope_scaling", None)
    if fmt == "old_keys":  # transformers 4: top-level rope_theta and rope_scaling.
        config["rope_theta"] = theta
        if scaling is not None:
            config["rope_scaling"] = dict(scaling)
    else:  # transformers 5: everything in rope_parameters.
        config["rope_parameters"] = {"rope_type": "default", **(scaling or {}),
                                     "rope_theta": theta}
    file.write_text(json.dumps(config, indent=2))
    return config


def _hf_checkpoint(hf, directory: pathlib.Path, name: str, *, dtype="float32", **save_kw):
    """A tiny random LlamaForCausalLM saved in ``directory``; returns transformers' own
    model loaded back from that directory (so the reference reads the same files)."""
    torch, transformers = hf
    overrides, theta, scaling, fmt = PARITY_CASES[name]
    config = transformers.LlamaConfig(**BASE, **overrides)
    torch.manual_seed(sorted(PARITY_CASES).index(name))
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # Weights large enough that the logits are far from uniform.
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25 if p.ndim > 1 else 0.1)
    model.to(getattr(torch, dtype)).save_pretrained(directory, **save_kw)
    _rewrite_config(directory, fmt, theta, scaling)
    ref = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


PROMPTS = [[3, 17, 99, 4, 56], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [120, 7, 64]]


@pytest.mark.parametrize("name", sorted(PARITY_CASES))
def test_parity_with_transformers(hf, tmp_path, name):
    ref = _hf_checkpoint(hf, tmp_path, name)
    model = llama.from_pretrained(tmp_path)
    overrides, theta, scaling, _ = PARITY_CASES[name]
    assert model.config.rope_theta == theta
    assert model.config.rope_scaling == fj.RopeScaling.from_hf(scaling)
    assert model.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)

    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, 40)).astype(np.int32)
    expected = hf_logits(ref, tokens)
    logits = forge_logits(model, tokens)
    assert logits.dtype == np.float32 and logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0  # not near-uniform logits

    got = llama.generate(model, PROMPTS, 8, eos_token_id=())  # ref's eos is off too
    assert got == [hf_greedy(ref, p, 8) for p in PROMPTS]


def test_parity_catches_wrong_rope_scaling(hf, tmp_path):
    """Negative control: the same weights with the scaling dropped must fail the tolerance."""
    ref = _hf_checkpoint(hf, tmp_path, "llama3_old_keys")
    model = llama.from_pretrained(tmp_path)
    unscaled = llama.Llama(dataclasses.replace(model.config, rope_scaling=None), rngs=nnx.Rngs(0))
    nnx.update(unscaled, nnx.state(model))
    tokens = np.arange(40, dtype=np.int32)[None] % BASE["vocab_size"]
    expected = hf_logits(ref, tokens)
    wrong = forge_logits(unscaled, tokens)
    assert np.abs(wrong - expected).max() > 100 * LOGITS_TOL.atol


def test_greedy_stops_at_eos_like_transformers(hf, tmp_path):
    ref = _hf_checkpoint(hf, tmp_path, "gqa_tied")
    model = llama.from_pretrained(tmp_path)
    free = hf_greedy(ref, PROMPTS[1], 10)
    eos = free[3]  # a token the greedy continuation produces mid-way
    expected = [hf_greedy(ref, p, 10, eos=eos) for p in PROMPTS]
    assert expected[1] == free[:free.index(eos) + 1]  # transformers keeps the eos token
    assert llama.generate(model, PROMPTS, 10, eos_token_id=eos) == expected


def test_sharded_checkpoint(hf, tmp_path):
    ref = _hf_checkpoint(hf, tmp_path, "mqa_head_dim_biases", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = llama.from_pretrained(tmp_path)
    tokens = np.random.default_rng(1).integers(0, BASE["vocab_size"], (1, 24)).astype(np.int32)
    np.testing.assert_allclose(forge_logits(model, tokens),
                               hf_logits(ref, tokens), **LOGITS_TOL.as_kwargs())


def test_bfloat16_checkpoint(hf, tmp_path):
    """bfloat16 tensors load (safetensors + ml_dtypes), upcast exactly to float32 params."""
    ref = _hf_checkpoint(hf, tmp_path, "gqa_tied", dtype="bfloat16")
    assert "BF16" in (tmp_path / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    tokens = np.random.default_rng(2).integers(0, BASE["vocab_size"], (2, 16)).astype(np.int32)
    expected = hf_logits(ref, tokens)  # transformers upcast the same bf16 values
    model = llama.from_pretrained(tmp_path)
    np.testing.assert_allclose(forge_logits(model, tokens), expected,
                               **LOGITS_TOL.as_kwargs())
    model16 = llama.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert model16.embed_tokens[...].dtype == jnp.bfloat16
    logits16 = forge_logits(model16, tokens)
    assert logits16.dtype == np.float32
    # bfloat16 activations: ~3 significant digits per op.
    assert np.abs(logits16 - expected).max() < 0.05 * np.abs(expected).max()
    assert all(len(r) == 4 for r in llama.generate(model16, PROMPTS, 4))  # bf16 cache path
    # bfloat16 storage with float32 compute: the upcast is exact, so float32 results.
    mixed = llama.from_pretrained(tmp_path, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    assert mixed.layers[0].mlp.gate_up_proj.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(forge_logits(mixed, tokens), expected, **LOGITS_TOL.as_kwargs())


# ---------------------------------------------------------------------------------------
# Config parsing and loading errors (no torch needed)


def _config_dict(**overrides):
    config = dict(BASE, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
                  model_type="llama", hidden_act="silu", tie_word_embeddings=False,
                  rope_theta=10000.0, torch_dtype="float32", initializer_range=0.02)
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


def _write_checkpoint(directory: pathlib.Path, config: dict, tensors: dict | None = None):
    """A checkpoint written with safetensors alone, from a random-init model."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is None:
        model = llama.Llama(llama.LlamaConfig.from_hf(config), rngs=nnx.Rngs(0))
        tensors = {name: np.ascontiguousarray(value)
                   for name, value in llama.hf_state_dict(model).items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def test_config_formats_agree():
    old = llama.LlamaConfig.from_hf(_config_dict(rope_theta=500000.0, rope_scaling=LLAMA3))
    new = llama.LlamaConfig.from_hf(_config_dict(
        rope_theta=None, rope_parameters={**LLAMA3, "rope_theta": 500000.0}))
    assert old == new
    assert old.rope_scaling == fj.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert old.head_dim == 16 and old.num_key_value_heads == 2
    default = llama.LlamaConfig.from_hf(_config_dict(
        rope_theta=None, num_key_value_heads=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert default.rope_scaling is None and default.rope_theta == 1e6
    assert default.num_key_value_heads == 4
    assert llama.LlamaConfig.from_hf(_config_dict(eos_token_id=[7, 9])).eos_token_ids == (7, 9)


@pytest.mark.parametrize("overrides, match", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "gpt2"),
    (dict(architectures=["MistralForCausalLM"]), "MistralForCausalLM"),  # != model_type
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    # YaRN and dynamic NTK are read (tests/test_rope_scaling.py); a kind forge_jax does not
    # implement, or a key of a known kind it does not read, is refused naming it.
    (dict(rope_scaling={"rope_type": "mrope", "factor": 4.0}), "mrope"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fastest": 8}),
     "beta_fastest"),
    (dict(rope_theta=None, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "longrope"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(pretraining_tp=2), "pretraining_tp"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_unsupported_config_is_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        llama.LlamaConfig.from_hf(_config_dict(**overrides))
    (tmp_path / "config.json").write_text(json.dumps(_config_dict(**overrides)))
    with pytest.raises(llama.CheckpointError, match=match):
        llama.from_pretrained(tmp_path)


def test_loads_a_checkpoint_written_by_safetensors(tmp_path):
    tensors = _write_checkpoint(tmp_path, _config_dict())
    model = llama.from_pretrained(tmp_path)
    qkv = model.layers[1].self_attn.qkv_proj
    c = model.config  # one device: the fused rows are [q | k | v]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    np.testing.assert_array_equal(
        np.asarray(qkv.kernel[...])[q:q + kv],
        qkv.kernel_from_hf(tensors["model.layers.1.self_attn.k_proj.weight"]))
    assert llama.hf_state_dict(model).keys() == tensors.keys()
    for name, value in llama.hf_state_dict(model).items():  # export is load's inverse
        np.testing.assert_array_equal(value, tensors[name])


def _mutated_checkpoint(tmp_path, mutate):
    tensors = _write_checkpoint(tmp_path, _config_dict())
    mutate(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_missing_tensor(tmp_path):
    _mutated_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(llama.CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.up_proj"):
        llama.from_pretrained(tmp_path)


def test_missing_lm_head_when_untied(tmp_path):
    _mutated_checkpoint(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(llama.CheckpointError, match=r"missing.*lm_head\.weight"):
        llama.from_pretrained(tmp_path)


def test_misshaped_tensor(tmp_path):
    def mutate(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.ones((64, 64), np.float32)
    _mutated_checkpoint(tmp_path, mutate)
    name = r"model\.layers\.0\.self_attn\.k_proj\.weight"
    with pytest.raises(llama.CheckpointError, match=name + r".*\(64, 64\).*\(32, 64\)"):
        llama.from_pretrained(tmp_path)


def test_unexpected_tensor(tmp_path):
    def mutate(t):
        t["model.layers.0.self_attn.q_norm.weight"] = np.ones((16,), np.float32)
    _mutated_checkpoint(tmp_path, mutate)
    with pytest.raises(llama.CheckpointError, match=r"unexpected.*q_norm"):
        llama.from_pretrained(tmp_path)


def test_rotary_buffers_and_tied_head_are_ignored(tmp_path):
    config = _config_dict(tie_word_embeddings=True)
    tensors = _write_checkpoint(tmp_path, config)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((8,), np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = llama.from_pretrained(tmp_path)
    assert model.lm_head is None


def test_sharded_index_naming_a_missing_shard(tmp_path):
    _write_checkpoint(tmp_path, _config_dict())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in tensors}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(llama.CheckpointError, match="model-00002-of-00002.safetensors"):
        llama.from_pretrained(tmp_path)


def test_bad_directories(tmp_path):
    with pytest.raises(llama.CheckpointError, match="does not exist"):
        llama.from_pretrained(tmp_path / "nope")
    with pytest.raises(llama.CheckpointError, match="no config.json"):
        llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_config_dict()))
    with pytest.raises(llama.CheckpointError, match="neither model.safetensors"):
        llama.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(llama.CheckpointError, match="pickle"):
        llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(llama.CheckpointError, match="not valid JSON"):
        llama.from_pretrained(tmp_path)


def test_model_call_shapes_and_validation():
    model = llama.Llama(llama.LlamaConfig.from_hf(_config_dict()), rngs=nnx.Rngs(0))
    logits = forge_logits(model, np.zeros((2, 5), np.int32))
    assert logits.shape == (2, 5, BASE["vocab_size"]) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(jnp.zeros((5,), jnp.int32))
    with pytest.raises(TypeError, match="int"):
        model(jnp.zeros((1, 5), jnp.float32))


def test_layers_are_separate_modules():
    """Per-layer weights, not stacked [layers, ...] arrays (a per-step copy on CPU)."""
    model = llama.Llama(llama.LlamaConfig.from_hf(_config_dict()), rngs=nnx.Rngs(0))
    assert len(model.layers) == BASE["num_hidden_layers"]
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.kernel[...].shape == gate_up.kernel_from_hf(np.zeros(gate_up.hf_shape())).shape
    assert (gate_up.in_features, gate_up.out_features) == (64, 2 * 128)
    assert model.layers[0].mlp.gate_up_proj is not model.layers[1].mlp.gate_up_proj
