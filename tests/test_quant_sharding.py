"""Quantized weights on a device mesh (conftest's 8 CPU devices): ``from_pretrained(path,
quantize=..., mesh=...)`` splits each quantized kernel as its float form would be, the
scales with their values, and computes what the same quantized model computes on one
device (logits within float32 rounding, greedy tokens identical); the product runs per
shard (no all-gather of a weight in the compiled program); an int4 split that would cut a
group is refused with the numbers.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.inputs import random_llama
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from forge_jax import quant, sharding
from forge_jax.models import llama
from forge_jax.models.checkpoints import quantize as quantize_load

LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
# 8 query / 2 KV heads of 8; a bias on q, k, v and o (o_proj's is added after the sum
# over the tensor axis); the vocabulary (96) splits over tp=2.
CONFIG = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=128, attention_bias=True)
PROMPTS = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("quant_mesh")
    save_file(llama.hf_state_dict(random_llama(CONFIG)), str(path / "model.safetensors"))
    config = {k: v for k, v in CONFIG.__dict__.items() if v is not None}
    (path / "config.json").write_text(json.dumps({**config,
                                                  "architectures": ["LlamaForCausalLM"]}))
    return path


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits(state, tokens, *, graphdef):
    return nnx.merge(graphdef, state)(tokens)


def _forward(model, tokens):
    graphdef, state = nnx.split(model)
    return _logits(state, tokens, graphdef=graphdef)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_model_on_a_mesh_matches_one_device(checkpoint, fmt):
    one = llama.from_pretrained(checkpoint, dtype=jnp.float32, quantize=fmt)
    mesh = sharding.make_mesh("dp=2,tp=2")
    split = llama.from_pretrained(checkpoint, dtype=jnp.float32, quantize=fmt, mesh=mesh)
    o_proj = split.layers[0].self_attn.o_proj.kernel.get_value()  # row-parallel [64, 64]
    qkv = split.layers[0].self_attn.qkv_proj.kernel.get_value()  # column-parallel
    assert isinstance(o_proj, fj.QuantizedArray) and o_proj.spec == (None, "tp")
    packed = 2 if fmt == "int4" else 1
    assert {s.data.shape for s in o_proj.values.addressable_shards} == {(64, 32 // packed)}
    # int8: the one scale per output channel, on every device; int4: each device's one
    # group of 32 of the row (of 2).
    assert {s.data.shape for s in o_proj.scales.addressable_shards} == {(64, 1)}
    assert o_proj.scales.shape == (64, 1 if fmt == "int8" else 2)
    assert {s.data.shape for s in qkv.values.addressable_shards} == {
        (qkv.shape[0] // 2, 64 // packed)}
    assert {s.data.shape for s in qkv.scales.addressable_shards} == {
        (qkv.shape[0] // 2, 1 if fmt == "int8" else 2)}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (4, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(_forward(split, tokens)),
                               np.asarray(_forward(one, tokens)), **LOGITS_TOL.as_kwargs())
    assert llama.generate(split, PROMPTS, 4) == llama.generate(one, PROMPTS, 4)


def test_the_product_runs_per_shard_without_gathering_the_weight():
    # [512, 1024]: large enough that the XLA product dequantizes it in two blocks of rows
    # (a loop XLA's own propagation splits by all-gathering the weight's values and scales).
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((2, 1024)), jnp.float32)
    # int4: packed values, and scales split with them both ways.
    q = fj.quantize(jnp.asarray(rng.standard_normal((512, 1024)), jnp.float32), "int4")
    mesh = sharding.make_mesh("tp=4")

    def product(a, b):
        with sharding.use_mesh(mesh):
            return fj.matmul(a, b, trans_b=True)

    for spec, reduces in ((("tp", None), 0), ((None, "tp"), 1)):
        placed = quant.place(q, NamedSharding(mesh, P(*spec)))
        hlo = jax.jit(product).lower(a, placed).compile().as_text()
        ops = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all)(?:-start)?\(", hlo)
        # Column-parallel: nothing to communicate; row-parallel: one all-reduce of the
        # [2, 512] partial products.
        assert ops == ["all-reduce"] * reduces, (spec, ops)


@pytest.mark.parametrize("fmt,spec", [("int8", ("tp", None)), ("int8", (None, "tp")),
                                      ("int4", ("tp", None)), ("int4", (None, "tp")),
                                      ("fp8", ("tp", None)), ("fp8", (None, "tp"))])
def test_placed_product_matches_one_device(fmt, spec):
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((64,)), jnp.float32)
    q = fj.quantize(w, fmt)
    mesh = sharding.make_mesh("dp=2,tp=4")
    placed = quant.place(q, NamedSharding(mesh, P(*spec)))
    want = np.asarray(a, np.float64) @ np.asarray(fj.dequantize(q), np.float64).T + np.asarray(
        bias, np.float64)

    @jax.jit
    def f(a, b, c):
        with sharding.use_mesh(mesh):
            return fj.matmul(a, b, trans_b=True, beta=1.0, c=c)

    np.testing.assert_allclose(np.asarray(f(a, placed, bias)), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("c_shape", [(4, 1), (4, 64), (1, 64)])
def test_placed_column_parallel_product_takes_any_broadcast_c(c_shape):
    # c broadcastable to [M, N] (fj.matmul's contract), a column [M, 1] included.
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    c = jnp.asarray(rng.standard_normal(c_shape), jnp.float32)
    q = fj.quantize(w, "int8")
    mesh = sharding.make_mesh("dp=2,tp=4")
    placed = quant.place(q, NamedSharding(mesh, P("tp", None)))
    want = np.asarray(a, np.float64) @ np.asarray(fj.dequantize(q), np.float64).T + 0.5 * (
        np.asarray(c, np.float64))

    @jax.jit
    def f(a, b, c):
        with sharding.use_mesh(mesh):
            return fj.matmul(a, b, trans_b=True, beta=0.5, c=c)

    np.testing.assert_allclose(np.asarray(f(a, placed, c)), want, rtol=1e-5, atol=1e-4)


def test_int4_groups_that_would_straddle_devices_are_refused(checkpoint):
    # o_proj's 64 input channels over tp=4: 16 per device, half a group of 32.
    with pytest.raises(ValueError, match=r"self_attn.o_proj.*group size 32 does not divide "
                                         r"the 16 values per device"):
        llama.from_pretrained(checkpoint, dtype=jnp.float32, quantize="int4",
                              mesh=sharding.make_mesh("tp=4"))
    q = fj.quantize(jnp.ones((16, 128), jnp.float32), "fp8", block=(8, 128))
    with pytest.raises(ValueError, match=r"block 8 does not divide the 4 values per device"):
        quant.partition_specs(q, ("tp", None), {"tp": 4})
    assert quantize_load.FORMATS["int4"] == 32


def test_shard_refuses_a_quantized_model(checkpoint):
    from forge_jax.models import llama_sharding

    one = llama.from_pretrained(checkpoint, dtype=jnp.float32, quantize="int8")
    with pytest.raises(ValueError, match=r"quantized weights.*from_pretrained\(path, "
                                         r"quantize=\.\.\., mesh=\.\.\.\)"):
        llama_sharding.shard(one, sharding.make_mesh("tp=2"))
