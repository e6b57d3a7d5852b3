"""A long ``--prompt`` that ``forge-jax generate`` refuses is named by its number, length
and first words, with its token count, not echoed back whole."""

from __future__ import annotations

import pytest

from forge_jax import cli
from forge_jax.models import llama
from forge_jax.models.tiny import task as tasks

LONG = "1+" * 22_500  # 45,000 characters


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded the model before refusing the input")

    monkeypatch.setattr(llama, "from_pretrained", refuse)


def assert_short_one_line_error(rc, err, *fragments):
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and len(err) < 400, err[:1000]
    assert err.startswith("forge-jax generate: error: --prompt"), err[:1000]
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_a_prompt_beyond_the_context_is_named_by_its_token_count(capsys, no_model_load):
    tokens = len(tasks.encode_prompt(tasks.Problem(1, 1))) - 4 + len(LONG)  # <bos> + chars
    rc, out, err = run(capsys, "generate", "--prompt", LONG)
    assert_short_one_line_error(rc, err, f"{tokens} tokens", "45,000 characters", "'1+1+1+",
                                "max_position_embeddings=64")
    rc, out, err = run(capsys, "generate", "--prompt", "1+1=", "--prompt", LONG)
    assert_short_one_line_error(rc, err, "--prompt #2 of 2", f"{tokens} tokens")


def test_a_long_prompt_that_cannot_be_encoded_is_not_echoed(capsys, no_model_load):
    rc, out, err = run(capsys, "generate", "--prompt", LONG + "x")
    assert_short_one_line_error(rc, err, "45,001 characters", "cannot be encoded")


def test_a_short_prompt_is_still_quoted_whole(capsys, no_model_load):
    rc, out, err = run(capsys, "generate", "--prompt", "12+34=", "--max-new-tokens", "60")
    assert_short_one_line_error(rc, err, "--prompt '12+34=' has 7 tokens")


def test_many_ids_outside_the_vocabulary_are_counted_not_listed(capsys, no_model_load):
    rc, out, err = run(capsys, "generate", "--prompt-ids", ",".join(["99"] * 30 + ["1"]))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "--prompt-ids [99, 99, 99, 99, 99, 99, 99, 99, 99, 99, ... (20 more)] outside the " \
           "vocabulary [0, 15)" in err, err
