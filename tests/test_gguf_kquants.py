"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) load kept quantized: ``fj.dequantize`` of each equals
ggml's own dequantization (``gguf.quants.dequantize``) bit for bit, ``fj.matmul`` reads them
through the quantized_matmul op, and a model of K-quant weights generates the greedy tokens
of the same weights loaded as floats. The files hold random blocks (the gguf package cannot
quantize to K-quants; any bytes are a valid block once its float16 scales are finite), so
every bit of the scales, minimums and values is exercised."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from cases import gguf_files

import forge_jax as fj
from forge_jax.models import llama

gguf = pytest.importorskip("gguf", reason="GGUF tests need the gguf package (pip install gguf)")

CONFIG = dict(gguf_files.CONFIG, hidden_size=256, intermediate_size=256)
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q6_K",
         "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q4_K"}
# format, group, minimums, bits a value stored (float32 scales and minimums included)
LAYOUT = {"Q4_K": ("int4", (32,), True, 6.0), "Q5_K": ("int8", (32,), True, 10.0),
          "Q6_K": ("int8", (16,), False, 10.0)}
PARTS = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "o": ["self_attn.o_proj"], "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
         "down": ["mlp.down_proj"]}


@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    """The K-quant file loaded, and the float32 weights ggml dequantizes it to."""
    file = tmp_path_factory.mktemp("kquants") / "model.gguf"
    reference = gguf_files.write(file, gguf_files.random_llama(0, CONFIG), TYPES, config=CONFIG)
    return llama.from_pretrained(file, dtype=jnp.float32), reference


def _kernels(model, reference):
    """(name, kind, QuantizedArray, ggml's float32 weight) of every linear layer."""
    kinds = {"qkv": "Q4_K", "o": "Q6_K", "gate_up": "Q5_K", "down": "Q6_K"}
    for i, layer in enumerate(model.layers):
        linears = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                   "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
        for key, linear in linears.items():
            want = np.concatenate([reference[f"model.layers.{i}.{part}.weight"]
                                   for part in PARTS[key]])
            yield f"layer {i} {key}", kinds[key], linear.kernel.get_value(), want
    yield "lm_head", "Q4_K", model.lm_head.kernel.get_value(), reference["lm_head.weight"]


def test_k_quants_stay_quantized_and_dequantize_as_ggml_bit_for_bit(k_model):
    model, reference = k_model
    for name, kind, k, want in _kernels(model, reference):
        assert isinstance(k, fj.QuantizedArray), name
        fmt, block, asymmetric, bits = LAYOUT[kind]
        assert (k.format, k.block, k.minimums is not None) == (fmt, block, asymmetric), name
        assert k.scales.dtype == jnp.float32, name
        assert k.nbytes == k.shape[0] * k.shape[1] * bits / 8, name
        got = np.asarray(fj.dequantize(k))
        assert got.dtype == want.dtype == np.float32, name
        # bit for bit: the same float32 values, signs of zero included
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


def test_matmul_reads_k_quants_through_quantized_matmul(k_model):
    model, reference = k_model
    gen = np.random.default_rng(1)
    for name, kind, k, want in _kernels(model, reference):
        x = gen.normal(size=(3, k.shape[1])).astype(np.float32)
        fj.dispatch.clear_selections()
        y = np.asarray(fj.matmul(jnp.asarray(x), k, trans_b=True))
        assert fj.dispatch.last_selection("quantized_matmul") is not None, name
        ref = x.astype(np.float64) @ want.astype(np.float64).T
        # a float32 sum of K products is within K * eps of the sum of their magnitudes
        bound = k.shape[1] * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64)
                                                         @ np.abs(want).astype(np.float64).T)
        assert np.all(np.abs(y - ref) <= bound), (name, kind, np.max(np.abs(y - ref) - bound))


def test_k_quant_model_generates_the_dequantized_models_tokens(k_model, tmp_path):
    model, reference = k_model
    floats = llama.from_pretrained(gguf_files.write_hf(tmp_path / "hf", reference, CONFIG),
                                   dtype=jnp.float32)
    prompts = [[1, 5, 9, 33, 70], [3, 60, 61, 62]]
    new = llama.generate(model, prompts, max_new_tokens=6, eos_token_id=())
    # The float model's greedy tokens, teacher-forced: each new token is its argmax after
    # the tokens before it (one forward pass of both sequences, right-padded, which a
    # causal model's earlier positions do not see).
    tokens = jnp.asarray([prompts[0] + new[0], prompts[1] + new[1] + [0]], jnp.int32)
    got, want = np.asarray(model(tokens)), np.asarray(floats(tokens))
    tol = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
    np.testing.assert_allclose(got, want, **tol.as_kwargs())
    for row, (prompt, tokens_new) in enumerate(zip(prompts, new, strict=True)):
        start = len(prompt) - 1
        assert [int(t) for t in tokens_new] == want[row, start:start + 6].argmax(-1).tolist()


def test_fused_parts_of_different_layouts_stay_quantized_exactly(tmp_path):
    # gate Q4_1 (float16 scales) with up Q4_K (float32): int4 with minimums, float32 scales.
    # q/k Q4_K (int4, groups of 32) with v Q6_K (int8, groups of 16), as llama.cpp's Q4_K_M
    # files mix them: int8 in groups of 16 with minimums (zero for v's rows).
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_K"}
    file = tmp_path / "mixed.gguf"
    reference = gguf_files.write(file, gguf_files.random_llama(2, CONFIG), types, config=CONFIG)
    model = llama.from_pretrained(file, dtype=jnp.float32)
    layer = model.layers[1]
    for linear, parts, layout in [
            (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"], ("int4", (32,))),
            (layer.self_attn.qkv_proj, PARTS["qkv"], ("int8", (16,)))]:
        k = linear.kernel.get_value()
        assert isinstance(k, fj.QuantizedArray), parts
        assert (k.format, k.block) == layout and k.minimums is not None, parts
        assert k.scales.dtype == k.minimums.dtype == jnp.float32, parts
        want = np.concatenate([reference[f"model.layers.1.{p}.weight"] for p in parts])
        np.testing.assert_array_equal(np.asarray(fj.dequantize(k)), want, err_msg=str(parts))


def test_a_k_quant_tensor_cut_short_is_named(tmp_path):
    good = tmp_path / "good.gguf"
    # the file's last tensor is blk.1.ffn_down
    gguf_files.write(good, gguf_files.random_llama(3, CONFIG), {"ffn_down": "Q6_K"},
                     config=CONFIG)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(cut)
    message = str(e.value)
    assert "\n" not in message
    assert "cut.gguf" in message and "'blk.1.ffn_down.weight' (Q6_K, shape (256, 256))" in message
    assert "is cut short" in message, message
