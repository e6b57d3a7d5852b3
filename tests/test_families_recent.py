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

import jax.numpy as jnp
import numpy as np
import pytest
from cases import hf_families
from cases.hf_families import LOGITS_TOL, forge_logits, hf_greedy, hf_logits, save_checkpoint
from flax import nnx

import forge_jax as fj
from forge_jax.generation import generate
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama
from forge_jax.serving import engine as serving
from forge_jax.text import api as text

SEQ = 24  # longer than every window and every original context below


def _no_attention_factor(config):
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(
        config.rope_scaling, attention_factor=1.0))


def _without_sinks(config):
    # the sinks at -inf: a softmax without them (the config keeps its parameters)
    return config, lambda model: [layer.self_attn.sinks.set_value(
        jnp.full_like(layer.self_attn.sinks[...], -1e30)) for layer in model.layers]


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
    # gpt-oss at gpt-oss's proportions scaled down: 8 query / 2 KV heads of 16, even
    # layers sliding (window 6), 6 experts top-2, YaRN past an original context of 8, a
    # SwiGLU limit the random activations reach.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                     intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                     sliding_window=6, swiglu_limit=1.5, pad_token_id=0,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                                      "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 8,
                                      "rope_theta": 1000.0}),
                "gpt_oss", {"attention_sinks": _without_sinks,
                            "swiglu_limit": lambda c: dataclasses.replace(c, swiglu_limit=1e6),
                            "sliding_window": lambda c: dataclasses.replace(
                                c, sliding_window=None, layer_types=None)}),
    # Llama 4 at Llama 4's proportions scaled down: 10 query / 2 KV heads of 16, NoPE every
    # 2nd layer, chunks of 5 on the RoPE layers, temperature tuning that bites (floor 3),
    # MoE on every 2nd layer (4 experts top-1, a shared expert), dense layers of their own
    # width.
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    dict(hidden_size=80, num_attention_heads=10, num_key_value_heads=2,
                         head_dim=16, intermediate_size=24, intermediate_size_mlp=40,
                         num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=4,
                         interleave_moe_layer_step=2, no_rope_layer_interval=2,
                         attention_chunk_size=5, floor_scale=3, attn_scale=0.5,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
                    "llama4_text",
                    {"attention_chunk_size": lambda c: dataclasses.replace(
                        c, attention_chunk_size=None),
                     "qk_l2_norm": lambda c: dataclasses.replace(c, qk_l2_norm=False),
                     "attn_temperature_tuning": lambda c: dataclasses.replace(
                         c, attn_temperature_tuning=False),
                     "rope_interleaved": lambda c: dataclasses.replace(
                         c, rope_interleaved=False)}),
}
BASE = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5)


@functools.cache
def _checkpoint(name: str, root: pathlib.Path, tokenizer: pathlib.Path, vocab: int):
    config_cls, model_cls, kwargs, _, _ = CASES[name]
    directory = root / name
    ref = save_checkpoint(directory, config_cls, model_cls,
                          {"vocab_size": vocab, **BASE, **kwargs},
                          seed=20 + sorted(CASES).index(name), tokenizer=tokenizer,
                          stds={"sinks": 1.5})
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
        changed = without(model.config)
        changed, edit = changed if isinstance(changed, tuple) else (changed, None)
        wrong = _with_config(model, changed)
        if edit is not None:
            edit(wrong)
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


def test_gpt_oss_mxfp4_checkpoint_loads_as_shipped(checkpoints, tmp_path):
    """An MXFP4 gpt-oss checkpoint (the float one's experts quantized, written as gpt-oss
    ships them: ``*_blocks`` / ``*_scales`` and a ``quantization_config``) loads with
    MXFP4 experts; its logits and greedy tokens are transformers' with the experts
    decoded by transformers' own MXFP4 reader."""
    import json
    import shutil

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory, ref, vocab = checkpoints("gpt_oss")
    target = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(directory, target)
    tensors = load_file(str(directory / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = np.swapaxes(tensors.pop(name), 1, 2)  # HF [E, in, out] -> [E, out, in]
        q = fj.quantize(jnp.asarray(w), "mxfp4")
        e, n, k = w.shape
        tensors[name + "_blocks"] = np.asarray(q.values).reshape(e, n, k // 32, 16)
        tensors[name + "_scales"] = np.asarray(q.scales)
        with torch.no_grad():  # the reference reads transformers' decoding of the bytes
            param = ref.get_parameter(name)
            param.copy_(convert_moe_packed_tensors(
                torch.from_numpy(tensors[name + "_blocks"]),
                torch.from_numpy(tensors[name + "_scales"]), dtype=torch.float32))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (target / "config.json").write_text(json.dumps(config))
    try:
        model = llama.from_pretrained(target)
        w = model.layers[0].mlp.gate_up.get_value()
        assert isinstance(w, fj.QuantizedArray) and w.format == "mxfp4"
        assert w.shape == (6, 64, 64) and w.values.dtype == jnp.uint8
        tokens = _tokens(vocab, seed=5)
        np.testing.assert_allclose(forge_logits(model, tokens), hf_logits(ref, tokens),
                                   **LOGITS_TOL.as_kwargs())
        prompts = [tokens[0, :12].tolist()]
        want = [hf_greedy(ref, prompts[0], 4)]
        got = generate(model, prompts, 4, eos_token_id=(), cache=CacheSpec(page_size=4))
        assert got == want
        # Over dp=2 x tp=2: the MXFP4 experts split by expert (3 of 6 a device, the scales
        # with their blocks), multiplied per shard.
        sharded = llama.from_pretrained(target, mesh=fj.sharding.make_mesh("dp=2,tp=2"))
        w = sharded.layers[0].mlp.gate_up.get_value()
        assert isinstance(w, fj.QuantizedArray) and w.spec[0] == "tp"
        assert {s.data.shape for s in w.values.addressable_shards} == {(3, 64, 32)}
        assert {s.data.shape for s in w.scales.addressable_shards} == {(3, 64, 2)}
        np.testing.assert_allclose(forge_logits(sharded, tokens), hf_logits(ref, tokens),
                                   **LOGITS_TOL.as_kwargs())
        for kind in ("paged", "contiguous"):
            spec = CacheSpec(kind=kind, page_size=4)
            assert generate(sharded, prompts, 4, eos_token_id=(), cache=spec) == want, kind
    finally:  # the float reference back for the other tests
        _checkpoint.cache_clear()


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text"])
def test_on_a_mesh_matches_transformers(checkpoints, name):
    """Over tp=2 (attention heads, sinks and dense MLPs split; the experts split by expert,
    gpt-oss's biases with them, as Mixtral's): transformers' greedy tokens with both
    caches."""
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory, mesh=fj.sharding.make_mesh("tp=2"))
    moe = model.layers[-1].mlp
    experts = moe.down.shape[0]
    assert {s.data.shape[0] for s in moe.down[...].addressable_shards} == {experts // 2}
    assert {s.data.shape[0] for s in moe.gate_up[...].addressable_shards} == {experts // 2}
    if name == "gpt_oss":
        assert {s.data.shape for s in moe.gate_up_bias[...].addressable_shards} == {
            (experts // 2, moe.gate_up.shape[2])}
    prompts = [_tokens(vocab, seed=6)[0, :12].tolist()]
    want = [hf_greedy(ref, prompts[0], 4)]
    for kind in ("paged", "contiguous"):
        spec = CacheSpec(kind=kind, page_size=4)
        assert generate(model, prompts, 4, eos_token_id=(), cache=spec) == want, kind


@pytest.mark.parametrize("name", ["gpt_oss", "llama4_text"])
def test_quantize_at_load_quantizes_the_experts(checkpoints, name):
    """quantize='int8': the linear layers and the stacked experts int8 (scales per expert
    and output channel), the routers float; logits within float32 tolerance of the float
    model holding the dequantized weights."""
    from forge_jax.models.checkpoints import quantize as quantize_load

    directory, _, vocab = checkpoints(name)
    model = llama.from_pretrained(directory, dtype=jnp.float32, quantize="int8")
    experts = quantize_load.expert_kernels(model)
    assert experts and all(isinstance(w.get_value(), fj.QuantizedArray) for w in experts)
    assert not isinstance(model.layers[-1].mlp.router.get_value(), fj.QuantizedArray)
    reference = llama.from_pretrained(directory, dtype=jnp.float32)
    for mine, q in zip(quantize_load.linear_kernels(reference),
                       quantize_load.linear_kernels(model), strict=True):
        mine.set_value(fj.dequantize(q.get_value()))
    change = 0.0
    for mine, q in zip(quantize_load.expert_kernels(reference), experts, strict=True):
        w = jnp.swapaxes(fj.dequantize(q.get_value()), 1, 2)  # [E, in, out]
        change = max(change, float(jnp.abs(w - mine.get_value()).max()))
        mine.set_value(w)
    assert change > 1e-4  # the reference is not the float model
    tokens = _tokens(vocab, seed=7)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(reference, tokens),
                               **LOGITS_TOL.as_kwargs())
