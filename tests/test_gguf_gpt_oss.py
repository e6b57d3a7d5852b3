"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture): a transformers-written random
gpt-oss checkpoint, its experts quantized to MXFP4 by ggml's quantizer, converted into a
GGUF file the way llama.cpp's converter does (``tests/cases/gguf_gpt_oss.py``), loads
through ``llama.from_pretrained(path.gguf)`` with MXFP4 experts (no float copy) and gives
the logits and greedy tokens of the same weights loaded from safetensors; the experts'
values are ggml's own decoding of the file's bytes; negative controls (gate/up left
de-interleaved, YaRN's correction range rounded as llama.cpp rounds it, no SwiGLU clamp)
miss."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from cases import gguf_gpt_oss
from cases.hf_families import LOGITS_TOL, forge_logits, save_checkpoint
from flax import nnx

import forge_jax as fj
from forge_jax.generation import generate
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama

gguf = pytest.importorskip("gguf", reason="GGUF tests need the gguf package (pip install gguf)")

# gpt-oss scaled down (as in tests/test_families_recent.py): 8 query / 2 KV heads of 16,
# even layers sliding (window 6), 6 experts top-2, YaRN past an original context of 8; the
# SwiGLU limit is gpt-oss's 7 (llama.cpp compiles it in), reached by large expert biases.
CONFIG = dict(vocab_size=96, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
              num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              sliding_window=6, swiglu_limit=7.0, pad_token_id=0, bos_token_id=1,
              eos_token_id=2,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 8, "rope_theta": 1000.0})
SEQ = 20  # past the window and the original context


@functools.cache
def _checkpoints(root: pathlib.Path) -> pathlib.Path:
    """``root`` holding ``float`` (transformers-written) and ``mxfp4`` (its experts in
    MXFP4) checkpoints."""
    save_checkpoint(root / "float", "GptOssConfig", "GptOssForCausalLM", CONFIG, seed=7,
                    stds={"sinks": 1.5, "gate_up_proj_bias": 4.0})
    gguf_gpt_oss.mxfp4_checkpoint(root / "float", root / "mxfp4")
    return root


@pytest.fixture(scope="module")
def checkpoints(hf, tmp_path_factory):
    return _checkpoints(tmp_path_factory.mktemp("gpt_oss_gguf"))


def _reference(checkpoint, stored, directory):
    """``checkpoint`` with its float tensors as the GGUF file stores them."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, directory)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors.update(stored)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return llama.from_pretrained(directory, dtype=jnp.float32)


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(3, CONFIG["vocab_size"], (2, SEQ)).astype(
        np.int32)


def _with(model, config=None, **params):
    """A copy of ``model`` (its config replaced) with parameters replaced by name."""
    copy = nnx.merge(*nnx.split(model))
    if config is not None:
        copy.config = config
    for path, value in params.items():
        layer, name = path.split(".")
        getattr(copy.layers[int(layer)].mlp, name).set_value(value)
    return copy


@pytest.mark.parametrize("types,fused", [({}, False), ({"attn_q": "Q8_0", "attn_k": "Q8_0",
                                                         "attn_v": "Q8_0", "output": "Q8_0"},
                                                        True)], ids=["f32", "q8_0-fused"])
def test_gpt_oss_gguf_matches_safetensors(checkpoints, tmp_path, types, fused):
    checkpoint = checkpoints / "mxfp4"
    file = tmp_path / "gpt-oss.gguf"
    stored = gguf_gpt_oss.write(file, checkpoint, types, fuse_gate_up=fused)
    ref = _reference(checkpoint, stored, tmp_path / "reference")
    model = llama.from_pretrained(file, dtype=jnp.float32)
    assert model.config == ref.config
    c = model.config
    assert c.model_type == "gpt_oss" and c.rope_scaling.kind == "yarn"
    assert c.layer_types == ("sliding_attention", "full_attention")

    # The experts load as MXFP4, the file's codes and scales, which ggml decodes to the
    # same numbers.
    reader = gguf.GGUFReader(file)
    by_name = {t.name: t for t in reader.tensors}
    for i, layer in enumerate(model.layers):
        gate_up, down = layer.mlp.gate_up.get_value(), layer.mlp.down.get_value()
        for w in (gate_up, down):
            assert isinstance(w, fj.QuantizedArray) and w.format == "mxfp4"
            assert w.values.dtype == jnp.uint8 and w.nbytes * 8 == np.prod(w.shape) * 4.25
        want_down = _ggml(by_name[f"blk.{i}.ffn_down_exps.weight"])
        np.testing.assert_array_equal(np.asarray(fj.dequantize(down)), want_down)
        if fused:
            both = _ggml(by_name[f"blk.{i}.ffn_gate_up_exps.weight"])
            gate, up = np.split(both, 2, axis=1)
        else:
            gate = _ggml(by_name[f"blk.{i}.ffn_gate_exps.weight"])
            up = _ggml(by_name[f"blk.{i}.ffn_up_exps.weight"])
        got = np.asarray(fj.dequantize(gate_up))
        np.testing.assert_array_equal(got[:, ::2], gate)
        np.testing.assert_array_equal(got[:, 1::2], up)
        np.testing.assert_array_equal(np.asarray(gate_up.values),
                                      np.asarray(ref.layers[i].mlp.gate_up.get_value().values))
    if types:
        assert model.lm_head.kernel.get_value().format == "int8"

    tokens = _tokens()
    want = forge_logits(ref, tokens)
    np.testing.assert_allclose(forge_logits(model, tokens), want, **LOGITS_TOL.as_kwargs())
    assert np.abs(want).max() > 1.0
    if fused:  # the greedy tokens and the negative controls once, with the split tensors
        return
    prompts = [tokens[0, :13].tolist(), tokens[1, :11].tolist()]
    expected = generate(ref, prompts, 5, eos_token_id=(), cache=CacheSpec(page_size=4))
    for kind in ("paged", "contiguous"):
        spec = CacheSpec(kind=kind, page_size=4)
        assert generate(model, prompts, 5, eos_token_id=(), cache=spec) == expected, kind

    # Negative controls. Gate and up left as the converter splits them (gate rows, then up
    # rows), not interleaved again:
    def split_rows(q):
        e, n = q.shape[:2]
        swap = lambda a: np.asarray(a).reshape(e, n // 2, 2, -1).swapaxes(1, 2).reshape(
            a.shape)
        return fj.quant.from_parts(swap(q.values), swap(q.scales), format="mxfp4",
                                   block=q.block)
    wrong = _with(model, **{f"{i}.gate_up": split_rows(layer.mlp.gate_up.get_value())
                            for i, layer in enumerate(model.layers)})
    miss = np.abs(forge_logits(wrong, tokens) - want).max()
    assert miss > 50 * LOGITS_TOL.atol, miss
    # YaRN's correction range rounded to whole dimensions (llama.cpp's RoPE, transformers'
    # default): gpt-oss's is not.
    rounded = dataclasses.replace(c, rope_scaling=dataclasses.replace(c.rope_scaling,
                                                                      truncate=True))
    miss = np.abs(forge_logits(_with(model, rounded), tokens) - want).max()
    assert miss > 50 * LOGITS_TOL.atol, miss
    # The SwiGLU clamp (gpt-oss's limit 7, not in the file) bites: without it the logits miss.
    unclamped = _with(model)
    for layer in unclamped.layers:
        layer.mlp.limit = 1e6
    miss = np.abs(forge_logits(unclamped, tokens) - want).max()
    assert miss > 50 * LOGITS_TOL.atol, miss


def test_gpt_oss_gguf_with_quantized_float_experts(checkpoints, tmp_path):
    """A gpt-oss converted from float experts (a dequantized gpt-oss), its experts then
    quantized as llama.cpp's quantize does (gate Q8_0, up Q4_0, down Q8_0): they load as int8
    ``[experts, out, in]`` (up's int4 widened into gate's layout, exactly), gate and up
    interleaved again, and give the logits of the same weights from safetensors."""
    file = tmp_path / "gpt-oss-q8_0.gguf"
    stored = gguf_gpt_oss.write(file, checkpoints / "float", {
        "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"})
    ref = _reference(checkpoints / "float", stored, tmp_path / "reference")
    model = llama.from_pretrained(file, dtype=jnp.float32)
    for layer, ref_layer in zip(model.layers, ref.layers, strict=True):
        for got, want in ((layer.mlp.gate_up, ref_layer.mlp.gate_up),
                          (layer.mlp.down, ref_layer.mlp.down)):
            q = got.get_value()
            assert isinstance(q, fj.QuantizedArray) and q.format == "int8"
            np.testing.assert_array_equal(np.asarray(fj.dequantize(q)),
                                          np.swapaxes(np.asarray(want.get_value()), 1, 2))
    tokens = _tokens(seed=1)
    np.testing.assert_allclose(forge_logits(model, tokens), forge_logits(ref, tokens),
                               **LOGITS_TOL.as_kwargs())


def _ggml(tensor) -> np.ndarray:
    """ggml's own decoding of an MXFP4 GGUF tensor, ``[experts, out, in]`` float32."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)


def test_transform_nibble_layout_is_ggml_order():
    """The converter's repacking (ported step by step) turns gpt-oss's byte layout into
    the one ggml's MXFP4 quantizer writes: the helper's round trip is exact."""
    w = np.random.default_rng(0).normal(0, 1, (2, 3, 64)).astype(np.float32)
    ggml = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    blocks, scales = gguf_gpt_oss.hf_from_ggml(ggml)
    np.testing.assert_array_equal(gguf_gpt_oss.repack_mxfp4(blocks, scales), ggml)
    # and forge_jax's decoding of the gpt-oss layout is ggml's of its own
    from forge_jax.models.checkpoints import gguf_gpt_oss as loader

    np.testing.assert_array_equal(np.asarray(fj.dequantize(loader.mxfp4(ggml))),
                                  gguf.quants.dequantize(ggml, gguf.GGMLQuantizationType.MXFP4))


# Texts where the splits differ: case changes inside a word, digit runs, contractions in
# capitals, punctuation with newlines and slashes, runs of spaces.
SAMPLES = ["HelloWorld and CamelCaseWords", "1234567 + 89 = 1234656", "DON'T stop, we're HERE",
           "path/to/file.txt\n\nnext\tline  with   spaces",
           "\u00c9COLE na\u00efve caf\u00e9 \U0001f642!",
           "<|start|>user<|message|>Hi there<|end|>"]
CORPUS = SAMPLES[:5] * 3 + ["the quick brown fox jumps over the lazy dog 0123456789",
                            "It's a TEST of o200k's splitting, isn't it? 42/7\n"]


@pytest.mark.parametrize("pre", ["gpt-4o", "llama-bpe"])
def test_bpe_tokenizer_splits_as_tokenizer_ggml_pre_says(tmp_path, pre):
    """A byte-level BPE vocabulary trained behind gpt-oss's o200k split (or Llama 3's),
    written into a GGUF file as llama.cpp writes it (``tokenizer.ggml.pre``), encodes as
    the original ``tokenizers`` tokenizer; with GPT-2's split (no ``pre``) it does not."""
    from cases import gguf_files
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from forge_jax.models.checkpoints import gguf_pretokenizers
    from forge_jax.text import api as text

    original = Tokenizer(models.BPE())
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(gguf_pretokenizers.SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    original.decoder = decoders.ByteLevel()
    specials = ["<|start|>", "<|message|>", "<|end|>"]
    original.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(original.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    config = dict(gguf_files.CONFIG, vocab_size=len(tokens))
    files = {}
    for name, split in (("file", pre), ("gpt2", None)):
        files[name] = tmp_path / f"{name}.gguf"
        gguf_files.write(files[name], gguf_files.random_llama(0, config), {}, config=config,
                         tokenizer=dict(tokens=tokens, merges=merges, pre=split,
                                        types=[3 if t in specials else 1 for t in tokens]))
    tok = text.load_tokenizer(files["file"])
    gpt2 = text.load_tokenizer(files["gpt2"])
    differ = 0
    for sample in SAMPLES:
        want = original.encode(sample, add_special_tokens=False).ids
        assert tok.backend.encode(sample, add_special_tokens=False).ids == want, sample
        assert tok.decode(want, skip_special_tokens=False) == sample
        differ += gpt2.backend.encode(sample, add_special_tokens=False).ids != want
    assert differ >= 2, differ  # the split is read, not GPT-2's by chance


def _metadata_file(path, *, experts=True, rope=None):
    """A gpt-oss GGUF file of metadata only (no tensors): enough for ``load_config``."""
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for name, value in (("block_count", 2), ("context_length", 128), ("embedding_length", 64),
                        ("feed_forward_length", 32), ("head_count", 8), ("head_count_kv", 2),
                        ("key_length", 16), ("layer_norm_rms_eps", 1e-5), ("vocab_size", 96),
                        ("sliding_window", 6), ("expert_feed_forward_length", 32),
                        ("rope_freq_base", 1000.0)):
        getattr(w, f"add_{name}")(value)
    if experts:
        w.add_expert_count(6)
        w.add_expert_used_count(2)
    for name, value in (rope or {}).items():
        getattr(w, f"add_rope_scaling_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(rope={"type": gguf.RopeScalingType.LINEAR, "factor": 2.0}),
     "gpt-oss.rope.scaling.type='linear' is not supported"),
    (dict(rope={"type": gguf.RopeScalingType.YARN, "factor": 4.0, "orig_ctx_len": 8,
                "yarn_attn_factor": 2.0}),
     "gpt-oss.rope.scaling.yarn_attn_factor=2.0 is not supported (only 1.0)"),
    (dict(rope={"type": gguf.RopeScalingType.YARN, "factor": 4.0}),
     "needs gpt-oss.rope.scaling.factor and gpt-oss.rope.scaling.original_context_length"),
    (dict(experts=False), "metadata lacks the keys for ['num_local_experts', "
                          "'num_experts_per_tok']")])
def test_gpt_oss_metadata_refusals_name_the_key(tmp_path, kwargs, fragment):
    file = _metadata_file(tmp_path / "meta.gguf", **kwargs)
    with pytest.raises(llama.CheckpointError) as e:
        llama.load_config(file)
    assert "\n" not in str(e.value) and fragment in str(e.value), str(e.value)


def test_gpt_oss_metadata_config(tmp_path):
    """The metadata alone: YaRN with llama.cpp's beta defaults, gpt-oss's clamp, even layers
    sliding."""
    file = _metadata_file(tmp_path / "meta.gguf", rope={
        "type": gguf.RopeScalingType.YARN, "factor": 32.0, "orig_ctx_len": 4096})
    c = llama.load_config(file)
    assert (c.rope_scaling.kind, c.rope_scaling.factor, c.rope_scaling.beta_fast,
            c.rope_scaling.beta_slow, c.rope_scaling.truncate) == ("yarn", 32.0, 32.0, 1.0, False)
    assert (c.swiglu_alpha, c.swiglu_limit, c.rms_norm_eps) == (1.702, 7.0, 1e-5)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (6, 2, 32)
    assert c.layer_types == ("sliding_attention", "full_attention") and c.sliding_window == 6
