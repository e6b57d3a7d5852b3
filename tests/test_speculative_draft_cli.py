"""``--draft-checkpoint DIR`` for ``forge-jax generate`` and ``serve``: the draft loaded
after its vocabulary is checked against the target's (one-line refusals before the weights
load), greedy output unchanged."""

from __future__ import annotations

import json
import re

import pytest
from cases.cli import assert_one_line_error, run

from forge_jax.text import api as text

DRAFT_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    from cases.chat_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("draft"), seed=3, sizes=DRAFT_SIZES)


def test_generate_with_a_draft_checkpoint_keeps_the_greedy_completion(
        capsys, chat_checkpoint, chat_model, chat_tokenizer, draft_checkpoint):
    expected = text.generate_text(chat_model, chat_tokenizer, "Hello there", max_new_tokens=12)
    rc, out, err = run(capsys, "generate", "--checkpoint", str(chat_checkpoint), "--prompt",
                       "Hello there", "--max-new-tokens", "12", "--temperature", "0",
                       "--draft-checkpoint", str(draft_checkpoint),
                       "--num-speculative-tokens", "3")
    assert rc == 0, err
    assert f"completion: {expected!r}" in out
    assert re.search(r"^speculative: \d+ of \d+ drafted tokens kept", out, re.M), out


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_draft_flags_are_one_line(capsys, chat_checkpoint, draft_checkpoint, tmp_path,
                                      no_model_load, command):
    if command == "serve":
        pytest.importorskip("uvicorn")
    common = [command, "--checkpoint", str(chat_checkpoint)]
    common += ["--prompt", "Hi"] if command == "generate" else ["--port", "0"]
    prog = f"forge-jax {command}"
    assert_one_line_error(run(capsys, *common, "--draft-checkpoint", str(draft_checkpoint),
                              "--speculative", "ngram"),
                          "--speculative ngram and --draft-checkpoint are two ways", prog=prog)
    assert_one_line_error(run(capsys, *common, "--draft-checkpoint", str(draft_checkpoint),
                              "--num-speculative-tokens", "0"),
                          "--num-speculative-tokens must be >= 1, got 0", prog=prog)
    assert_one_line_error(run(capsys, *common, "--draft-checkpoint", str(tmp_path / "none")),
                          "--draft-checkpoint", "none", prog=prog)
    # Another vocabulary: a config.json of more tokens, then tokens at other ids.
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (other / name).write_bytes((draft_checkpoint / name).read_bytes())
    config = json.loads((draft_checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, vocab_size=512)))
    assert_one_line_error(run(capsys, *common, "--draft-checkpoint", str(other)),
                          "vocabulary has 512 tokens, the target's 400", prog=prog)
    (other / "config.json").write_text(json.dumps(config))
    vocab = json.loads((draft_checkpoint / "tokenizer.json").read_text())
    table = vocab["model"]["vocab"]
    first, second = sorted(table, key=table.get)[10:12]
    table[first], table[second] = table[second], table[first]
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    assert_one_line_error(run(capsys, *common, "--draft-checkpoint", str(other)),
                          "tokenizer differs from the target's in 4 (token, id) pairs",
                          prog=prog)
