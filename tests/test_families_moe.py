"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against Hugging Face
transformers: the one model with a :class:`~forge_jax.models.llama_moe.SparseMoe` MLP
(``fj.moe``: routing, ``fj.grouped_matmul`` over stacked experts) in its sparse layers.

Each checkpoint is written by transformers itself at a tiny size, with the fields that
matter away from their defaults: odd head counts, top-k of 2 or 3 among 6 or 8 experts
(a decode step of 2 sequences reaches at most 4 to 6 experts, so some are always empty),
renormalised and raw top-k weights, dense layers among the sparse ones
(``mlp_only_layers``, ``decoder_sparse_step``), Qwen2-MoE's shared expert, Mixtral's
window shorter than the prompt. Logits must match transformers' within the float32
tolerance and greedy continuations be identical with both caches; negative controls show
that the routing fields change the logits.
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

import forge_jax as fj
from forge_jax.models import llama, llama_sharding
from forge_jax.models.checkpoints import quantize as quantize_load

SEQ = 16
# family -> (transformers config class, causal LM class, config kwargs (over BASE), fields
# whose change must change the logits, the layers with the mixture of experts). Mixtral has
# one layer (no dense layers to mix in; each layer costs compile time).
CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=40, num_local_experts=8, num_experts_per_tok=2,
                     sliding_window=6, num_hidden_layers=1),
                {"norm_topk_prob": False}, (0,)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                       intermediate_size=40, moe_intermediate_size=24, num_experts=6,
                       num_experts_per_tok=3, shared_expert_intermediate_size=32,
                       decoder_sparse_step=2),
                  {"shared_expert_intermediate_size": None}, (1,)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                       intermediate_size=40, moe_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                       attention_bias=True),
                  {"norm_topk_prob": False}, (0,)),
}
BASE = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5)


@functools.cache
def _checkpoint(name: str, root: pathlib.Path, tokenizer: pathlib.Path, vocab: int,
                dtype: str = "float32"):
    config_cls, model_cls, kwargs, _, _ = CASES[name]
    directory = root / f"{name}-{dtype}"
    ref = save_checkpoint(directory, config_cls, model_cls,
                          {"vocab_size": vocab, **BASE, **kwargs},
                          seed=10 + sorted(CASES).index(name), dtype=dtype, tokenizer=tokenizer)
    return directory, ref


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("moe_families")
    tok_dir, vocab = tokenizer_files
    return lambda name, dtype="float32": _checkpoint(name, root, tok_dir, vocab, dtype) + (vocab,)


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


def _with_config(model, config):
    """A model of ``config`` holding ``model``'s weights (those it has)."""
    wrong = llama.Llama(config, rngs=nnx.Rngs(0))
    mine = {k for k, _ in nnx.to_flat_state(nnx.state(wrong))}
    nnx.update(wrong, nnx.from_flat_state(
        [(k, v) for k, v in nnx.to_flat_state(nnx.state(model)) if k in mine]))
    return wrong


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_family_matches_transformers(checkpoints, name):
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory)
    c = model.config
    assert c.model_type == name and c.num_experts > c.num_experts_per_tok > 0
    moe_layers = tuple(i for i in range(c.num_hidden_layers) if c.is_moe(i))
    assert moe_layers == CASES[name][4]
    # The memory estimate counts the experts (and the shared expert, the router).
    assert fj.memory.estimate_inference_memory(c, batch=1, max_len=1).weights == \
        quantize_load.parameter_bytes(model)

    tokens = _tokens(vocab)
    expected = hf_logits(ref, tokens)
    np.testing.assert_allclose(forge_logits(model, tokens), expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0  # not near-uniform logits

    # Negative controls: each routing field set otherwise misses transformers by far.
    for field, value in CASES[name][3].items():
        wrong = _with_config(model, dataclasses.replace(c, **{field: value}))
        miss = np.abs(forge_logits(wrong, tokens) - expected).max()
        assert miss > 50 * LOGITS_TOL.atol, (field, miss)

    prompts = [tokens[0, :9].tolist(), tokens[1, :5].tolist()]
    want = [hf_greedy(ref, p, 5) for p in prompts]
    for cache in ("paged", "contiguous"):
        got = llama.generate(model, prompts, 5, eos_token_id=(), cache=cache, page_size=4)
        assert got == want, cache


def test_bfloat16_within_bfloat16_tolerance(checkpoints):
    """A bfloat16 Qwen3-MoE checkpoint in bfloat16 compute: within bfloat16's tolerance of
    transformers' float32 run on the same (upcast) weights."""
    directory, ref, vocab = checkpoints("qwen3_moe", "bfloat16")
    model = llama.from_pretrained(directory, dtype=jnp.bfloat16)
    assert model.layers[0].mlp.w_gate[...].dtype == jnp.bfloat16
    tokens = _tokens(vocab, seed=2)
    expected = hf_logits(ref, tokens)
    logits = forge_logits(model, tokens)
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()


def test_expert_tensors_round_trip(checkpoints):
    """HF's per-expert [out, in] tensors (Mixtral's w1/w2/w3 under block_sparse_moe),
    stacked and transposed at load, export back as saved."""
    from safetensors.numpy import load_file

    directory, _, _ = checkpoints("mixtral")
    model = llama.from_pretrained(directory)
    assert model.layers[0].mlp.w_gate.shape == (8, 64, 40)  # [experts, hidden, width]
    saved = load_file(str(directory / "model.safetensors"))
    exported = llama.hf_state_dict(model)
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in exported
    assert set(exported) == set(saved)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, saved[name], err_msg=name)


# --------------------------------------------------------------------------------------
# On a mesh: experts split over the tensor axis

def test_experts_split_over_the_tensor_axis(checkpoints):
    """Mixtral over dp=2 x tp=4 (2 of the 8 experts per device, each KV head stored
    twice, the batch split): transformers' greedy tokens with both caches."""
    from forge_jax import sharding

    directory, ref, vocab = checkpoints("mixtral")
    prompts = [_tokens(vocab, seed=3)[0, :8].tolist(), _tokens(vocab, seed=3)[1, :4].tolist()]
    want = [hf_greedy(ref, p, 4) for p in prompts]
    model = llama.from_pretrained(directory, mesh=sharding.make_mesh("dp=2,tp=4"))
    w = model.layers[0].mlp.w_down[...]
    assert {s.data.shape for s in w.addressable_shards} == {(2, 40, 64)}  # 2 experts each
    for cache in ("paged", "contiguous"):
        assert llama.generate(model, prompts, 4, eos_token_id=(), cache=cache) == want, cache


def test_quantized_experts_split_over_the_tensor_axis(checkpoints):
    """Mixtral with int8 experts over tp=4: each device holds 2 of the 8 quantized experts
    with their scales; logits within float32 tolerance of the quantized model on one device,
    greedy tokens identical with both caches."""
    directory, _, vocab = checkpoints("mixtral")
    one = llama.from_pretrained(directory, quantize="int8")
    model = llama.from_pretrained(directory, quantize="int8", mesh=fj.sharding.make_mesh("tp=4"))
    w = model.layers[0].mlp.w_down.get_value()
    assert isinstance(w, fj.QuantizedArray) and w.spec[0] == "tp"
    assert {s.data.shape[0] for s in w.values.addressable_shards} == {2}
    assert {s.data.shape[0] for s in w.scales.addressable_shards} == {2}
    tokens = _tokens(vocab, seed=4)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(one, tokens),
                               **LOGITS_TOL.as_kwargs())
    prompts = [tokens[0, :8].tolist(), tokens[1, :5].tolist()]
    for cache in ("paged", "contiguous"):
        want = llama.generate(one, prompts, 4, eos_token_id=(), cache=cache)
        assert llama.generate(model, prompts, 4, eos_token_id=(), cache=cache) == want, cache


def test_experts_that_do_not_split_are_refused_with_the_numbers():
    config = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40,
                               num_hidden_layers=2, num_attention_heads=4, num_experts=6,
                               num_experts_per_tok=2, moe_intermediate_size=16)
    assert llama_sharding.layout_for(config, 2).groups == 2
    with pytest.raises(ValueError, match=r"num_experts=6 does not split over a tensor axis "
                                         r"of 4 devices"):
        llama_sharding.layout_for(config, 4)
    # Without dense layers, intermediate_size need not split.
    assert llama_sharding.layout_for(dataclasses.replace(config, intermediate_size=41), 2)


# --------------------------------------------------------------------------------------
# Config fields: each read, irrelevant or refused

@pytest.mark.parametrize("name", sorted(CASES))
def test_every_config_field_is_handled_irrelevant_or_refused(hf, name):
    assert hf_families.unknown_config_fields(hf[1], name, CASES[name][0]) == []


REFUSALS = {
    "qwen2_moe": ("use_sliding_window", True, "use_sliding_window=True"),
    "mixtral": ("layer_types", ["full_attention", "sliding_attention"], "layer_types="),
    "qwen3_moe": ("num_experts_per_tok", 9, "num_experts_per_tok=9 exceeds num_experts=8"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_unimplemented_settings_are_refused_by_name(hf, name):
    _, transformers = hf
    raw = getattr(transformers, CASES[name][0])(**{**BASE, **CASES[name][2]}).to_dict()
    raw["architectures"] = [CASES[name][1]]
    llama.LlamaConfig.from_hf(raw)  # the plain config reads
    key, value, words = REFUSALS[name]
    with pytest.raises(ValueError) as info:
        llama.LlamaConfig.from_hf(dict(raw, **{key: value}))
    message = str(info.value)
    assert len(message.splitlines()) == 1 and words in message, message


def test_expert_count_under_either_name(hf):
    """Qwen's files name the expert count num_experts, Mixtral's and transformers 5's
    num_local_experts: both read; two that disagree, or none, are refused."""
    _, transformers = hf
    raw = transformers.Qwen3MoeConfig(**{**BASE, **CASES["qwen3_moe"][2]}).to_dict()
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    count = raw.pop("num_local_experts")
    config = llama.LlamaConfig.from_hf(dict(raw, num_experts=count))
    assert config.num_experts == 8 and config.mlp_only_layers == (1,)
    assert config == llama.LlamaConfig.from_hf(dict(raw, num_local_experts=count))
    with pytest.raises(ValueError, match="two expert counts"):
        llama.LlamaConfig.from_hf(dict(raw, num_experts=count, num_local_experts=count + 1))
    with pytest.raises(ValueError, match="lacks num_experts"):
        llama.LlamaConfig.from_hf(raw)


def _dequantized(directory, quantized):
    """The float32 model of ``directory`` holding ``quantized``'s weights dequantized (the
    numbers the quantized model should compute with; a float reference, not itself), and
    the largest change quantization made to an expert weight."""
    model = llama.from_pretrained(directory, dtype=jnp.float32)
    for mine, q in zip(quantize_load.linear_kernels(model),
                       quantize_load.linear_kernels(quantized), strict=True):
        mine.set_value(fj.dequantize(q.get_value()))
    change = 0.0
    for mine, q in zip(quantize_load.expert_kernels(model),
                       quantize_load.expert_kernels(quantized), strict=True):
        w = jnp.swapaxes(fj.dequantize(q.get_value()), 1, 2)  # [E, in, out]
        change = max(change, float(jnp.abs(w - mine.get_value()).max()))
        mine.set_value(w)
    return model, change


# family -> (format, group size): int8 for Mixtral and Qwen3-MoE (logits and greedy
# tokens), int4 in groups of 8 for Qwen2-MoE (logits; with its shared expert).
QUANTIZED = {"mixtral": ("int8", None), "qwen3_moe": ("int8", None), "qwen2_moe": ("int4", 8)}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantize_at_load_quantizes_the_experts(checkpoints, name):
    """Experts stacked and quantized per expert, the router in float; logits within float32
    tolerance of the float model holding the dequantized weights and greedy tokens
    identical to its (teacher-forced) argmax; the experts' bytes within 5% of the format's
    ideal, and the memory estimate within 2% of the model's bytes."""
    directory, _, vocab = checkpoints(name)
    fmt, group = QUANTIZED[name]
    model = llama.from_pretrained(directory, dtype=jnp.float32, quantize=fmt, group_size=group)
    c = model.config
    mlp = model.layers[CASES[name][4][0]].mlp
    experts = [w.get_value() for w in quantize_load.expert_kernels(model)]
    e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
    assert [q.shape for q in experts[:3]] == [(e, f, d), (e, f, d), (e, d, f)]
    for q in experts:
        assert isinstance(q, fj.QuantizedArray) and q.format == fmt
        # Per expert and output channel (int8), or groups along the in axis (int4).
        assert q.scales.shape == q.shape[:2] + (q.shape[2] // (group or q.shape[2]),)
        ideal = q.shape[0] * q.shape[1] * q.shape[2] * fj.quant.bits_per_value(
            fmt, group_size=group, columns=q.shape[2]) / 8
        assert abs(q.nbytes - ideal) / ideal < 0.05, (q.nbytes, ideal)
    assert mlp.router.get_value().dtype == jnp.float32
    if mlp.shared_expert is not None:  # Qwen2-MoE: quantized like a dense MLP, gate float
        assert isinstance(mlp.shared_expert.down_proj.kernel.get_value(), fj.QuantizedArray)
        assert mlp.shared_expert_gate.get_value().dtype == jnp.float32
    # The memory estimate counts the quantized experts.
    measured = quantize_load.parameter_bytes(model)
    estimate = fj.memory.estimate_inference_memory(c, batch=1, max_len=1, quantize=fmt,
                                                   group_size=group).weights
    assert abs(estimate - measured) / measured < 0.02, (estimate, measured)

    reference, change = _dequantized(directory, model)
    assert change > 1e-4  # quantizing changed the experts: the reference is not the float model
    tokens = _tokens(vocab, seed=4)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(reference, tokens),
                               **LOGITS_TOL.as_kwargs())
    if fmt != "int8":
        return  # greedy decoding: Mixtral and Qwen3-MoE (each compiles the decode step)
    prompts = tokens[:, :SEQ - 4].tolist()
    got = np.asarray(llama.generate(model, prompts, 4, eos_token_id=(), cache="paged"))
    full = np.concatenate([np.asarray(prompts), got], axis=1)  # [2, SEQ]
    want = forge_logits(reference, full).argmax(-1)[:, SEQ - 5:SEQ - 1]
    np.testing.assert_array_equal(got, want)


def test_cli_group_size_must_divide_the_experts_in_features(checkpoints, capsys):
    directory, _, _ = checkpoints("qwen3_moe")  # hidden 48, dense width 40, expert width 24
    rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--quantize", "int4",
                       "--group-size", "16", "--prompt", "Hi", "--max-new-tokens", "1")
    assert rc != 0 and "--group-size 16 must be a positive even number dividing the layers' " \
        "in features [24, 40, 48]" in err, (out, err)


# --------------------------------------------------------------------------------------
# The command line

def test_cli_generates_text_with_every_moe_family(checkpoints, capsys):
    for name in sorted(CASES):
        directory, _, _ = checkpoints(name)
        layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
        rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--prompt",
                           "Hello there", "--max-new-tokens", "1", "--no-stream")
        assert rc == 0, (name, err)
        assert out.strip(), (name, out, err)
        assert f": {name}, {layers} layer" in out + err, (name, out, err)
        assert " experts (top " in out + err, (name, out, err)


def test_cli_generates_with_quantized_experts(checkpoints, capsys):
    directory, _, _ = checkpoints("qwen3_moe")
    rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--quantize", "int8",
                       "--prompt", "Hello there", "--max-new-tokens", "2", "--no-stream")
    assert rc == 0, err
    assert out.strip() and "int8 linear layers" in out + err, (out, err)
