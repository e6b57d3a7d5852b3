"""Qwen3-Next and Qwen3.5 text (models/qwen3_next.py) against Hugging Face transformers on
random-weight checkpoints transformers wrote (``cases/qwen3_next.py``). Prompts are longer
than the convolution's kernel and span several delta-rule chunks (chunk size 8).

Logits within the float32 tolerance of transformers', without a cache and through the
hybrid cache (contiguous and paged attention caches, the state pool), prefilled at once and
in pieces; greedy continuations identical to transformers' ``generate``.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.hf_families import LOGITS_TOL, hf_greedy, hf_logits
from cases.qwen3_next import BASE, CASES, VOCAB, write
from flax import nnx

import forge_jax as fj
from forge_jax.kv_cache import ContiguousKVCache, HybridCache, PagedKVCache
from forge_jax.models import llama
from forge_jax.models import qwen3_next_checkpoint as checkpoint
from forge_jax.models.qwen3_next import Qwen3Next
from forge_jax.models.qwen3_next_config import Qwen3NextConfig

CHUNK = 8  # the delta rule's prefill chunk: a 21-token prompt spans 3 chunks
SEQ = 21
MAX_LEN = 32  # every test's cache: one compiled step per input shape


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory, hf):
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    ref = write(name, directory)
    model = checkpoint.from_pretrained(directory, chunk_size=CHUNK)
    return name, pathlib.Path(directory), ref, model


def _tokens(seed=1, batch=2, seq=SEQ):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq))


def _hybrid(model: Qwen3Next, kind: str, batch: int, max_len: int, page_size: int = 4
            ) -> HybridCache:
    c = model.config
    geometry = dict(num_layers=model.num_attention_layers, kv_heads=model.kv_heads,
                    head_dim=c.head_dim, dtype=model.dtype)
    if kind == "contiguous":
        attention = ContiguousKVCache.create(batch=batch, max_len=max_len, **geometry)
    else:
        pages = -(-max_len // page_size)
        # Rows' pages interleaved, so that a row reading another's pages would show.
        tables = np.arange(batch * pages).reshape(pages, batch).T
        attention = PagedKVCache.create(num_pages=batch * pages, page_size=page_size,
                                        block_tables=tables, **geometry)
    return model.hybrid_cache(attention)


@functools.partial(jax.jit, static_argnames=("graphdef", "empty_cache"))
def _forward_cached(state, tokens, positions, valid, cache, logits_at, *, graphdef,
                    empty_cache):
    return nnx.merge(graphdef, state).forward_cached(
        tokens, positions, valid, cache, logits_at=logits_at, empty_cache=empty_cache)


def _step(model: Qwen3Next, empty_cache=False):
    """The model's jitted cached forward (compiled once per shape for the whole module)."""
    graphdef, state = nnx.split(model)
    return lambda *args: _forward_cached(state, *args, graphdef=graphdef,
                                         empty_cache=empty_cache)


def _greedy(model: Qwen3Next, prompts: list[list[int]], steps: int, kind: str) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (right-padded into one prefill) through the
    model's cached forward."""
    batch, longest = len(prompts), max(map(len, prompts))
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((batch, longest), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    positions = np.broadcast_to(np.arange(longest, dtype=np.int32), (batch, longest))
    cache = _hybrid(model, kind, batch, MAX_LEN)
    logits, cache = _step(model, empty_cache=True)(
        tokens, positions, positions < lengths[:, None], cache, lengths - 1)
    out = [np.asarray(jnp.argmax(logits, -1))]
    decode = _step(model)
    for _ in range(steps - 1):
        logits, cache = decode(out[-1][:, None].astype(np.int32), np.asarray(cache.lengths)[
            :, None], np.ones((batch, 1), bool), cache, np.zeros((batch,), np.int32))
        out.append(np.asarray(jnp.argmax(logits, -1)))
    return np.stack(out, 1).tolist()


def test_config_reads_the_checkpoint(family):
    name, directory, _, model = family
    c = model.config
    assert c.kinds == ("linear", "linear", "linear", "attention")
    assert c.rotary_dim == 4 and c.linear.chunk_size == CHUNK
    assert model.num_attention_layers == 1
    if name == "qwen3_next":
        assert [c.is_moe(i) for i in range(4)] == [True, False, True, True]
        assert type(model.layers[1].mlp).__name__ == "LlamaMLP"
        assert type(model.layers[0].mlp).__name__ == "SparseMoe"
    else:
        assert c.num_experts == 0


def test_logits_match_transformers(family):
    _, _, ref, model = family
    tokens = _tokens()
    want = hf_logits(ref, tokens)
    got = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(want).max() > 1.0  # random weights large enough to be far from uniform
    np.testing.assert_allclose(got, want, **LOGITS_TOL.as_kwargs())


# The contiguous cache's runs in the slow leg (the paged ones in the default run).
KINDS = ["paged", pytest.param("contiguous", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind", KINDS)
def test_cached_prefill_at_once_and_in_pieces_match_transformers(family, kind):
    """The whole prompt through the hybrid cache, then the same prompt in pieces (13 tokens,
    5, then one at a time): every position's logits are transformers'."""
    _, _, ref, model = family
    tokens = _tokens(seed=2)
    want = hf_logits(ref, tokens)
    batch = tokens.shape[0]
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (batch, SEQ))
    step = _step(model)
    logits, cache = step(tokens, positions, np.ones_like(positions, bool),
                         _hybrid(model, kind, batch, MAX_LEN), None)
    np.testing.assert_allclose(np.asarray(logits), want, **LOGITS_TOL.as_kwargs())
    assert np.asarray(cache.lengths).tolist() == [SEQ] * batch
    cache, pieces = _hybrid(model, kind, batch, MAX_LEN), []
    for start, stop in ((0, 13), (13, 18), (18, 19), (19, 20), (20, 21)):
        logits, cache = step(tokens[:, start:stop], positions[:, start:stop],
                             np.ones((batch, stop - start), bool), cache, None)
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, 1), want, **LOGITS_TOL.as_kwargs())


def test_padded_rows_leave_states_alone(family):
    """A row whose tokens are all padding (``valid`` False) keeps its delta-rule states and
    its KV length: the next real tokens continue it as if the padded step never ran."""
    _, _, ref, model = family
    tokens = _tokens(seed=3, seq=12)
    want = hf_logits(ref, tokens)
    step = _step(model)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    cache = _hybrid(model, "paged", 2, MAX_LEN)
    # Row 1 gets only 7 tokens at first (right padding), then its last 5 alone.
    valid = np.stack([np.ones(12, bool), np.arange(12) < 7])
    logits, cache = step(tokens, positions, valid, cache, None)
    np.testing.assert_allclose(np.asarray(logits)[0], want[0], **LOGITS_TOL.as_kwargs())
    np.testing.assert_allclose(np.asarray(logits)[1, :7], want[1, :7], **LOGITS_TOL.as_kwargs())
    assert np.asarray(cache.lengths).tolist() == [12, 7]
    rest = np.zeros((2, 5), np.int32)
    rest[1] = tokens[1, 7:]
    logits, cache = step(rest, np.asarray(cache.lengths)[:, None] + np.arange(5, dtype=np.int32),
                         np.stack([np.zeros(5, bool), np.ones(5, bool)]), cache, None)
    np.testing.assert_allclose(np.asarray(logits)[1], want[1, 7:], **LOGITS_TOL.as_kwargs())
    assert np.asarray(cache.lengths).tolist() == [12, 12]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_generate(family, kind):
    _, _, ref, model = family
    tokens = _tokens(seed=4)
    prompts = [tokens[0].tolist(), tokens[1, :11].tolist()]
    want = [hf_greedy(ref, p, 8) for p in prompts]
    assert _greedy(model, prompts, 8, kind) == want


def test_quantized_load(family):
    """``quantize="int8"``: every linear kernel and the experts int8, the rest float. The
    logits are those of the float model holding the dequantized weights (the same numbers,
    another order: the parity tolerance), and near the float model's."""
    from forge_jax.models.checkpoints import quantize as quantize_load

    name, directory, _, model = family
    q = checkpoint.from_pretrained(directory, chunk_size=CHUNK, quantize="int8")
    layer = q.layers[0]
    assert isinstance(layer.linear_attn.in_proj_qkv.kernel.get_value(), fj.QuantizedArray)
    assert isinstance(q.layers[3].self_attn.qkv_proj.kernel.get_value(), fj.QuantizedArray)
    assert isinstance(q.lm_head.kernel.get_value(), fj.QuantizedArray)
    assert not isinstance(layer.linear_attn.conv_weight.get_value(), fj.QuantizedArray)
    if name == "qwen3_next":
        assert isinstance(layer.mlp.w_gate.get_value(), fj.QuantizedArray)
        assert not isinstance(layer.mlp.router.get_value(), fj.QuantizedArray)
    dequantized = checkpoint.from_pretrained(directory, chunk_size=CHUNK)
    pairs = list(zip(quantize_load.linear_kernels(dequantized) + quantize_load.expert_kernels(
        dequantized), quantize_load.linear_kernels(q) + quantize_load.expert_kernels(q),
        strict=True))
    assert all(isinstance(k.get_value(), fj.QuantizedArray) for _, k in pairs)
    for mine, quantized in pairs:
        value = fj.dequantize(quantized.get_value())
        if value.ndim == 3:  # experts: quantized as HF's [experts, out, in]
            value = jnp.swapaxes(value, 1, 2)
        mine.set_value(value)
    tokens = jnp.asarray(_tokens(seed=5), jnp.int32)
    got = np.asarray(jax.jit(lambda t: q(t))(tokens))
    np.testing.assert_allclose(got, np.asarray(dequantized(tokens)), **LOGITS_TOL.as_kwargs())
    full = np.asarray(model(tokens))
    err = np.linalg.norm(got - full) / np.linalg.norm(full)
    # (Qwen3-Next: rounded weights move some router logits past each other, and those
    # tokens go to other experts: 6.4% measured, against 1-3% for the dense Qwen3.5.)
    assert 0 < err < (0.15 if name == "qwen3_next" else 0.05), err
    assert np.mean(got.argmax(-1) == full.argmax(-1)) > 0.8


def test_llama_loader_points_to_this_model(family):
    _, directory, _, _ = family
    with pytest.raises(ValueError, match="qwen3_next_checkpoint.from_pretrained"):
        llama.from_pretrained(directory)


# ---------------------------------------------------------------------------------------
# The config: every transformers field known; refusals name the key.

@pytest.mark.parametrize("name", sorted(CASES))
def test_every_transformers_config_field_is_known(name, hf):
    from forge_jax.models import qwen3_next_config as qc

    _, transformers = hf
    fields = set(getattr(transformers, CASES[name][0])().to_dict())
    assert sorted(fields - qc.HANDLED[name] - qc.IRRELEVANT - set(qc.REFUSED)) == []


def _config(name="qwen3_5_text", **changes):
    return {**BASE, "model_type": name, "architectures": [CASES[name][1]], **CASES[name][2],
            **changes}


@pytest.mark.parametrize("changes, match", [
    (dict(use_sliding_window=True), "use_sliding_window=True"),
    (dict(attn_output_gate=False), "attn_output_gate=False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(some_new_switch=1), "unsupported config key 'some_new_switch'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope parameters"),
    (dict(architectures=["Qwen3NextForCausalLM"]), "forge_jax reads Qwen3_5ForCausalLM"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types="),
    (dict(linear_num_key_heads=3), "linear_num_value_heads=4 must be a multiple"),
])
def test_config_refusals_name_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        Qwen3NextConfig.from_hf(_config(**changes))


def test_config_defaults_and_harmless_keys():
    config = _config(layer_types=None, full_attention_interval=2, mtp_num_hidden_layers=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                      "partial_rotary_factor": 0.5,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    c = Qwen3NextConfig.from_hf({k: v for k, v in config.items() if v is not None})
    assert c.layer_types == ("linear_attention", "full_attention") * 2
    assert (c.rope_theta, c.rotary_dim) == (5e6, 8)
    with pytest.raises(ValueError, match="lacks num_experts"):
        Qwen3NextConfig.from_hf({k: v for k, v in _config("qwen3_next").items()
                                 if k != "num_experts"})


def test_unexpected_and_missing_tensors_are_named(family, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, directory, _, _ = family
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, "model.layers.0.extra.weight": np.ones(2, np.float32)},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.extra.weight'"):
        checkpoint.from_pretrained(tmp_path)
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'model.layers.3.self_attn.k_norm"):
        checkpoint.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4
