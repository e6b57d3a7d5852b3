"""Bad input to the ``forge-jax`` command line: one line on stderr naming the flag and the value,
exit code 2, before the model is loaded. And statistics that say what happened when
``--max-new-tokens`` is 0 or 1."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from cases.cli import assert_one_line_error, run

from forge_jax import dispatch
from forge_jax.models.tiny import task as tasks
from forge_jax.models.tiny import train as train_tiny

TINY = train_tiny.TINY_DIR


BAD_FLAGS = {
    "temperature_nan": (["--temperature", "nan"], ["--temperature", "nan"]),
    "temperature_inf": (["--temperature", "inf"], ["--temperature", "inf"]),
    "temperature_-inf": (["--temperature=-inf"], ["--temperature", "-inf"]),
    "temperature_negative": (["--temperature=-0.5"], ["--temperature", "-0.5"]),
    "temperature_beyond_float32": (["--temperature", "1e39"], ["--temperature", "1e+39"]),
    "temperature_text": (["--temperature", "hot"], ["--temperature", "'hot'"]),
    "top_p_nan": (["--top-p", "nan"], ["--top-p", "nan"]),
    "top_p_zero": (["--top-p", "0"], ["--top-p", "0.0"]),
    "top_k_zero": (["--top-k", "0"], ["--top-k", "0"]),
    "top_k_text": (["--top-k", "x"], ["--top-k", "'x'"]),
    "max_new_tokens_negative": (["--max-new-tokens=-1"], ["--max-new-tokens", "-1"]),
    # 1 <bos> + 8 characters of the longest problem, + 100: beyond the tiny model's 64.
    "max_new_tokens_too_long": (["--max-new-tokens", "100"],
                                ["--max-new-tokens 100", "109 positions",
                                 "max_position_embeddings=64", "--allow-long-context"]),
    "num_problems_zero": (["--num-problems", "0"], ["--num-problems", "0"]),
    "num_problems_negative": (["--num-problems=-3"], ["--num-problems", "-3"]),
    "num_problems_huge": (["--num-problems", str(10**13)],
                          ["--num-problems 10000000000000", "GiB"]),
    "show_negative": (["--show=-1"], ["--show", "-1"]),
    "show_text": (["--show", "all"], ["--show", "'all'"]),
    "seed_negative": (["--seed=-1"], ["--seed", "-1"]),
    "seed_huge": (["--seed", str(2**63)], ["--seed", str(2**63)]),
    "dtype": (["--dtype", "int8"], ["--dtype", "'int8'"]),
    "cache": (["--cache", "ring"], ["--cache", "'ring'"]),
    "implementation": (["--implementation", "nonexistent"],
                       ["--implementation", "'nonexistent'", "registered: "]),
    "unknown_flag": (["--bogus", "1"], ["unrecognized arguments: --bogus 1"]),
    "both_prompts": (["--prompt", "1+1=", "--prompt-ids", "1,2"], ["--prompt", "--prompt-ids"]),
    # Characters the tiny model's character-level vocabulary lacks: the tokenizer raises.
    "prompt_not_encodable": (["--prompt", "1+x="], ["--prompt '1+x='", "cannot be encoded"]),
    "prompt_not_encodable_unicode": (["--prompt", "1+1=", "--prompt", "é"],
                                     ["--prompt 'é'", "cannot be encoded"]),
    "prompt_too_long": (["--prompt", "12+34=", "--max-new-tokens", "60"],
                        ["--prompt '12+34='", "7 tokens", "--max-new-tokens 60", "67 positions",
                         "max_position_embeddings=64"]),
    "prompt_ids_too_long": (["--prompt-ids", ",".join(["5"] * 60), "--max-new-tokens", "5"],
                            ["--prompt-ids", "60 tokens", "65 positions"]),
    "prompt_ids_outside_vocab": (["--prompt-ids", "1,15,-2"], ["--prompt-ids", "[15, -2]",
                                                             "[0, 15)"]),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_generate_flags_are_one_line_before_loading(capsys, no_model_load, case):
    argv, fragments = BAD_FLAGS[case]
    start = time.perf_counter()
    assert_one_line_error(run(capsys, "generate", *argv), *fragments)
    assert time.perf_counter() - start < 5.0  # no loop over a huge --num-problems


def test_implementation_names_come_from_the_registry(capsys, no_model_load):
    assert "xla" in dispatch.names()
    rc, out, err = run(capsys, "generate", "--implementation", "xla-typo")
    assert_one_line_error((rc, out, err), "'xla-typo'", ", ".join(dispatch.names()))


@pytest.mark.parametrize("argv, fragments, prog", [
    (["demo", "--seed=-1"], ["--seed", "-1"], "forge-jax demo"),
    (["demo", "--seed", "x"], ["--seed", "'x'"], "forge-jax demo"),
    (["info", "--details"], ["unrecognized arguments: --details"], "forge-jax info"),
    (["nope"], ["'nope'"], "forge-jax"),
])
def test_bad_info_and_demo_flags_are_one_line(capsys, argv, fragments, prog):
    assert_one_line_error(run(capsys, *argv), *fragments, prog=prog)


def test_tokenizer_ids_outside_the_vocabulary(capsys, tmp_path, no_model_load):
    """A tokenizer.json that does not match the checkpoint (ids past the model's vocabulary)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = dict(tasks.VOCAB) | {"x": 40, "y": 15}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    shutil.copy(TINY / "config.json", tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "model.safetensors").symlink_to(TINY / "model.safetensors")
    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt",
                              "1x+y"), "--prompt '1x+y'", "[15, 40]", "[0, 15)",
                          "does not match the checkpoint")


def test_max_new_tokens_zero_and_one_say_what_happened(capsys):
    rc, out, err = run(capsys, "generate", "--max-new-tokens", "0", "--num-problems", "4")
    assert rc == 0, err
    assert "--max-new-tokens 0" in out and "not measured" in out
    assert "tokens/s" not in out and "first token" not in out and "0.0%" not in out
    assert "implementations used: none" in out

    ids = ",".join(str(i) for i in tasks.encode_prompt(tasks.Problem(12, 34)))
    rc, out, err = run(capsys, "generate", "--prompt-ids", ids, "--max-new-tokens", "1")
    assert rc == 0, err
    generated = re.search(r"generated ids: \[(\d+)\]", out)
    assert generated and int(generated.group(1)) == tasks.VOCAB["6"], out  # 46 backwards
    assert "--max-new-tokens 1: the prefill gives the only token" in out
    assert "ended at its first token" not in out
    assert re.search(r"prefill: \d+ prompt tokens in .* tokens/s", out)


def test_allow_long_context_runs_beyond_max_positions(capsys):
    config = json.loads((TINY / "config.json").read_text())
    ids = tasks.encode_prompt(tasks.Problem(7, 8))
    new = config["max_position_embeddings"] - len(ids) + 1  # one position too many
    argv = ["generate", "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(new)]
    assert_one_line_error(run(capsys, *argv), f"{len(ids) + new} positions")
    rc, out, err = run(capsys, *argv, "--allow-long-context")
    assert rc == 0, err
    answer = [tasks.VOCAB[c] for c in "51"] + [tasks.EOS_ID]  # 15 backwards, then eos
    assert f"generated ids: {answer}" in out, out
