"""DeepSeek-V3 (models/deepseek.py) against Hugging Face transformers on a random-weight
checkpoint transformers wrote: a query bottleneck (q_lora_rank), a dense first layer, routed
experts with sigmoid scores, a random e_score_correction_bias, group-limited top-k and
shared experts. Logits within float32 tolerance and greedy tokens identical, decoding through
the paged latent cache."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepSeek-V3", allow_module_level=True)

from cases.hf_families import hf_greedy, hf_logits  # noqa: E402

from forge_jax.models import deepseek  # noqa: E402

CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
              max_position_embeddings=256)


# DeepSeek-V3's YaRN (factor 40, mscale 1, mscale_all_dim 1, original context 4096),
# with a short original context so that the ramp lies inside the rotary dims.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=64, beta_fast=32, beta_slow=1)


def write_checkpoint(directory, yarn: bool):
    """A random-weight checkpoint transformers writes, and transformers' model of it."""
    torch.manual_seed(0)
    kwargs = dict(CONFIG, rope_parameters=YARN) if yarn else CONFIG
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25 if p.ndim > 1 else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice, not the weights
                b.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(directory,
                                                             dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return pathlib.Path(directory), ref


@pytest.fixture(scope="module", params=["default_rope", "yarn"])
def checkpoint(tmp_path_factory, request):
    return write_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), request.param == "yarn")


def test_config_reads_the_checkpoint(checkpoint):
    config = deepseek.load_config(checkpoint[0])
    assert (config.q_lora_rank, config.kv_lora_rank, config.first_k_dense_replace,
            config.n_group, config.topk_group) == (32, 32, 1, 4, 2)
    if config.rope_scaling is None:
        assert config.rope_interleave and config.scale == pytest.approx(24 ** -0.5)
    else:  # transformers' yarn_apply_mscale: (0.1 * ln(4) + 1) ** 2
        assert config.rope_scaling.kind == "yarn"
        assert config.scale == pytest.approx(24 ** -0.5 * (0.1 * np.log(4) + 1) ** 2)
        assert config.scale == pytest.approx(checkpoint[1].model.layers[0].self_attn.scaling)


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    directory, ref = checkpoint
    config, weights = deepseek.load(directory)
    prompts = np.random.default_rng(1).integers(2, CONFIG["vocab_size"], (2, 11))
    tokens, logits = deepseek.generate_greedy(config, weights, prompts, 8, page_size=4)
    want = hf_logits(ref, prompts)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-4)
    for b in range(2):
        assert tokens[b].tolist() == hf_greedy(ref, prompts[b].tolist(), 8)


def test_router_matches_transformers(checkpoint):
    directory, ref = checkpoint
    config, weights = deepseek.load(directory)
    x = np.random.default_rng(2).standard_normal((13, CONFIG["hidden_size"])).astype(np.float32)
    moe = weights["layers"][1]["moe"]
    w, ids = deepseek.route(x, moe["router"], moe["bias"], config)
    with torch.no_grad():
        _, hf_w, hf_ids = ref.model.layers[1].mlp.gate(torch.tensor(x))
    order, hf_order = np.argsort(np.asarray(ids), 1), np.argsort(hf_ids.numpy(), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                  np.take_along_axis(hf_ids.numpy(), hf_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(hf_w.numpy(), hf_order, 1), rtol=1e-5)


def test_an_unknown_rope_type_is_refused_with_the_reason():
    config = dict(CONFIG, model_type="deepseek_v3", rms_norm_eps=1e-6, norm_topk_prob=True,
                  rope_parameters=dict(rope_type="longrope", factor=4.0, rope_theta=1e4))
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        deepseek.DeepseekV3Config.from_hf(config)


def test_quantized_int8_weights_stay_close(checkpoint):
    import jax

    import forge_jax as fj

    directory, ref = checkpoint
    config, weights = deepseek.load(directory, quantize="int8")
    assert isinstance(weights["layers"][1]["moe"]["gate_proj"], fj.QuantizedArray)
    assert isinstance(weights["layers"][0]["attn"]["q_a_proj"], fj.QuantizedArray)
    prompts = np.random.default_rng(3).integers(2, CONFIG["vocab_size"], (1, 9))
    _, logits = deepseek.generate_greedy(config, weights, prompts, 1, page_size=4)
    # The quantized products equal float products of the dequantized weights...
    dequantized = jax.tree.map(
        lambda w: fj.dequantize(w) if isinstance(w, fj.QuantizedArray) else w, weights,
        is_leaf=lambda w: isinstance(w, fj.QuantizedArray))
    _, exact = deepseek.generate_greedy(config, dequantized, prompts, 1, page_size=4)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(exact), rtol=1e-4, atol=1e-4)
    # ...and stay near transformers' float logits (an expert choice may flip).
    want = hf_logits(ref, prompts)
    assert np.abs(np.asarray(logits) - want).mean() < 0.1 * want.std()


def test_the_llama_loader_hands_it_to_this_model(checkpoint):
    from forge_jax.models import llama
    from forge_jax.models.deepseek_config import DeepseekV3Config

    config = llama.load_config(checkpoint[0])  # its own config, as the CLI reads it
    assert isinstance(config, DeepseekV3Config) and config.n_routed_experts == 8
    model = llama.from_pretrained(checkpoint[0], dtype="float32")
    assert isinstance(model, deepseek.DeepseekV3)
    assert model.config.num_hidden_layers == CONFIG["num_hidden_layers"]
    assert model.config.max_position_embeddings == CONFIG["max_position_embeddings"]


# The runtime drives DeepSeek-V3 through the model contract (forge_jax.models.protocol):
# generate with each latent cache and the serving engine over the latent pool.

PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 2, 31, 7, 8], [11, 4, 90, 23, 6]]  # longer than a page


@pytest.fixture(scope="module")
def runtime_model(tmp_path_factory):
    # YaRN, q_lora_rank, groups, a dense first layer and shared experts: every part at once.
    directory, ref = write_checkpoint(tmp_path_factory.mktemp("deepseek_v3_yarn"), True)
    want = [hf_greedy(ref, p, 8) for p in PROMPTS]
    return deepseek.from_pretrained(directory), want, directory


def test_the_model_keeps_the_runtime_contract(runtime_model):
    from forge_jax.models.protocol import CausalLM, ModelConfig

    model, _, _ = runtime_model
    assert isinstance(model, CausalLM) and isinstance(model.config, ModelConfig)


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_generate_matches_transformers_with_each_latent_cache(runtime_model, kind):
    from forge_jax import generation
    from forge_jax.kv_cache import CacheSpec, ContiguousLatentCache, PagedLatentCache

    model, want, _ = runtime_model
    got, stats = generation.generate_with_stats(model, PROMPTS, 8, eos_token_id=(),
                                                cache=CacheSpec(kind, page_size=4))
    assert got == want
    cls = PagedLatentCache if kind == "paged" else ContiguousLatentCache
    # The cache holds one latent + RoPE key vector per token and layer, nothing per head.
    c = model.config
    slots = stats.padded_batch * (stats.cache_len if kind == "contiguous" else
                                  -(-stats.cache_len // 4) * 4)
    assert stats.cache_bytes == c.num_hidden_layers * slots * (
        c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert cls.__name__ in repr(model.create_cache(CacheSpec(kind, page_size=4), batch=1,
                                                   max_len=8, num_pages=2,
                                                   block_tables=np.zeros((1, 2), np.int32)))


def test_a_quantized_latent_cache_is_refused(runtime_model):
    from forge_jax.kv_cache import CacheSpec

    model, _, _ = runtime_model
    with pytest.raises(ValueError, match="kv_dtype='int8'.*latent"):
        model.create_cache(CacheSpec(kv_dtype="int8"), batch=1, max_len=8, num_pages=2,
                           block_tables=np.zeros((1, 2), np.int32))


def test_the_engine_matches_transformers_and_shares_latent_prefixes(runtime_model):
    from forge_jax.kv_cache import CacheSpec
    from forge_jax.serving import Engine, EngineConfig, RequestParams

    model, want, _ = runtime_model
    engine = Engine(model, None, EngineConfig(max_batch_tokens=16, num_pages=32,
                                              eos_token_ids=(), prefix_caching=True,
                                              cache=CacheSpec(page_size=4)))
    engine.start()
    try:
        params = RequestParams(max_tokens=8)
        streams = [engine.submit(p, params) for p in PROMPTS]
        got = [[t for out in s for t in out.token_ids] for s in streams]
        assert got == want
        # The same prompt again: its full pages come from the prefix cache (latent pages).
        again = engine.submit(PROMPTS[0], params)
        assert [t for out in again for t in out.token_ids] == want[0]
        assert engine.prefix_cache.stats.hit_tokens >= 8
    finally:
        engine.shutdown()


# 2x2 in the default run; 1x4 (every device on the tensor axis: one head and two experts
# each) with the slow tests.
@pytest.mark.parametrize("shape", [(2, 2), pytest.param((1, 4), marks=pytest.mark.slow)])
def test_the_engine_on_a_mesh_matches_transformers(runtime_model, shape):
    """The serving engine over a sharded model: the latent pool replicated (every head reads
    the one latent), the weights split by head and expert; greedy tokens equal transformers'
    (as the one-device engine's do), a repeated prompt served from the prefix cache."""
    import jax

    from forge_jax.kv_cache import CacheSpec
    from forge_jax.models import llama
    from forge_jax.serving import Engine, EngineConfig, RequestParams

    _, want, directory = runtime_model
    mesh = jax.make_mesh(shape, ("dp", "tp"), devices=jax.devices()[:4])
    model = llama.from_pretrained(directory, dtype="float32", mesh=mesh)
    engine = Engine(model, None, EngineConfig(max_batch_tokens=16, num_pages=32,
                                              eos_token_ids=(), prefix_caching=True,
                                              cache=CacheSpec(page_size=4)))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(engine.cache))
    engine.start()
    try:
        params = RequestParams(max_tokens=8)
        streams = [engine.submit(p, params) for p in PROMPTS]
        assert [[t for out in s for t in out.token_ids] for s in streams] == want
        again = engine.submit(PROMPTS[0], params)
        assert [t for out in again for t in out.token_ids] == want[0]
        assert engine.prefix_cache.stats.hit_tokens >= 8
    finally:
        engine.shutdown()
    assert model.arrays()["layers"][1]["moe"]["gate_proj"].sharding.spec[0] == "tp"


def write_fp8_checkpoint(source: pathlib.Path, directory: pathlib.Path) -> dict:
    """DeepSeek's FP8 release layout of ``source``: every linear weight of the layers but the
    router as float8_e4m3fn with 128 x 128 ``weight_scale_inv`` blocks, the rest as stored.
    Returns the float64 weights the file stands for."""
    import json
    import shutil

    from cases import quant as quant_ref
    from safetensors.torch import load_file, save_file

    tensors, reference = {}, {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        w = t.float().numpy()
        if w.ndim == 2 and name.startswith("model.layers.") and ".mlp.gate." not in name:
            tensors[name], tensors[name + "_scale_inv"], reference[name] = \
                quant_ref.fp8_blocks(w)
        else:
            tensors[name], reference[name] = t, w.astype(np.float64)
    directory.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
        weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", directory)
    save_file(tensors, str(directory / "model.safetensors"))
    return reference


def test_an_fp8_checkpoint_loads_as_stored_and_matches_float64(tmp_path):
    import jax.numpy as jnp

    import forge_jax as fj
    from forge_jax import generation

    source, _ = write_checkpoint(tmp_path / "float", True)
    reference = write_fp8_checkpoint(source, tmp_path / "fp8")
    model = deepseek.from_pretrained(tmp_path / "fp8")
    weights = model.arrays()
    experts = weights["layers"][1]["moe"]["gate_proj"]
    q_a = weights["layers"][0]["attn"]["q_a_proj"]
    assert isinstance(experts, fj.QuantizedArray) and experts.format == "fp8"
    assert experts.values.shape == (CONFIG["n_routed_experts"], CONFIG["moe_intermediate_size"],
                                    CONFIG["hidden_size"])
    assert isinstance(q_a, fj.QuantizedArray) and q_a.values.dtype == jnp.float8_e4m3fn
    assert not isinstance(weights["layers"][1]["moe"]["router"], fj.QuantizedArray)
    # A float64 transformers model of the weights the fp8 file stands for (written as a
    # float64 checkpoint: transformers fuses the experts as it reads per-expert files).
    import shutil

    from safetensors.torch import save_file

    (tmp_path / "f64").mkdir()
    shutil.copy(source / "config.json", tmp_path / "f64")
    save_file({k: torch.from_numpy(v) for k, v in reference.items()},
              str(tmp_path / "f64" / "model.safetensors"))
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "f64",
                                                             dtype=torch.float64,
                                                             experts_implementation="eager")
    ref = ref.eval()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    prompts = np.asarray([PROMPTS[0]])
    _, logits = deepseek.generate_greedy(model.config, weights, prompts, 1, page_size=4)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(ref, prompts), rtol=2e-4,
                               atol=2e-4)
    assert generation.generate(model, PROMPTS, 8, eos_token_id=()) == [
        hf_greedy(ref, p, 8) for p in PROMPTS]
    with pytest.raises(ValueError, match="fp8 already"):
        deepseek.from_pretrained(tmp_path / "fp8", quantize="int8")


def test_the_common_entry_point_loads_it_quantized_and_on_a_mesh(runtime_model):
    import jax

    import forge_jax as fj
    from forge_jax import generation
    from forge_jax.kv_cache import CacheSpec
    from forge_jax.models import llama

    _, want, directory = runtime_model
    quantized = llama.from_pretrained(directory, dtype="float32", quantize="int8")
    assert isinstance(quantized, deepseek.DeepseekV3)
    assert isinstance(quantized.arrays()["layers"][1]["moe"]["down_proj"], fj.QuantizedArray)

    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    sharded = llama.from_pretrained(directory, dtype="float32", mesh=mesh)
    w = sharded.arrays()
    assert w["layers"][0]["attn"]["q_b_proj"].sharding.spec[0] == "tp"
    assert w["layers"][1]["moe"]["gate_proj"].sharding.spec[0] == "tp"  # by expert
    assert w["layers"][0]["attn"]["kv_a_proj"].sharding.is_fully_replicated
    for kind in ("paged", "contiguous"):
        assert generation.generate(sharded, PROMPTS, 8, eos_token_id=(),
                                   cache=CacheSpec(kind, page_size=4)) == want
    with pytest.raises(ValueError, match="divide by 8: .*num_attention_heads"):
        llama.from_pretrained(directory, dtype="float32",
                              mesh=jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8]))


def test_a_bad_quantize_is_refused_before_loading(runtime_model, monkeypatch):
    _, _, directory = runtime_model
    monkeypatch.setattr(deepseek.fp8, "open_files", lambda *a: pytest.fail("read the files"))
    with pytest.raises(ValueError, match="quantize='int3' is not a format"):
        deepseek.from_pretrained(directory, quantize="int3")
