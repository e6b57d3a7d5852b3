"""Gemma 4 text (``gemma4_text``) against Hugging Face transformers.

Checkpoints written by transformers itself at a tiny size with every option the family's
config turns on: sliding layers of head_dim 16 and full layers of 32 (with their own KV
head count, ``attention_k_eq_v``), proportional partial RoPE on the full layers, a window
shorter than the prompts, the last layers sharing an earlier layer's keys and values with
double-wide MLPs, per-layer input embeddings, the mixture of experts beside the dense MLP,
final logit softcapping; and a dense variant (``v_proj`` on the full layers, no sharing,
no per-layer inputs, an untied output head, biases). Norms, router scales and layer
scalars are away from 1. Logits must match transformers' within the float32 tolerance,
greedy continuations be identical with both caches and through the serving engine, and
negative controls show each feature changes the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.hf_families import LOGITS_TOL, forge_logits, hf_greedy, hf_logits, save_checkpoint
from flax import nnx

import forge_jax as fj
from forge_jax.generation import generate
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama
from forge_jax.models.gemma4 import Gemma4
from forge_jax.models.gemma4_config import HANDLED, IRRELEVANT, REFUSED, Gemma4Config
from forge_jax.serving import engine as serving
from forge_jax.text import api as text

SEQ = 24  # longer than the window
S, F = "sliding_attention", "full_attention"
ROPE = {S: {"rope_type": "default", "rope_theta": 100.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0}}
BASE = dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=6, final_logit_softcapping=30.0,
            max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, rope_parameters=ROPE)
CASES = {
    # everything on: 5 layers, the last 2 reading layers 2 (sliding) and 1 (full)
    "all_options": dict(num_hidden_layers=5, layer_types=[S, F, S, S, F],
                        num_global_key_value_heads=1, attention_k_eq_v=True,
                        num_kv_shared_layers=2, use_double_wide_mlp=True,
                        hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=4,
                        top_k_experts=2, moe_intermediate_size=16),
    "dense": dict(num_hidden_layers=4, layer_types=[S, S, F, F], hidden_size_per_layer_input=0,
                  attention_bias=True, tie_word_embeddings=False),
}


@functools.cache
def _checkpoint(name: str, root: pathlib.Path, tokenizer: pathlib.Path, vocab: int):
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    directory = root / name
    kwargs = dict(BASE, vocab_size=vocab, vocab_size_per_layer_input=vocab, **CASES[name])
    save_checkpoint(directory, "Gemma4TextConfig", "Gemma4ForCausalLM", kwargs,
                    seed=40 + sorted(CASES).index(name), tokenizer=tokenizer,
                    stds={"router.scale": 3.0, "per_expert_scale": 1.0})
    # The layer scalars (buffers, which save_checkpoint leaves at 1) away from 1 too.
    tensors = load_file(str(directory / "model.safetensors"))
    rng = np.random.default_rng(7)
    for key in [k for k in tensors if k.endswith("layer_scalar")]:
        tensors[key] = rng.uniform(0.5, 1.5, tensors[key].shape).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    ref = transformers.Gemma4ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return directory, ref


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("gemma4")
    tok_dir, vocab = tokenizer_files
    return lambda name: _checkpoint(name, root, tok_dir, vocab) + (vocab,)


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ)).astype(np.int32)


def _with_config(model, config):
    """A model of ``config`` holding ``model``'s weights."""
    wrong = Gemma4(config, rngs=nnx.Rngs(0))
    nnx.update(wrong, nnx.state(model))
    return wrong


def _engine_tokens(model, directory, prompts, max_tokens):
    engine = serving.Engine(model, text.load_tokenizer(directory), serving.EngineConfig(
        max_batch_tokens=16, min_batch_tokens=8, num_pages=32, eos_token_ids=(),
        cache=CacheSpec(page_size=4)))
    streams = [engine.submit(p, serving.RequestParams(max_tokens=max_tokens)) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.result()[0] for s in streams]


def _unit_layer_scalars(model):
    for layer in model.layers:
        layer.layer_scalar.set_value(jnp.ones_like(layer.layer_scalar[...]))


NEGATIVE = {  # name -> the config without the feature (and an edit of the weights)
    "final_logit_softcapping": lambda c: dataclasses.replace(c, final_logit_softcapping=None),
    "proportional rope": lambda c: dataclasses.replace(c, rope_full=(c.rope_full[0], None)),
    "sliding_window": lambda c: dataclasses.replace(c, sliding_window=1000),
    "layer_scalar": lambda c: (c, _unit_layer_scalars),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gemma4_matches_transformers(checkpoints, name):
    directory, ref, vocab = checkpoints(name)
    model = llama.from_pretrained(directory)
    assert isinstance(model, Gemma4) and model.config.model_type == "gemma4_text"
    c = model.config
    assert (c.head_dim, c.global_head_dim) == (16, 32)
    tokens = _tokens(vocab)
    expected = hf_logits(ref, tokens)
    np.testing.assert_allclose(forge_logits(model, tokens), expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0  # not near-uniform logits

    for field, without in NEGATIVE.items():
        changed = without(model.config)
        changed, edit = changed if isinstance(changed, tuple) else (changed, None)
        wrong = _with_config(model, changed)
        if edit is not None:
            edit(wrong)
        miss = np.abs(forge_logits(wrong, tokens) - expected).max()
        assert miss > 50 * LOGITS_TOL.atol, (field, miss)

    # Prompts past the window; decode steps slide too.
    prompts = [tokens[0, :13].tolist(), tokens[1, :11].tolist()]
    want = [hf_greedy(ref, p, 6) for p in prompts]
    for kind in ("paged", "contiguous"):
        spec = CacheSpec(kind=kind, page_size=4)
        assert generate(model, prompts, 6, eos_token_id=(), cache=spec) == want, kind
    assert _engine_tokens(model, directory, prompts, 6) == want


def test_the_cache_holds_the_wider_width_and_no_shared_layer(checkpoints):
    """The all-options model's cache: 3 slots (layers 3 and 4 read 2 and 1), 2 KV heads
    (the sliding layers'; the full layers' one head repeated) of 32 (the full layers'
    width; the sliding layers' 16 zero-padded)."""
    directory, _, _ = checkpoints("all_options")
    config = llama.from_pretrained(directory).config
    assert config.kv_cache_geometry == (3, 2, 32)
    assert [config.kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]
    assert fj.kv_cache.cache_geometry(config) == {"num_layers": 3, "head_dim": 32}


def test_quantize_at_load_quantizes_linear_layers_and_experts(checkpoints):
    """quantize='int8': the linear layers and the stacked experts int8, the routers float;
    logits within float32 tolerance of the float model holding the dequantized weights."""
    from forge_jax.models.checkpoints import quantize as quantize_load

    directory, _, vocab = checkpoints("all_options")
    model = llama.from_pretrained(directory, dtype=jnp.float32, quantize="int8")
    experts = quantize_load.expert_kernels(model)
    assert len(experts) == 10
    assert all(isinstance(w.get_value(), fj.QuantizedArray) for w in experts)
    assert not isinstance(model.layers[0].moe.router.get_value(), fj.QuantizedArray)
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


def test_every_config_field_is_handled_irrelevant_or_refused(hf):
    _, transformers = hf
    fields = set(transformers.Gemma4TextConfig().to_dict())
    assert sorted(fields - HANDLED - IRRELEVANT - set(REFUSED)) == []


def _raw(hf, **changes):
    _, transformers = hf
    raw = transformers.Gemma4TextConfig(**dict(BASE, vocab_size=64, num_hidden_layers=2,
                                               layer_types=[S, F])).to_dict()
    raw.update(changes)
    return raw


def test_the_config_reads_transformers_defaults_and_refuses_naming_the_key(hf):
    config = Gemma4Config.from_hf(_raw(hf))
    assert config.layer_types == (S, F) and config.global_head_dim == 32
    assert config.rope_full[1].kind == "proportional"
    assert config.rope_full[1].partial_rotary_factor == 0.5 and config.rope_sliding[1] is None
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        Gemma4Config.from_hf(_raw(hf, use_bidirectional_attention="all"))
    with pytest.raises(ValueError, match=r"unsupported gemma4_text config keys \['new_key'\]"):
        Gemma4Config.from_hf(_raw(hf, new_key=1))
    with pytest.raises(ValueError, match="hidden_activation='silu'"):
        Gemma4Config.from_hf(_raw(hf, hidden_activation="silu"))
    with pytest.raises(ValueError, match=r"per_layer_config\['1'\]"):
        Gemma4Config.from_hf(_raw(hf, per_layer_config={"1": {"head_dim": 32, "x": 1}}))
    with pytest.raises(ValueError, match="num_kv_shared_layers=1: a shared layer's type"):
        Gemma4Config.from_hf(_raw(hf, num_kv_shared_layers=1))


def test_a_multimodal_checkpoint_loads_its_language_model(hf, tmp_path, tokenizer_files):
    """A ``gemma4`` checkpoint (``Gemma4ForConditionalGeneration``: vision and audio towers
    beside the language model, whose tensors are under ``model.language_model.``) loads
    its language model; logits and greedy tokens of text prompts are transformers'."""
    tok_dir, vocab = tokenizer_files
    text_config = dict(BASE, vocab_size=vocab, vocab_size_per_layer_input=vocab,
                       **CASES["all_options"])
    kwargs = dict(text_config=text_config,
                  vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=16),
                  audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    output_proj_dims=32, subsampling_conv_channels=[8, 4]))
    ref = save_checkpoint(tmp_path, "Gemma4Config", "Gemma4ForConditionalGeneration", kwargs,
                          seed=44, tokenizer=tok_dir, stds={"router.scale": 3.0})
    model = llama.from_pretrained(tmp_path)
    assert isinstance(model, Gemma4) and model.config.num_kv_shared_layers == 2
    assert llama.load_config(tmp_path) == model.config
    tokens = _tokens(vocab, seed=3)
    expected = hf_logits(ref, tokens)
    np.testing.assert_allclose(forge_logits(model, tokens), expected, **LOGITS_TOL.as_kwargs())
    assert np.abs(expected).max() > 1.0
    prompts = [tokens[0, :13].tolist()]
    want = [hf_greedy(ref, prompts[0], 4)]
    assert generate(model, prompts, 4, eos_token_id=(), cache=CacheSpec(page_size=4)) == want


def test_an_exported_program_generates_transformers_tokens(checkpoints, tmp_path):
    """The exported prefill and decode steps (a contiguous cache at the model's
    kv_cache_geometry) give transformers' greedy tokens, loaded without the model."""
    from forge_jax.generation import export, exported

    directory, ref, vocab = checkpoints("dense")
    export.export(llama.from_pretrained(directory), tmp_path / "program", context=32)
    program = exported.load(tmp_path / "program")
    prompt = _tokens(vocab, seed=4)[0, :13].tolist()
    assert program.generate([prompt], 5) == [hf_greedy(ref, prompt, 5)]


def test_hf_state_dict_gives_back_the_checkpoint(checkpoints):
    """``hf_state_dict`` of a loaded model holds every tensor of the file (the experts
    transposed back to HF's ``[E, out, in]``), equal to it."""
    from safetensors.numpy import load_file

    directory, _, _ = checkpoints("all_options")
    written = load_file(str(directory / "model.safetensors"))
    got = llama.hf_state_dict(llama.from_pretrained(directory, dtype=jnp.float32))
    assert set(got) == set(written) - {"lm_head.weight"}
    for name, value in written.items():
        if name in got:
            np.testing.assert_array_equal(got[name], value.astype(np.float32), err_msg=name)


# --------------------------------------------------------------------------------------
# On a mesh

@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "tp=4"])
def test_on_a_mesh_generates_the_unsharded_tokens(checkpoints, mesh):
    """All options over a 2x2 and a 1x4 mesh. tp=4: the cache's 2 KV heads each stored
    twice, the sliding layers' k/v projections (2 heads) replicated, one expert per device.
    Logits within float32 tolerance of the unsharded model's, greedy tokens through
    ``generate`` with both caches transformers' (as the unsharded model's,
    test_gemma4_matches_transformers); on 1 x 4 through the serving engine too, on 2 x 2 the
    dense model sharded in memory (``gemma4_sharding.shard``)."""
    from forge_jax.models import gemma4_sharding

    directory, ref, vocab = checkpoints("all_options")
    one = llama.from_pretrained(directory)
    model = llama.from_pretrained(directory, mesh=fj.sharding.make_mesh(mesh))
    tp = model.mesh.tp
    assert model.kv_heads == max(2, tp) and model.layout.kv_repeat == max(1, tp // 2)
    layer = model.layers[1]  # a full layer: q 4 x 32 rows, the experts 4
    assert {s.data.shape for s in layer.self_attn.q_proj.kernel[...].addressable_shards} == {
        (4 * 32 // tp, 64)}
    assert {s.data.shape for s in layer.moe.down[...].addressable_shards} == {(4 // tp, 16, 64)}
    tokens = _tokens(vocab, seed=5)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(one, tokens),
                               **LOGITS_TOL.as_kwargs())
    prompts = [tokens[0, :13].tolist(), tokens[1, :11].tolist()]
    want = [hf_greedy(ref, p, 5) for p in prompts]
    for kind in ("paged", "contiguous"):
        spec = CacheSpec(kind=kind, page_size=4)
        assert generate(model, prompts, 5, eos_token_id=(), cache=spec) == want, (mesh, kind)
        cache = model.create_cache(spec, batch=2, max_len=32, num_pages=16,
                                   block_tables=np.zeros((2, 8), np.int32))
        assert model.cache_bytes(spec, batch=2, max_len=32, num_pages=16) == sum(
            s.data.nbytes for buf in (cache.k_pages + cache.v_pages if kind == "paged"
                                      else cache.k + cache.v)
            for s in buf.addressable_shards if s.device == jax.devices()[0])
    if tp == 4:  # the serving engine's packed steps over the sharded pool
        assert _engine_tokens(model, directory, prompts, 5) == want
    else:  # the dense model (biases, an untied head) sharded in memory: the same logits
        dense = llama.from_pretrained(checkpoints("dense")[0])
        sharded = gemma4_sharding.shard(dense, fj.sharding.make_mesh(mesh))
        np.testing.assert_allclose(forge_logits(sharded, tokens), forge_logits(dense, tokens),
                                   **LOGITS_TOL.as_kwargs())


def test_a_mesh_the_sizes_do_not_split_over_is_refused_with_the_numbers():
    from forge_jax.models import gemma4_sharding

    config = Gemma4Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=3,
                          head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                          layer_types=(S, F), sliding_window=4)
    assert gemma4_sharding.layout_for(config, 3).kv_repeat == 1
    assert gemma4_sharding.layout_for(dataclasses.replace(
        config, num_key_value_heads=2), 4).kv_repeat == 2
    with pytest.raises(ValueError, match=r"divide by 8: \{'num_attention_heads': 12\}"):
        gemma4_sharding.layout_for(config, 8)
    with pytest.raises(ValueError, match=r"holds 3 KV heads .* neither split over a tensor "
                                         r"axis of 4 devices nor divide it"):
        gemma4_sharding.layout_for(config, 4)
    with pytest.raises(ValueError, match=r"\{'num_experts': 3\}"):
        gemma4_sharding.layout_for(dataclasses.replace(
            config, num_experts=3, top_k_experts=1, moe_intermediate_size=8), 2)


def test_quantized_on_a_mesh_matches_one_device(checkpoints):
    """quantize='int8' over tp=2: the linear layers split with their scales, the experts by
    expert; logits within float32 tolerance of the same quantized model on one device."""
    directory, _, vocab = checkpoints("all_options")
    one = llama.from_pretrained(directory, quantize="int8")
    model = llama.from_pretrained(directory, quantize="int8", mesh=fj.sharding.make_mesh("tp=2"))
    w = model.layers[0].moe.gate_up.get_value()
    assert isinstance(w, fj.QuantizedArray) and w.spec[0] == "tp"
    assert {s.data.shape[0] for s in w.values.addressable_shards} == {2}
    tokens = _tokens(vocab, seed=6)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(one, tokens),
                               **LOGITS_TOL.as_kwargs())


def test_cli_generates_on_a_mesh(checkpoints, capsys):
    """``forge-jax generate --mesh dp=2,tp=2`` gives the unsharded model's tokens; a mesh the
    heads do not split over is one line naming the number, before the weights load."""
    import re

    from cases.cli import assert_one_line_error, run

    directory, _, vocab = checkpoints("all_options")
    prompt = _tokens(vocab, seed=8)[0, :9].tolist()
    want = generate(llama.from_pretrained(directory), [prompt], 4, eos_token_id=())[0]
    rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--prompt-ids",
                       ",".join(map(str, prompt)), "--max-new-tokens", "4", "--mesh", "dp=2,tp=2",
                       "--no-compilation-cache")
    assert rc == 0, err
    [line] = [ln for ln in out.splitlines() if ln.startswith("generated ids:")]
    assert [int(t) for t in re.findall(r"-?\d+", line.split(":", 1)[1])] == want
    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(directory), "--prompt-ids",
                              "1,2,3", "--mesh", "tp=8"), "'num_attention_heads': 4")
