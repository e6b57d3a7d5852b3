"""Loading refuses a checkpoint whose weights hold NaN or inf (or values a float16 load
would turn into inf), naming the tensor: such a model runs and generates garbage."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cases.chat_checkpoint import write_checkpoint
from safetensors.numpy import load_file, save_file

from forge_jax import sharding
from forge_jax.models import llama


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("finite_ckpt"))


def _poisoned(clean, directory, name, value, dtype=np.float32, at=(1, 3)):
    """A copy of ``clean`` with its tensors stored as ``dtype`` and ``name[at] = value``."""
    shutil.copytree(clean, directory)
    tensors = {k: v.astype(dtype) for k, v in load_file(clean / "model.safetensors").items()}
    tensors[name][at[:tensors[name].ndim]] = value
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("name, value, dtype", [
    ("model.layers.1.mlp.down_proj.weight", np.nan, np.float32),
    ("model.layers.0.self_attn.k_proj.weight", np.inf, np.float32),  # part of a fused qkv
    ("model.norm.weight", -np.inf, ml_dtypes.bfloat16),
    ("lm_head.weight", np.nan, np.float16),
])
def test_non_finite_weights_are_refused_by_name(clean, tmp_path, name, value, dtype):
    path = _poisoned(clean, tmp_path / "bad", name, value, dtype)
    kind = "1 NaN, 0 inf" if np.isnan(value) else "0 NaN, 1 inf"
    with pytest.raises(llama.CheckpointError,
                       match=rf"tensor '{name}' in model.safetensors holds non-finite "
                             rf"values \({kind}, of \d+\)"):
        llama.from_pretrained(path)


def test_non_finite_weights_are_refused_on_a_mesh(clean, tmp_path):
    path = _poisoned(clean, tmp_path / "bad", "model.layers.0.mlp.gate_proj.weight", np.nan)
    with pytest.raises(llama.CheckpointError, match="gate_proj.weight.*non-finite"):
        llama.from_pretrained(path, mesh=sharding.make_mesh("tp=2"))


def test_values_beyond_float16_are_refused_when_loading_as_float16(clean, tmp_path):
    path = _poisoned(clean, tmp_path / "big", "model.embed_tokens.weight", 1e5)
    with pytest.raises(llama.CheckpointError, match=r"embed_tokens.weight.*beyond float16"):
        llama.from_pretrained(path, dtype=jnp.float16)
    model = llama.from_pretrained(path, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    assert float(model.embed_tokens[...].astype(jnp.float32).max()) == pytest.approx(1e5, 0.01)


def test_finite_checkpoints_load(clean):
    model = llama.from_pretrained(clean)
    assert np.isfinite(np.asarray(model.norm.weight[...])).all()
