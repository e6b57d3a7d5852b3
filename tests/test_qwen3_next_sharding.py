"""Qwen3-Next and Qwen3.5 text on a CPU mesh (conftest's host-platform devices): loaded from
transformers-written random checkpoints straight into their shards, greedy tokens through
``generate`` with each attention cache equal to transformers'. On a 2x2 mesh (dp=2, tp=2) the
delta-rule layers split by key-head group; on 1x4 (tp=4, more devices than the 2 key heads
and the 2 KV heads) they are replicated and the KV heads copied."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.hf_families import hf_greedy
from cases.qwen3_next import CASES, write
from jax.sharding import PartitionSpec as P

from forge_jax import generation
from forge_jax.kv_cache import CacheSpec
from forge_jax.models import llama, qwen3_next_sharding
from forge_jax.models import qwen3_next_checkpoint as checkpoint

# Longer than the convolution's kernel and than a chunk of 8; the shorter right-padded.
PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 2, 31, 7, 8, 70, 33, 21, 19, 4, 4, 80, 1, 6],
           [11, 4, 90, 23, 6, 50, 12, 2, 41, 3]]
NEW = 6


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory, hf):
    directory = tmp_path_factory.mktemp(request.param)
    ref = write(request.param, directory)
    return request.param, directory, [hf_greedy(ref, p, NEW) for p in PROMPTS]


def _mesh(shape):
    return jax.make_mesh(shape, ("dp", "tp"), devices=jax.devices()[:int(np.prod(shape))])


def _spec(param) -> P:
    return param.get_value().sharding.spec


def _cases():
    """(family, mesh shape, cache kind): both layouts of the delta-rule layers and both
    caches in the default run, every other combination with the slow tests."""
    default = {("qwen3_next", (2, 2), "paged"), ("qwen3_5_text", (1, 4), "contiguous")}
    return [case if case in default else pytest.param(*case, marks=pytest.mark.slow)
            for case in ((name, shape, kind) for name in sorted(CASES)
                         for shape in ((2, 2), (1, 4)) for kind in ("paged", "contiguous"))]


@pytest.mark.parametrize("family, shape, kind", _cases(), indirect=["family"])
def test_generate_on_a_mesh_matches_transformers(family, shape, kind):
    name, directory, want = family
    model = llama.from_pretrained(directory, mesh=_mesh(shape), dtype="float32")
    gdn, attn = model.layers[0].linear_attn, model.layers[3].self_attn
    assert model.mesh is not None and _spec(attn.qkv_proj.kernel) == P("tp", None)
    assert _spec(attn.o_proj.kernel) == P(None, "tp")
    plan = qwen3_next_sharding.plan(model.config, model.mesh)
    if shape == (2, 2):  # 2 key heads over tp=2: by key-head group
        assert plan.linear_replicated is None
        assert _spec(gdn.in_proj_qkv.kernel) == P("tp", None)
        assert _spec(gdn.conv_weight) == P(None, "tp") and _spec(gdn.A_log) == P("tp")
    else:  # tp=4: replicated, with the reason; KV heads stored twice
        assert "cannot be split" in plan.linear_replicated
        assert gdn.in_proj_qkv.kernel.get_value().sharding.is_fully_replicated
        assert model.kv_heads == 4
    if name == "qwen3_next":  # whole experts per device
        assert _spec(model.layers[0].mlp.w_gate) == P("tp", None, None)
    got, stats = generation.generate_with_stats(model, PROMPTS, NEW, eos_token_id=(),
                                                cache=CacheSpec(kind, page_size=4))
    assert got == want
    cache = model.create_cache(CacheSpec(kind, page_size=4), batch=stats.padded_batch,
                               max_len=stats.cache_len, num_pages=8,
                               block_tables=np.zeros((stats.padded_batch, 2), np.int32))
    state = cache.linear.state[0]
    split = shape == (2, 2)
    assert tuple(state.sharding.spec)[:2] == (("dp", "tp") if split else (None, None))
    local = state.addressable_shards[0].data.shape
    assert local[:2] == ((1, 2) if split else (2, 4)), local  # [slots, v_heads] per device
    assert model.cache_bytes(CacheSpec(kind, page_size=4), batch=stats.padded_batch,
                             max_len=stats.cache_len, num_pages=8) == sum(
        s.data.nbytes for leaf in jax.tree.leaves(cache)
        if jnp.issubdtype(leaf.dtype, jnp.floating) for s in leaf.addressable_shards[:1])


@pytest.mark.parametrize("family, shape", [
    ("qwen3_5_text", (2, 2)), pytest.param("qwen3_5_text", (1, 4), marks=pytest.mark.slow),
    pytest.param("qwen3_next", (2, 2), marks=pytest.mark.slow)], indirect=["family"])
def test_the_engine_on_a_mesh_matches_transformers(family, shape):
    """The serving engine over the sharded model: two state slots (split over dp=2 on the
    2x2 mesh) for the two requests, the 20-token prompt prefilled in two chunks."""
    from forge_jax.serving import Engine, EngineConfig, RequestParams

    _, directory, want = family
    model = checkpoint.from_pretrained(directory, chunk_size=8, mesh=_mesh(shape))
    engine = Engine(model, None, EngineConfig(
        max_batch_tokens=16, num_pages=32, max_seqs=2, eos_token_ids=(), prefix_caching=False,
        cache=CacheSpec(page_size=4)))
    state = engine.cache.linear.state[0]
    assert tuple(state.sharding.spec)[:2] == (("dp", "tp") if shape == (2, 2) else (None, None))
    streams = [engine.submit(p, RequestParams(max_tokens=NEW)) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    assert [[t for out in s for t in out.token_ids] for s in streams] == want


def test_sizes_that_do_not_split_are_refused_before_reading(family):
    _, directory, _ = family
    with pytest.raises(ValueError, match=r"divide by 8: \{'num_attention_heads': 4"):
        checkpoint.from_pretrained(directory, mesh=_mesh((1, 8)))
    with pytest.raises(TypeError, match="mesh must be"):
        checkpoint.from_pretrained(directory, mesh=object())


@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("qwen3_5_text",
                                                                 marks=pytest.mark.slow)],
                         indirect=True)
def test_quantized_on_a_mesh(family):
    """int8 on a 2x2 mesh gives the tokens of the same int8 model on one device: the kernels
    split with their scales (Qwen3-Next's quantized experts by expert, as the Llama family's)."""
    import forge_jax as fj

    name, directory, _ = family
    model = checkpoint.from_pretrained(directory, quantize="int8", mesh=_mesh((2, 2)),
                                       chunk_size=8)
    kernel = model.layers[0].linear_attn.in_proj_qkv.kernel.get_value()
    assert isinstance(kernel, fj.QuantizedArray)
    assert kernel.values.sharding.spec == P("tp", None)
    one = checkpoint.from_pretrained(directory, quantize="int8", chunk_size=8)
    want = generation.generate(one, PROMPTS, NEW, eos_token_id=())
    assert generation.generate(model, PROMPTS, NEW, eos_token_id=()) == want


def test_forge_jax_generate_checks_the_mesh_by_the_family_rules(family, capsys):
    """``--mesh tp=8``: refused in one line naming the heads, before loading."""
    from cases.cli import assert_one_line_error, run

    _, directory, _ = family
    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(directory), "--prompt-ids",
                              "1,2,3", "--mesh", "tp=8"),
                          "--mesh tp=8", "{'num_attention_heads': 4")


@pytest.mark.slow
def test_forge_jax_generate_on_a_mesh_gives_the_tokens(family, capsys):
    import re

    from cases.cli import run

    _, directory, want = family
    rc, out, err = run(capsys, "generate", "--checkpoint", str(directory), "--prompt-ids",
                       ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(NEW), "--mesh",
                       "dp=2,tp=2", "--no-compilation-cache")
    assert rc == 0, err
    [line] = [x for x in out.splitlines() if x.startswith("generated ids:")]
    assert [int(t) for t in re.findall(r"-?\d+", line.split(":", 1)[1])] == want[0]
