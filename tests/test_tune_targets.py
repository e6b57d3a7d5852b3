"""``forge-jax tune`` tunes what ``generate`` runs: ``llama_ops.op_calls`` gives exactly the
(op, argument signature) pairs the model dispatches during a generate (attention at the
prefill's shapes, paged attention at decode's, paged writes, matmuls, embeddings), at the
model's dtype."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forge_jax import cli, dispatch
from forge_jax.autotune_cache import signature
from forge_jax.generation import op_shapes as llama_ops
from forge_jax.models import llama


def _dispatched(monkeypatch, model, prompts, max_new_tokens):
    """The (op, signature) pairs the model dispatches in one generate call."""
    seen = set()
    call = dispatch.call

    def recording(op, args, implementation=None):
        seen.add((op, signature(args)))
        return call(op, args, implementation)

    monkeypatch.setattr(dispatch, "call", recording)
    jax.clear_caches()  # steps compiled by earlier tests would not dispatch (trace) again
    llama.generate_with_stats(model, prompts, max_new_tokens)
    return seen


def _planned(config, **kw):
    calls = llama_ops.op_calls(config, rng=np.random.default_rng(0), **kw)
    keys = [(op, signature(dispatch.bind(op, *args, **kwargs))) for op, args, kwargs in calls]
    assert len(keys) == len(set(keys)), "op_calls repeats a call"
    return set(keys)


@pytest.mark.parametrize("batch, prompt_len, max_new, dtype", [
    (1, 5, 4, jnp.float32), (3, 11, 7, jnp.float32), (2, 9, 3, jnp.bfloat16)])
def test_op_calls_are_the_calls_generate_makes(monkeypatch, chat_checkpoint, batch, prompt_len,
                                               max_new, dtype):
    model = llama.from_pretrained(chat_checkpoint, dtype=dtype)
    prompts = [[5 + i + j for j in range(prompt_len - i)] for i in range(batch)]
    seen = _dispatched(monkeypatch, model, prompts, max_new)
    planned = _planned(model.config, batch=batch, seq_len=prompt_len, dtype=dtype,
                       max_new_tokens=max_new)
    assert {op for op, _ in seen} >= {"attention", "paged_attention", "paged_write", "matmul",
                                      "embedding"}
    assert planned == seen, (sorted(planned - seen), sorted(seen - planned))


def test_tune_defaults_to_generates_dtype_and_ops(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FORGE_JAX_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc = cli.main(["tune", "--iters", "1", "--seq-len", "8", "--max-new-tokens", "4",
                   "--implementations", "xla"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "float32" in out.splitlines()[0] and "bfloat16" not in out
    for op in ("attention", "paged_attention", "paged_write", "matmul", "embedding"):
        assert f"  {op} " in out, out


def test_op_calls_follow_biases_and_tied_embeddings(monkeypatch):
    from flax import nnx

    config = llama.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=8, attention_bias=True,
                               mlp_bias=True, tie_word_embeddings=True)
    model = llama.Llama(config, rngs=nnx.Rngs(0))
    seen = _dispatched(monkeypatch, model, [[3, 4, 5]], 2)
    assert _planned(config, batch=1, seq_len=3, dtype=jnp.float32, max_new_tokens=2) == seen
