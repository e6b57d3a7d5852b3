"""A sampling filter (top-k, top-p, min-p) given without a temperature samples, the same
way in ``forge-jax generate``, ``forge-jax chat`` and the Python API (``generate_text``,
``ChatSession``), and the commands say so. It used to be greedy, the filter silently
dropped."""

from __future__ import annotations

import io

import pytest
from cases.chat_checkpoint import write_checkpoint

from forge_jax import cli
from forge_jax.generation import SamplingParams
from forge_jax.generation.settings import sampling_params
from forge_jax.text import api as text
from forge_jax.text.chat_session import ChatSession


def run(capsys, monkeypatch, *argv, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("filters", [dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05)])
def test_a_filter_without_a_temperature_samples_at_1(filters):
    params = sampling_params(**filters)
    assert not params.greedy and params.temperature == 1.0, params
    # At the generation config's temperature where it sets one (as do_sample would).
    params = sampling_params(text.GenerationConfig(temperature=0.7), **filters)
    assert not params.greedy and params.temperature == 0.7, params
    # A temperature given says it all: 0 is greedy.
    assert sampling_params(temperature=0.0, **filters).greedy


@pytest.mark.parametrize("kwargs", [{}, dict(top_k=0), dict(repetition_penalty=1.3)])
def test_no_filter_is_still_greedy(kwargs):
    """top_k=0 turns top-k off; the repetition penalty applies to greedy decoding too."""
    assert sampling_params(**kwargs).greedy


def test_generate_text_and_chat_session_sample_with_a_filter(chat_model, chat_tokenizer):
    config = chat_tokenizer.generation_config
    greedy = text.generate_text(chat_model, chat_tokenizer, "Hello there", max_new_tokens=12)
    sampled = text.generate_text(chat_model, chat_tokenizer, "Hello there", max_new_tokens=12,
                                 sampling=sampling_params(config, top_p=0.9, seed=1))
    assert sampled == text.generate_text(
        chat_model, chat_tokenizer, "Hello there", max_new_tokens=12,
        sampling=sampling_params(config, temperature=1.0, top_p=0.9, seed=1))
    assert sampled != greedy
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=4,
                          sampling=sampling_params(config, top_p=0.9))
    assert not session.sampling.greedy and session.sampling.temperature == 1.0


def test_generate_command_samples_with_top_p_and_says_so(capsys, monkeypatch, chat_checkpoint,
                                                         chat_model, chat_tokenizer):
    rc, out, err = run(capsys, monkeypatch, "generate", "--checkpoint", str(chat_checkpoint),
                       "--prompt", "Hello there", "--max-new-tokens", "12", "--top-p", "0.9",
                       "--seed", "1")
    assert rc == 0, err
    expected = text.generate_text(chat_model, chat_tokenizer, "Hello there", max_new_tokens=12,
                                  sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    assert f"completion: {expected!r}" in out, out
    assert ("decoding: sampling at temperature 1 (--top-p without --temperature; --temperature "
            "0 for greedy), top-p 0.9, seed 1") in out, out


def test_chat_command_samples_with_top_k_and_says_so(capsys, monkeypatch, tmp_path,
                                                     chat_model, chat_tokenizer):
    # generation_config.json says greedy: a filter given still samples, at temperature 1.
    checkpoint = write_checkpoint(tmp_path / "greedy", generation_config={"do_sample": False})
    rc, out, err = run(capsys, monkeypatch, "chat", "--checkpoint", str(checkpoint),
                       "--max-new-tokens", "8", "--top-k", "40", "--seed", "3", "--no-stats",
                       stdin="Hello there!\n")
    assert rc == 0, err
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=8,
                          sampling=SamplingParams(temperature=1.0, top_k=40, seed=3))
    assert out == session.send("Hello there!") + "\n"
    assert "sampling at temperature 1 (--top-k without --temperature" in err, err


@pytest.mark.parametrize("generation_config, sampling, says", [
    # None of do_sample: chat samples, with llama.cpp's defaults (a small instruct model
    # decoded greedily repeats itself).
    (None, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0),
     "sampling at temperature 0.8 (chat's default where generation_config.json sets no "
     "do_sample; --temperature 0 for greedy), top-k 40, top-p 0.95, min-p 0.05, seed 0"),
    ({"temperature": 0.2, "top_p": 0.9},
     SamplingParams(temperature=0.2, top_k=40, top_p=0.9, min_p=0.05, seed=0),
     "sampling at temperature 0.2 (chat's default"),
    ({"do_sample": True, "temperature": 0.6},
     SamplingParams(temperature=0.6, seed=0), "(generation_config.json's do_sample)"),
    ({"do_sample": False}, SamplingParams(), " tokens; greedy. "),
])
def test_chat_samples_as_the_generation_config_says_greedy_only_when_it_says_so(
        capsys, monkeypatch, tmp_path, chat_model, chat_tokenizer, generation_config,
        sampling, says):
    checkpoint = write_checkpoint(tmp_path / "ckpt", generation_config=generation_config)
    rc, out, err = run(capsys, monkeypatch, "chat", "--checkpoint", str(checkpoint),
                       "--max-new-tokens", "8", "--no-stats", stdin="Hello there!\n")
    assert rc == 0, err
    session = ChatSession(chat_model, chat_tokenizer, max_new_tokens=8, sampling=sampling)
    assert out == session.send("Hello there!") + "\n"
    assert says in err, err


def test_task_run_says_how_it_decoded(capsys, monkeypatch):
    rc, out, err = run(capsys, monkeypatch, "generate", "--num-problems", "8", "--show", "0",
                       "--min-p", "0.5")
    assert rc == 0, err
    assert "(sampling at temperature 1 (--min-p without --temperature; --temperature 0 for " \
           "greedy), min-p 0.5, seed 0; one batch" in out, out
    rc, out, err = run(capsys, monkeypatch, "generate", "--num-problems", "8", "--show", "0")
    assert rc == 0 and "problems (greedy; one batch, stop at <eos>)" in out, out
