"""Qwen3-Next and Qwen3.5 text through the serving engine with prefix caching off: each
running request's delta-rule states in a slot of the model's state pool, the packed step's
linear layers run per sequence. Concurrent requests of different lengths, arriving at
different steps, prefilled in chunks and reusing finished requests' slots, give transformers'
greedy tokens; prefix caching and speculative decoding are refused with the reason; ``forge-jax
serve --no-prefix-caching`` answers as ``generate`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.hf_families import hf_greedy
from cases.qwen3_next import BASE, CASES, VOCAB, save_checkpoint, write

from forge_jax import generation
from forge_jax.kv_cache import (
    CacheSpec,
    RaggedMetadata,
    RaggedStatePool,
    RecurrentStatePool,
    StateCache,
)
from forge_jax.models import qwen3_next_checkpoint as checkpoint

# Of different lengths: all longer than the convolution's kernel (4), three than a delta-rule
# chunk (8); the first longer than a step's 16 tokens (prefilled in three chunks, the later
# ones continuing from its saved states).
_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(1, VOCAB, n).tolist() for n in (37, 20, 11, 6)]
NEW_TOKENS = 8


# Qwen3-Next's (a mixture of experts beside the same layers) compiles for longer: with the
# slow tests.
@pytest.fixture(scope="module", params=[
    "qwen3_5_text", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def served(request, tmp_path_factory, hf):
    directory = tmp_path_factory.mktemp(request.param)
    ref = write(request.param, directory)
    want = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    return checkpoint.from_pretrained(directory, chunk_size=8), want


def _engine(model, **overrides):
    from forge_jax.serving import Engine, EngineConfig

    config = dict(max_batch_tokens=16, num_pages=64, max_seqs=2, eos_token_ids=(),
                  prefix_caching=False, cache=CacheSpec(page_size=4))
    return Engine(model, None, EngineConfig(**dict(config, **overrides)))


def test_concurrent_requests_give_transformers_greedy_tokens(served):
    """Two slots for four requests: the third and fourth wait for a slot and take those of
    finished requests (states left in them by their last owners); the first is prefilled in
    three steps, beside the second's prefill and decodes."""
    from forge_jax.serving import RequestParams

    model, want = served
    engine = _engine(model)
    assert engine.state_slots.capacity == 2 and engine.cache.max_sequences == 2
    slots = {}  # request id -> the slots it ran in
    assign = engine.state_slots.assign

    def recording(scheduled, manager):
        out = assign(scheduled, manager)
        for (r, _), slot in zip(scheduled, out, strict=True):
            slots.setdefault(r.id, set()).add(slot)
        return out

    engine.state_slots.assign = recording
    params = RequestParams(max_tokens=NEW_TOKENS)
    streams = [engine.submit(PROMPTS[0], params)]
    engine.step()
    engine.step()  # the first request's second chunk
    streams.append(engine.submit(PROMPTS[1], params))
    engine.step()
    streams += [engine.submit(p, params) for p in PROMPTS[2:]]
    running = []
    while engine.has_work():
        engine.step()
        running.append(len(engine._running))
    assert max(running) <= 2
    got = [[t for out in s for t in out.token_ids] for s in streams]
    assert got == want
    # Each request kept one slot; four requests over two slots: the later took finished ones'.
    assert sorted(len(v) for v in slots.values()) == [1] * 4
    assert set().union(*slots.values()) == {0, 1}


@pytest.mark.slow  # (its own step shapes to compile)
def test_a_preempted_request_restarts_from_zero_states(served):
    """A pool too small for the two longest requests at once: the newer is preempted, its
    slot freed, and it is recomputed from its prompt (position 0: zero states) later."""
    from forge_jax.serving import RequestParams

    model, want = served
    engine = _engine(model, num_pages=14)
    params = RequestParams(max_tokens=NEW_TOKENS)
    streams = [engine.submit(p, params) for p in PROMPTS[:2]]
    while engine.has_work():
        engine.step()
    assert engine.stats.preemptions > 0
    assert [[t for out in s for t in out.token_ids] for s in streams] == want[:2]


def test_prefix_caching_is_refused_with_the_reason(served):
    model, _ = served
    with pytest.raises(ValueError, match="cannot be shared page by page") as e:
        _engine(model, prefix_caching=True)
    assert "\n" not in str(e.value) and "qwen3" in str(e.value)


def test_speculative_decoding_is_refused_with_the_reason(served):
    from forge_jax.generation.speculative import SpeculativeConfig

    model, _ = served
    with pytest.raises(ValueError, match="cannot be rolled back"):
        _engine(model, speculative=SpeculativeConfig())


def test_the_pool_needs_a_slot_count(served):
    model, _ = served
    with pytest.raises(ValueError, match="max_seqs"):
        model.create_pool(CacheSpec(page_size=4), num_pages=8, pages_per_seq=4)


def _pool(rng, num_slots=5, layers=2) -> RecurrentStatePool:
    pool = RecurrentStatePool.create(num_layers=layers, num_slots=num_slots, conv_kernel=4,
                                     conv_dim=6, v_heads=2, k_head_dim=3, v_head_dim=4)
    return RecurrentStatePool(
        conv=tuple(jnp.asarray(rng.normal(size=c.shape), c.dtype) for c in pool.conv),
        state=tuple(jnp.asarray(rng.normal(size=s.shape), s.dtype) for s in pool.state),
        slots=pool.slots, lengths=pool.lengths)


def _metadata(rows, slots, kv_lengths, num_seqs):
    """A packed step's metadata (the attention fields the state pool reads)."""
    rows = np.asarray(rows, np.int32)
    q = (rows >= 0).sum(1)
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return RaggedMetadata(block_tables=np.zeros((len(q), 1), np.int32),
                          kv_lengths=np.asarray(kv_lengths, np.int32), cu_q_lens=cu,
                          num_seqs=np.int32(num_seqs),
                          state_slots=np.asarray(slots, np.int32), segment_rows=rows)


def test_the_packed_view_reads_and_writes_only_the_step_sequences_slots():
    """Sequence 0 (slot 3) continues at position 5, sequence 1 (slot 1) starts at position 0
    (reads zeros, whatever its slot holds), grid row 2 is padding; slots 0, 2 and 4 are
    neither read nor written."""
    rng = np.random.default_rng(0)
    pool = _pool(rng)
    rows = [[0, 1, 2], [3, 4, -1], [-1, -1, -1]]
    packed = RaggedStatePool.from_pool(pool, _metadata(rows, [3, 1, -1], [8, 2, 0], 2))
    assert isinstance(packed, StateCache) and packed.batch == 1
    conv, state = packed.read(1)
    np.testing.assert_array_equal(conv[0], pool.conv[1][3])
    np.testing.assert_array_equal(state[0], pool.state[1][3])
    assert not np.any(conv[1:]) and not np.any(state[1:])
    np.testing.assert_array_equal(packed.sequence_lengths(None), [3, 2, 0])
    x = jnp.asarray(rng.normal(size=(1, 6, 2, 3)), jnp.float32)  # one padding row, the last
    grid = packed.to_sequences(x)
    np.testing.assert_array_equal(grid[0], x[0, :3])
    np.testing.assert_array_equal(grid[1, :2], x[0, 3:5])
    assert not np.any(grid[1, 2:]) and not np.any(grid[2])
    back = packed.from_sequences(grid, 6)
    np.testing.assert_array_equal(back[0, :5], x[0, :5])
    assert not np.any(back[0, 5])
    new_conv = jnp.asarray(rng.normal(size=conv.shape), conv.dtype)
    new_state = jnp.asarray(rng.normal(size=state.shape), state.dtype)
    out = packed.write_state(1, new_conv, new_state).into_pool(pool)
    for slot, seq in ((3, 0), (1, 1)):
        np.testing.assert_array_equal(out.conv[1][slot], new_conv[seq])
        np.testing.assert_array_equal(out.state[1][slot], new_state[seq])
    for slot in (0, 2, 4):
        np.testing.assert_array_equal(out.conv[1][slot], pool.conv[1][slot])
        np.testing.assert_array_equal(out.state[1][slot], pool.state[1][slot])
    np.testing.assert_array_equal(out.state[0], pool.state[0])  # another layer: untouched
    with pytest.raises(ValueError, match=r"state must be \[seqs, ...\]"):
        packed.write_state(1, new_conv, new_state[:2])


def test_the_packed_view_needs_the_slots_in_the_metadata():
    pool = _pool(np.random.default_rng(1))
    metadata = RaggedMetadata(np.zeros((2, 1), np.int32), np.ones(2, np.int32),
                              np.arange(3, dtype=np.int32), np.int32(2))
    with pytest.raises(ValueError, match="state_slots and segment_rows"):
        RaggedStatePool.from_pool(pool, metadata)
    packed = RaggedStatePool.from_pool(pool, _metadata([[0], [1]], [0, 1], [1, 1], 2))
    jitted = jax.jit(lambda p: p.read(0)[1])(packed)  # a pytree through jit
    assert not np.any(jitted)  # both start at position 0


def test_forge_jax_serve_answers_as_generate(tmp_path, tokenizer_files, capsys, hf):
    """``forge-jax serve --no-prefix-caching`` answers one /v1/completions with the tokens
    ``generate`` gives; with prefix caching (the default) it refuses in one line."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from cases.cli import assert_one_line_error, run

    tokenizer_dir, vocab = tokenizer_files
    config_cls, model_cls, extra = CASES["qwen3_5_text"]
    save_checkpoint(tmp_path, config_cls, model_cls, dict(BASE, **extra, vocab_size=vocab),
                    seed=0, gemma_norms=True, tokenizer=tokenizer_dir)
    capsys.readouterr()  # (transformers' progress bars)
    flags = ["--max-pages", "32", "--page-size", "4", "--max-model-len", "64",
             "--max-batch-tokens", "16", "--no-warm-up", "--no-compilation-cache"]
    assert_one_line_error(run(capsys, "serve", "--checkpoint", str(tmp_path), "--port", "0",
                              *flags), "cannot be shared page by page",
                          "(--no-prefix-caching)", prog="forge-jax serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge_jax.cli", "serve", "--checkpoint", str(tmp_path),
         "--port", str(port), "--no-prefix-caching", *flags],
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    prompt = PROMPTS[1]
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        body = json.dumps({"model": tmp_path.name, "prompt": prompt, "max_tokens": 6,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "qwen3_5_text" in err and "Traceback" not in err, err
    [want] = generation.generate(checkpoint.from_pretrained(tmp_path), [prompt], 6,
                                 eos_token_id=())
    assert choice["token_ids"] == want, choice
