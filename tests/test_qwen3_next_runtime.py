"""The runtime drives Qwen3-Next and Qwen3.5 text through the model contract
(``forge_jax.models.protocol``): the common entry point loads them, ``generate`` runs them with
each attention cache (the delta-rule layers on the state pool) and matches transformers'
greedy tokens (the serving engine: ``tests/test_qwen3_next_engine.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from cases.hf_families import hf_greedy
from cases.qwen3_next import CASES, write

from forge_jax import generation
from forge_jax.kv_cache import CacheSpec, HybridCache
from forge_jax.models import llama
from forge_jax.models import qwen3_next_checkpoint as checkpoint
from forge_jax.models.qwen3_next import Qwen3Next

# Longer than the convolution's kernel, and than a chunk of 8; of different lengths (the
# shorter right-padded in the prefill).
PROMPTS = [[5, 17, 3, 44, 9, 12, 60, 2, 31, 7, 8, 70, 33, 21, 19, 4, 4, 80, 1, 6],
           [11, 4, 90, 23, 6, 50, 12, 2, 41, 3]]


@pytest.fixture(scope="module", params=sorted(CASES))
def runtime_model(request, tmp_path_factory, hf):
    directory = tmp_path_factory.mktemp(request.param)
    ref = write(request.param, directory)
    want = [hf_greedy(ref, p, 8) for p in PROMPTS]
    return checkpoint.from_pretrained(directory, chunk_size=8), want, directory


def test_the_common_entry_point_loads_it(runtime_model):
    from forge_jax.models.protocol import CausalLM, ModelConfig

    model, _, directory = runtime_model
    loaded = llama.from_pretrained(directory)
    assert isinstance(loaded, Qwen3Next) and loaded.config.model_type == model.config.model_type
    assert isinstance(model, CausalLM) and isinstance(model.config, ModelConfig)
    with pytest.raises(TypeError, match="mesh must be"):
        llama.from_pretrained(directory, mesh=object())


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_generate_matches_transformers_with_each_cache(runtime_model, kind):
    model, want, _ = runtime_model
    got, stats = generation.generate_with_stats(model, PROMPTS, 8, eos_token_id=(),
                                                cache=CacheSpec(kind, page_size=4))
    assert got == want
    cache = model.create_cache(CacheSpec(kind, page_size=4), batch=stats.padded_batch,
                               max_len=stats.cache_len,
                               num_pages=stats.padded_batch * (-(-stats.cache_len // 4)),
                               block_tables=np.zeros((stats.padded_batch, -(-stats.cache_len
                                                                             // 4)), np.int32))
    assert isinstance(cache, HybridCache) and stats.cache_bytes == cache.nbytes


def test_generate_stops_at_eos(runtime_model):
    model, want, _ = runtime_model
    eos = want[0][3]
    got = generation.generate(model, PROMPTS[:1], 8, eos_token_id=eos)
    assert got == [want[0][:want[0].index(eos) + 1]]


def test_forge_jax_generate_runs_it(tmp_path, tokenizer_files, capsys):
    """``forge-jax generate`` on a Qwen3-Next directory with a tokenizer: the config read as
    the family's, the model through the common entry point."""
    from cases import qwen3_next
    from cases.cli import run

    tokenizer_dir, vocab = tokenizer_files
    config_cls, model_cls, extra = CASES["qwen3_next"]
    qwen3_next.save_checkpoint(tmp_path, config_cls, model_cls,
                               dict(qwen3_next.BASE, **extra, vocab_size=vocab), seed=0,
                               gemma_norms=True, tokenizer=tokenizer_dir)
    rc, out, err = run(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt",
                       "Hello there", "--max-new-tokens", "3", "--no-stream")
    assert rc == 0, err
    assert out.strip() and "qwen3_next, 4 layers" in out + err, (out, err)


@pytest.mark.parametrize("runtime_model", ["qwen3_next", pytest.param(
    "qwen3_5_text", marks=pytest.mark.slow)], indirect=True)
def test_forge_jax_generate_quantized_gives_the_python_tokens(runtime_model, capsys):
    """``forge-jax generate --quantize int4 --group-size 8``: the ids of Python's
    ``generate`` on the model ``from_pretrained(quantize=, group_size=)`` loads; a group
    that does not divide the delta-rule layers' value width (32) is refused first."""
    import re

    from cases.cli import assert_one_line_error, run

    _, _, directory = runtime_model
    args = ("generate", "--checkpoint", str(directory), "--prompt-ids",
            ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "5", "--no-compilation-cache",
            "--quantize", "int4")
    rc, out, err = run(capsys, *args, "--group-size", "8")
    assert rc == 0, err
    [line] = [x for x in out.splitlines() if x.startswith("generated ids:")]
    quantized = llama.from_pretrained(directory, quantize="int4", group_size=8)
    [want] = generation.generate(quantized, PROMPTS[:1], 5, eos_token_id=())
    assert [int(t) for t in re.findall(r"-?\d+", line.split(":", 1)[1])] == want
    assert_one_line_error(run(capsys, *args, "--group-size", "64"), "--group-size 64", "32")


def test_speculative_decoding_is_refused(runtime_model):
    from forge_jax.generation.speculative import SpeculativeConfig

    model, _, _ = runtime_model
    with pytest.raises(ValueError, match="cannot be rolled back"):
        generation.generate_with_stats(model, PROMPTS, 4, eos_token_id=(),
                                       speculative=SpeculativeConfig())
