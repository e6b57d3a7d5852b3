"""Sharded inference on conftest's 8 CPU devices: tensor-parallel Llama and its caches.

A sharded model is checked against the same model on one device (logits within the
float32 tolerance, greedy tokens identical, both caches) on the meshes tp=8, dp=2 x tp=4,
dp=8 with 8 query / 2 KV heads (KV heads copied on tp=4 and tp=8) and tp=3, dp=2 x tp=3
with 9 / 3 heads and a vocabulary that does not split; each device's share of weights
and cache; the collectives per layer of the compiled decode step; kernels run per shard;
loading reads only each device's slice; two processes forming one mesh.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.inputs import random_llama
from flax import nnx
from jax.sharding import PartitionSpec as P

import forge_jax as fj
from forge_jax import dispatch, sharding
from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation import steps
from forge_jax.kv_cache import ContiguousKVCache, PagedKVCache
from forge_jax.models import llama, llama_sharding

LOGITS_TOL = fj.tolerances.scaled(fj.tolerances.tolerance(jnp.float32), 20)
CONFIGS = {
    # 8 query heads, 2 KV heads: KV heads split on tp=2, are copied on tp=4 and tp=8.
    "8q2kv": llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=2, max_position_embeddings=256),
    # 9 / 3 heads on a tensor axis of 3; the vocabulary (100) does not split over 3.
    "9q3kv": llama.LlamaConfig(vocab_size=100, hidden_size=72, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=9,
                               num_key_value_heads=3, max_position_embeddings=256,
                               tie_word_embeddings=True),
}
MESHES = [("8q2kv", "tp=8"), ("8q2kv", "dp=2,tp=4"), ("8q2kv", "dp=8"), ("9q3kv", "tp=3"),
          ("9q3kv", "dp=2,tp=3")]
PROMPTS = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [70, 7, 64]]


@functools.cache
def _model(name):
    return random_llama(CONFIGS[name])


@functools.cache
def _sharded(name, mesh):
    return llama_sharding.shard(_model(name), sharding.make_mesh(mesh))


@functools.cache
def _reference_tokens(name, cache):
    return llama.generate(_model(name), PROMPTS, 6, cache=cache)


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits(state, tokens, *, graphdef):
    return nnx.merge(graphdef, state)(tokens)


def _tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, 96, (4, 12)), jnp.int32)


@pytest.mark.parametrize("name,mesh", MESHES)
def test_sharded_model_matches_one_device(name, mesh):
    model, sharded = _model(name), _sharded(name, mesh)
    tokens = _tokens()
    graphdef, state = nnx.split(model)
    ref = _logits(state, tokens, graphdef=graphdef)
    graphdef, state = nnx.split(sharded)
    out = _logits(state, tokens, graphdef=graphdef)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **LOGITS_TOL.as_kwargs())
    for cache in ("paged", "contiguous"):
        tokens_out = llama.generate(sharded, PROMPTS, 6, cache=cache)
        assert tokens_out == _reference_tokens(name, cache), (mesh, cache)


def test_generate_on_a_mesh_compiles_once():
    sharded = _sharded("8q2kv", "dp=2,tp=4")
    llama.generate(sharded, PROMPTS, 4)
    sizes = steps.prefill_step._cache_size(), steps.decode_step._cache_size()
    again = llama.generate(sharded, [[9, 8, 7], [1, 2], [3, 4, 5, 6]], 4)  # same buckets
    assert (steps.prefill_step._cache_size(),
            steps.decode_step._cache_size()) == sizes
    assert again == llama.generate(_model("8q2kv"), [[9, 8, 7], [1, 2], [3, 4, 5, 6]], 4)


@pytest.mark.parametrize("heads,kv_heads,tp,groups,repeat", [
    (8, 2, 1, 1, 1), (8, 2, 2, 2, 1), (8, 2, 4, 4, 2), (8, 2, 8, 8, 4), (9, 3, 3, 3, 1),
    (32, 8, 4, 4, 1), (32, 8, 16, 16, 2),
])
def test_layout_rule(heads, kv_heads, tp, groups, repeat):
    config = llama.LlamaConfig(vocab_size=64, hidden_size=heads * 8, intermediate_size=16 * tp,
                               num_hidden_layers=1, num_attention_heads=heads,
                               num_key_value_heads=kv_heads)
    assert llama_sharding.layout_for(config, tp) == llama.TensorLayout(groups, repeat)


@pytest.mark.parametrize("heads,kv_heads,inter,tp,match", [
    (9, 3, 64, 2, r"num_attention_heads=9 does not split over a tensor axis of 2"),
    (12, 3, 64, 4, r"num_key_value_heads=3 neither splits over a tensor axis of 4"),
    (8, 2, 36, 8, r"intermediate_size=36 does not split over a tensor axis of 8"),
])
def test_layout_rule_refuses_what_does_not_split(heads, kv_heads, inter, tp, match):
    config = llama.LlamaConfig(vocab_size=64, hidden_size=heads * 8, intermediate_size=inter,
                               num_hidden_layers=1, num_attention_heads=heads,
                               num_key_value_heads=kv_heads)
    with pytest.raises(ValueError, match=match):
        llama_sharding.layout_for(config, tp)
    with pytest.raises(ValueError, match=match):
        llama_sharding.shard(llama.Llama(config, rngs=nnx.Rngs(0)),
                             sharding.make_mesh({"tp": tp}))


def test_mesh_config_errors():
    with pytest.raises(ValueError, match=r"mesh axes \['x'\] are neither tp_axis='tp'"):
        sharding.MeshConfig(sharding.make_mesh({"x": 2}))
    with pytest.raises(ValueError, match=r"needs 16 devices; only 8 available"):
        sharding.make_mesh("tp=16")
    for bad in ("tp", "tp=a", "tp=2,tp=2", " ", "tp=0"):
        with pytest.raises(ValueError, match="tp"):
            sharding.parse_mesh(bad)
    config = sharding.MeshConfig(sharding.make_mesh({"model": 4, "data": 2}), tp_axis="model",
                                 dp_axis="data")
    assert (config.tp, config.dp) == (4, 2)


def test_each_device_holds_only_its_share():
    model, sharded = _model("8q2kv"), _sharded("8q2kv", "tp=8")
    c = model.config
    qkv = sharded.layers[0].self_attn.qkv_proj.kernel[...]
    # 8 query heads + 8 copies of the 2 KV heads (for k and v), head_dim 8: one of each.
    assert qkv.shape == ((8 + 2 * 8) * 8, c.hidden_size)
    assert {s.data.shape for s in qkv.addressable_shards} == {(3 * 8, c.hidden_size)}
    down = sharded.layers[0].mlp.down_proj.kernel[...]
    assert {s.data.shape for s in down.addressable_shards} == {(c.hidden_size, 128 // 8)}
    table = sharded.embed_tokens[...]
    assert {s.data.shape for s in table.addressable_shards} == {(96 // 8, c.hidden_size)}
    weights = llama_sharding.per_device_bytes(nnx.state(sharded, nnx.Param))
    total = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4  # replicated
    copies = 2 * c.num_hidden_layers * (8 - 2) * 8 * c.hidden_size * 4  # k and v: 8 heads, not 2
    assert weights == {d: (total + copies - norms) // 8 + norms for d in jax.devices()}

    mesh = sharded.mesh
    paged = llama_sharding.create_cache(functools.partial(
        PagedKVCache.create, num_layers=2, num_pages=32, page_size=16, kv_heads=sharded.kv_heads,
        head_dim=8, block_tables=np.zeros((4, 8), np.int32)), mesh)
    assert {s.data.shape for s in paged.k_pages[0].addressable_shards} == {(1, 32, 16, 8)}
    dp_tp = _sharded("8q2kv", "dp=2,tp=4")
    contiguous = llama_sharding.create_cache(functools.partial(
        ContiguousKVCache.create, num_layers=2, batch=4, max_len=64, kv_heads=dp_tp.kv_heads,
        head_dim=8), dp_tp.mesh)
    assert {s.data.shape for s in contiguous.k[1].addressable_shards} == {(2, 64, 1, 8)}
    assert set(llama_sharding.per_device_bytes(contiguous).values()) == {
        2 * 2 * (2 * 64 * 1 * 8 * 4) + 4 * 4}  # k and v of 2 layers, plus replicated lengths


_COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _decode_collectives(layers, mesh, cache):
    config = llama.LlamaConfig(**{**CONFIGS["8q2kv"].__dict__, "num_hidden_layers": layers,
                                  "rope_scaling": None})
    model = llama_sharding.shard(llama.Llama(config, rngs=nnx.Rngs(0)), sharding.make_mesh(mesh))
    m = model.mesh
    if cache == "paged":
        make = functools.partial(PagedKVCache.create, num_pages=16, page_size=8,
                                 block_tables=np.zeros((2, 8), np.int32))
    else:
        make = functools.partial(ContiguousKVCache.create, batch=2, max_len=32)
    kv = llama_sharding.create_cache(functools.partial(
        make, num_layers=layers, kv_heads=model.kv_heads, head_dim=8), m)
    graphdef, state = nnx.split(model)
    rep = lambda a: sharding.put(a, m.replicated())
    params = {name: rep(np.asarray(value))
              for name, value in sampling_lib.SamplingParams().arrays().items()}
    seen = rep(np.zeros((2, config.vocab_size), bool))
    compiled = steps.decode_step.lower(
        state, kv, rep(np.zeros(2, np.int32)), sharding.put(np.ones(2, bool), m.sharding(
            m.batch_axis(2))), jax.random.key(0), rep(np.int32(1)), params, seen,
        graphdef=graphdef, greedy=sampling_lib.SamplingParams().greedy).compile()
    text = compiled.as_text()
    lines = [line for line in text.splitlines() if _COLLECTIVE.search(line)]
    return collections.Counter(_COLLECTIVE.search(line).group(1) for line in lines), lines


@pytest.mark.parametrize("mesh,cache", [("tp=4", "paged"), ("tp=8", "contiguous"),
                                        ("dp=2,tp=4", "contiguous"), ("dp=2,tp=4", "paged")])
def test_one_all_reduce_after_attention_and_one_after_the_mlp_per_layer(mesh, cache):
    two, _ = _decode_collectives(2, mesh, cache)
    three, lines = _decode_collectives(3, mesh, cache)
    per_layer = three - two
    assert per_layer["all-reduce"] == 2, (per_layer, lines)
    if cache == "paged" and mesh.startswith("dp"):
        # The pool is shared by all sequences, so it is replicated over the data axis and
        # every replica writes every new token: the tokens' K/V (and slots) are gathered
        # over dp by the writes, and nothing else is: every per-layer gather is of one new
        # token per row, [batch=2, 1, ...], never of the pool. (Told apart by shape: the
        # op_name XLA gives a gather names the op that made its operand, which moved from
        # the cache write's reshape in JAX 0.10 to the QKV split in 0.12.)
        gathers = [line for line in lines if "all-gather" in line and "layer_" in line]
        shapes = [tuple(int(d) for d in re.search(r"= \w+\[([\d,]*)\]", g).group(1).split(","))
                  for g in gathers]
        assert shapes and all(shape[:2] == (2, 1) for shape in shapes), gathers
        assert per_layer == collections.Counter({"all-reduce": 2, "all-gather": 3}), per_layer
    else:
        assert set(per_layer) == {"all-reduce"}, (per_layer, lines)


def test_dp_only_needs_no_collective_per_layer():
    two, _ = _decode_collectives(2, "dp=8", "contiguous")
    three, _ = _decode_collectives(3, "dp=8", "contiguous")
    assert three - two == collections.Counter()


def test_every_op_with_a_kernel_has_a_partition_rule():
    for op in dispatch.ops():
        kernels = [r.name for r in dispatch.registrations(op) if r.name != "xla"]
        if kernels:
            assert sharding.has_rule(op), (op, kernels)


def test_kernels_run_per_shard_and_see_shard_shapes():
    seen = []

    def supports(args, platform):
        seen.append(("supports", tuple(args["q"].shape), tuple(args["k"].shape)))

    @dispatch.register("attention", "spy", supports=supports, replace=True)
    def spy(q, k, v, **kw):
        seen.append(("call", tuple(q.shape), tuple(k.shape)))
        return fj.attention(q, k, v, **kw, implementation="xla")

    try:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((4, 6, 8, 16)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((4, 6, 4, 16)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((4, 6, 4, 16)), jnp.float32)
        ref = fj.attention(q, k, v, implementation="xla")
        with sharding.use_mesh(sharding.make_mesh("dp=2,tp=4")):
            out = jax.jit(lambda q, k, v: fj.attention(q, k, v, implementation="spy"))(q, k, v)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
        assert ("supports", (2, 6, 2, 16), (2, 6, 1, 16)) in seen
        assert ("call", (2, 6, 2, 16), (2, 6, 1, 16)) in seen
        assert out.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(out.sharding.mesh, P("dp", None, "tp", None)), 4)
    finally:
        dispatch.unregister("attention", "spy")


def test_sharded_model_with_the_gpu_kernels_in_interpret_mode():
    """rms_norm, rope, silu_mul and paged attention as Pallas kernels, per shard."""
    sharded = _sharded("8q2kv", "dp=2,tp=4")
    with fj.use_implementation("pallas_gpu_interpret", strict=False):
        fj.dispatch.clear_selections()
        out = llama.generate(sharded, PROMPTS, 3)
        used = {op: s.implementation for op, s in fj.dispatch.last_selections().items()}
    assert used["paged_attention"] == used["rms_norm"] == used["rope"] == "pallas_gpu_interpret"
    assert out == [t[:3] for t in _reference_tokens("8q2kv", "paged")]


def test_from_pretrained_on_a_mesh_reads_only_each_devices_slice(tmp_path, monkeypatch):
    import safetensors
    from safetensors.numpy import save_file

    model = _model("8q2kv")
    save_file(llama.hf_state_dict(model), str(tmp_path / "model.safetensors"))
    config = {k: v for k, v in CONFIGS["8q2kv"].__dict__.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "architectures": ["LlamaForCausalLM"]}))
    read = collections.Counter()
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.file = real_open(*a, **kw)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            inner = self.file.get_slice(name)

            class Slice:
                get_shape, get_dtype = inner.get_shape, inner.get_dtype

                def __getitem__(self, index):
                    block = inner[index]
                    read[name] += block.size
                    return block
            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    sharded = llama.from_pretrained(tmp_path, mesh=sharding.make_mesh("tp=4"))
    # Each distinct shard was read once, and nothing else: the elements read sum to the
    # sizes of the distinct slices the devices hold (a replicated norm is read once).
    held = sum(np.empty(x.shape)[index].size
               for x in jax.tree.leaves(nnx.state(sharded, nnx.Param))
               for index in {tuple((s.start, s.stop) for s in idx): idx for idx in
                             x.sharding.devices_indices_map(x.shape).values()}.values())
    assert sum(read.values()) == held
    q_rows = 8 * 8 // 4  # one device's query heads of one layer
    assert read["model.layers.0.self_attn.q_proj.weight"] == 4 * q_rows * 64
    assert llama.generate(sharded, PROMPTS, 6) == _reference_tokens("8q2kv", "paged")
    with pytest.raises(ValueError, match="num_attention_heads=8 does not split"):
        llama.from_pretrained(tmp_path, mesh=sharding.make_mesh({"tp": 3}))


_WORKER = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2,
                           process_id=int(sys.argv[1]), initialization_timeout=60)
sys.path.insert(0, sys.argv[3])
from test_sharding import PROMPTS, _model
from forge_jax import sharding
from forge_jax.models import llama, llama_sharding
model = llama_sharding.shard(_model("8q2kv"), sharding.make_mesh("tp=4"))
tokens = {c: llama.generate(model, PROMPTS, 6, cache=c) for c in ("paged", "contiguous")}
print("RESULT " + json.dumps({"devices": jax.device_count(), "local": jax.local_device_count(),
                              "tokens": tokens}), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_form_one_mesh_and_generate_the_same_tokens(tmp_path):
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        pytest.skip("this jaxlib has no CPU collectives for several processes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    tests_dir = str(pathlib.Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), address, tests_dir],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    for r in results:
        assert (r["devices"], r["local"]) == (4, 2)
        assert r["tokens"] == {c: _reference_tokens("8q2kv", c) for c in ("paged", "contiguous")}
