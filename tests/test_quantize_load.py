"""Quantize at load: ``llama.from_pretrained(path, quantize=...)`` on the tiny model and on a
random Llama saved by transformers: the quantized model computes exactly what a float32
model holding the dequantized weights computes, stays close to the float32 model, and
stores about the format's ideal number of bytes (measured from the arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.cli import assert_one_line_error, run

import forge_jax as fj
from forge_jax.models import TINY_DIR, llama
from forge_jax.models.checkpoints import quantize as quantize_load

# Wiring: the same float32 ops in another order (dequantize-in-the-product against a
# dequantized weight): the parity tests' float32 tolerance for a whole model.
WIRING_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
# Closeness to the float32 model, as a share of the largest |logit|: int8 rounds each weight
# within 1/254 of its row's largest, fp8 within 2**-4 of itself, int4 within 1/14 of its
# group's largest; the errors average out over a product's terms, and these bounds hold
# with a margin of about 2x on the tiny model (measured: 0.4%, 2.6%, 11%).
CLOSE = {"int8": 0.01, "fp8": 0.05, "int4": 0.2}
TOKENS = jnp.asarray([[3, 4, 5, 6, 7, 8, 9], [5, 5, 6, 11, 3, 4, 4]], jnp.int32)


def _dequantized_copy(model):
    """The float32 tiny model with each kernel replaced by ``model``'s dequantized one (the
    numbers the quantized model should compute with)."""
    copy = llama.from_pretrained(TINY_DIR, dtype=jnp.float32)
    for mine, quantized in zip(quantize_load.linear_kernels(copy),
                               quantize_load.linear_kernels(model), strict=True):
        mine.set_value(fj.dequantize(quantized.get_value()))
    return copy


@pytest.fixture(scope="module")
def float_model():
    return llama.from_pretrained(TINY_DIR, dtype=jnp.float32)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_tiny_model_quantized_at_load(float_model, fmt):
    model = llama.from_pretrained(TINY_DIR, dtype=jnp.float32, quantize=fmt)
    kernels = [k.get_value() for k in quantize_load.linear_kernels(model)]
    assert kernels and all(isinstance(k, fj.QuantizedArray) and k.format == fmt for k in kernels)
    assert model.embed_tokens.get_value().dtype == jnp.float32  # embedding as it is
    got = np.asarray(jax.jit(lambda t: model(t))(TOKENS))
    want = np.asarray(_dequantized_copy(model)(TOKENS))
    np.testing.assert_allclose(got, want, **WIRING_TOL.as_kwargs())
    ref = np.asarray(float_model(TOKENS))
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < err < CLOSE[fmt], (fmt, err)
    # Parameter bytes within 5% of the ideal: the float32 parameters that stay, plus each
    # kernel's values at the format's bits per value with float32 scales.
    ideal = quantize_load.parameter_bytes(float_model)
    for k in kernels:
        n, cols = k.shape
        bits = fj.quant.bits_per_value(fmt, group_size=k.block[-1], columns=cols)
        ideal += n * cols * (bits / 8 - 4)
    measured = quantize_load.parameter_bytes(model)
    assert abs(measured - ideal) / ideal < 0.05, (measured, ideal)
    assert measured < 0.35 * quantize_load.parameter_bytes(float_model)
    estimate = fj.memory.estimate_inference_memory(model.config, batch=1, max_len=1,
                                                   quantize=fmt).weights
    assert abs(estimate - measured) / measured < 0.02, (estimate, measured)


def test_generate_with_a_quantized_model(float_model):
    model = llama.from_pretrained(TINY_DIR, dtype=jnp.float32, quantize="int8")
    prompts = [[3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 3]]
    got = llama.generate(model, prompts, max_new_tokens=6, cache="paged")
    want = llama.generate(float_model, prompts, max_new_tokens=6, cache="paged")
    assert [list(map(int, g)) for g in got] == [list(map(int, w)) for w in want]


def test_transformers_checkpoint_quantized_int8(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()  # transformers' own init (std 0.02)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = hf(torch.asarray(np.asarray(TOKENS) % 128)).logits.numpy()
    model = llama.from_pretrained(tmp_path, dtype=jnp.float32, quantize="int8")
    got = np.asarray(model(TOKENS % 128))
    # Random weights give near-uniform logits, whose largest is not much above the others:
    # the error relative to the logits' norm (it measured 1.06% of the largest logit).
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < err < CLOSE["int8"], err
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) > 0.9


@pytest.mark.parametrize("kwargs,message", [
    (dict(quantize="int3"), r"quantize='int3' is not a format; choose one of int8, int4, fp8"),
    (dict(quantize="int4", group_size=48), r"group_size=48 does not divide"),
    (dict(group_size=32), r"group_size=32 needs quantize="),
])
def test_bad_quantize_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        llama.from_pretrained(TINY_DIR, **kwargs)
    assert "\n" not in str(info.value)


def test_cli_generate_quantize(capsys):
    code, out, _ = run(capsys, "generate", "--quantize", "int4", "--num-problems", "16",
                       "--no-compilation-cache")
    assert code == 0 and "int4 linear layers" in out and "accuracy: 16/16" in out
    assert "quantized_matmul xla" in out


def test_cli_bad_group_size(capsys):
    assert_one_line_error(run(capsys, "generate", "--quantize", "int4", "--group-size", "48"),
                          "--group-size 48 must be a positive even number dividing")
