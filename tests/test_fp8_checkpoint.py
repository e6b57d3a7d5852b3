"""Hugging Face fine-grained FP8 checkpoints: a tiny one written here (float8_e4m3fn weights
with ``weight_scale_inv`` in 128 x 128 blocks, written by torch and safetensors) loads into
fp8 kernels holding the file's bytes, whose logits match a float64 transformers model built
from the dequantized weights, and transformers' own loading of the same checkpoint; the
settings forge_jax does not read are one clear error naming the field or tensor."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import gguf_files
from cases import quant as quant_ref

import forge_jax as fj
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
TOKENS = np.asarray([[1, 5, 9, 33, 70, 2, 4, 95], [3, 3, 60, 61, 62, 7, 8, 9]])
QUANT = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
             weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
# Whole 128 blocks along every in axis; k/v have 64 rows (one partial block of rows).
CONFIG = dict(gguf_files.CONFIG, hidden_size=128, intermediate_size=256)
# Partial blocks everywhere (160 in features, 32-row k/v, 224 rows of gate and up).
CONFIG_PARTIAL = dict(gguf_files.CONFIG, hidden_size=160, intermediate_size=224,
                      num_attention_heads=5, num_key_value_heads=1)


def write_fp8(directory, config, seed=0, quant=QUANT, edit=None):
    """An fp8 checkpoint of a random Llama; returns the float64 weights it stands for."""
    from safetensors.torch import save_file

    tensors, reference = {}, {}
    for name, w in gguf_files.random_llama(seed, config).items():
        if w.ndim == 2 and name.startswith("model.layers."):
            tensors[name], tensors[name + "_scale_inv"], reference[name] = quant_ref.fp8_blocks(w)
        else:
            tensors[name], reference[name] = torch.from_numpy(w), w.astype(np.float64)
    if edit:
        edit(tensors)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    save_file(tensors, str(directory / "model.safetensors"))
    return reference


def logits(model) -> np.ndarray:
    return np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(TOKENS, jnp.int32)))


def float64_logits(config, weights) -> np.ndarray:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.float64)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    with torch.no_grad():
        return model.eval()(torch.asarray(TOKENS)).logits.numpy()


@pytest.mark.parametrize("config", [CONFIG, CONFIG_PARTIAL], ids=["whole", "partial"])
def test_fp8_checkpoint_loads_quantized_and_matches_float64(tmp_path, config):
    reference = write_fp8(tmp_path / "fp8", config)
    model = llama.from_pretrained(tmp_path / "fp8", dtype=jnp.float32)
    kernels = [k.get_value() for k in quantize_load.linear_kernels(model)]
    assert all(isinstance(k, fj.QuantizedArray) and k.format == "fp8" for k in kernels[:-1])
    assert not isinstance(kernels[-1], fj.QuantizedArray)  # lm_head: stored as a float
    layer = model.layers[0]
    qkv = layer.self_attn.qkv_proj.kernel.get_value()
    # The k and v parts' 64 (32) rows make the row blocks finer; columns: 128 or gcd(160, 128).
    assert qkv.block == ((64, 128) if config is CONFIG else (32, 32)), qkv.block
    assert qkv.values.dtype == jnp.float8_e4m3fn and qkv.nbytes < 1.2 * np.prod(qkv.shape)
    p = "model.layers.0"
    for linear, parts in [(qkv, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                          (layer.mlp.gate_up_proj.kernel.get_value(),
                           ["mlp.gate_proj", "mlp.up_proj"]),
                          (layer.mlp.down_proj.kernel.get_value(), ["mlp.down_proj"])]:
        np.testing.assert_array_equal(quant_ref.dequantize(linear), np.concatenate(
            [reference[f"{p}.{part}.weight"] for part in parts]))  # exact: the file's numbers
    got = logits(model)
    np.testing.assert_allclose(got, float64_logits(config, reference),
                               **LOGITS_TOL.as_kwargs())


def test_fp8_checkpoint_matches_transformers_loading_it(tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints with it")
    write_fp8(tmp_path / "fp8", CONFIG, seed=1)
    model = llama.from_pretrained(tmp_path / "fp8", dtype=jnp.float32)
    # On a CPU transformers dequantizes the fp8 weights at load (to the model's float32).
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8",
                                                           dtype=torch.float32).eval()
    assert hf.model.layers[0].self_attn.k_proj.weight.dtype == torch.float32
    with torch.no_grad():
        want = hf(torch.asarray(TOKENS)).logits.numpy()
    np.testing.assert_allclose(logits(model), want,
                               **LOGITS_TOL.as_kwargs())


def _error(path, *fragments):
    with pytest.raises(llama.CheckpointError) as e:
        llama.from_pretrained(path, dtype=jnp.float32)
    message = str(e.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("field,value", [("activation_scheme", "static"),
                                         ("weight_block_size", [64, 64]),
                                         ("scale_fmt", "ue8m0"),
                                         ("modules_to_convert", ["embed_tokens"])])
def test_unsupported_settings_name_the_field(tmp_path, field, value):
    directory = tmp_path / field
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(
        CONFIG, quantization_config=dict(QUANT, **{field: value}))))
    with pytest.raises(llama.CheckpointError) as e:
        llama.load_config(directory)
    assert f"quantization_config.{field}={value!r}" in str(e.value)


def test_inconsistent_tensors_name_the_tensor(tmp_path):
    q = "model.layers.1.self_attn.q_proj.weight"
    write_fp8(tmp_path / "skip", CONFIG, quant=dict(QUANT, modules_to_not_convert=[
        "lm_head", "model.layers.1.self_attn.q_proj"]))
    _error(tmp_path / "skip", q, "modules_to_not_convert", "'model.layers.1.self_attn.q_proj'")

    def cut_scales(t):
        t[q + "_scale_inv"] = t[q + "_scale_inv"][:, :0]
    write_fp8(tmp_path / "shape", CONFIG, edit=cut_scales)
    _error(tmp_path / "shape", f"'{q}_scale_inv'", "has shape (1, 0); (1, 1) scales")

    write_fp8(tmp_path / "missing", CONFIG, edit=lambda t: t.pop(q + "_scale_inv"))
    _error(tmp_path / "missing", q, "has no", "_scale_inv")

    def nan(t):
        t[q] = t[q].clone()
        t[q].view(torch.uint8)[0, 0] = 0x7F
    write_fp8(tmp_path / "nan", CONFIG, edit=nan)
    _error(tmp_path / "nan", q, "1 non-finite values")
