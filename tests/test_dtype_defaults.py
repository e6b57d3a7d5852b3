"""Defaults that follow the platform or agree across entry points: the compute dtype
(float32 on CPU, bfloat16 on GPU and TPU) of ``from_pretrained`` and the CLI's ``--dtype``, the
note for ``--dtype bfloat16`` on CPU, and one ``max_new_tokens`` default for the command line
and the API."""

from __future__ import annotations

import argparse
import io
import types

import jax
import jax.numpy as jnp
import pytest

from forge_jax import cli
from forge_jax.cli import generate as generate_cli
from forge_jax.models import llama
from forge_jax.models.checkpoints import hf as llama_checkpoint
from forge_jax.text import api as text


@pytest.mark.parametrize("platform, dtype", [("cpu", jnp.float32), ("gpu", jnp.bfloat16),
                                             ("cuda", jnp.bfloat16), ("tpu", jnp.bfloat16)])
def test_default_dtype_follows_the_platform(platform, dtype):
    assert llama_checkpoint.default_dtype(platform) == jnp.dtype(dtype)


def test_from_pretrained_defaults_to_the_platform_dtype(monkeypatch, chat_checkpoint):
    assert jax.default_backend() == "cpu"
    assert llama.from_pretrained(chat_checkpoint).dtype == jnp.float32
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    model = llama.from_pretrained(chat_checkpoint)
    assert model.dtype == jnp.bfloat16 and model.embed_tokens[...].dtype == jnp.bfloat16
    assert llama.from_pretrained(chat_checkpoint, dtype=jnp.float32).dtype == jnp.float32


def _generate(capsys, monkeypatch, *flags):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc = cli.main(["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *flags])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_cli_dtype_default_and_the_bfloat16_note_on_cpu(capsys, monkeypatch, chat_checkpoint):
    out, err = _generate(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint))
    assert "float32" in out.splitlines()[0] and "note:" not in err
    out, err = _generate(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                         "--dtype", "bfloat16")
    assert "bfloat16" in out.splitlines()[0]
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "bfloat16" in notes[0] and "CPU" in notes[0] \
        and "natively" in notes[0]
    out, err = _generate(capsys, monkeypatch, "--checkpoint", str(chat_checkpoint),
                         "--dtype", "float32")
    assert "note:" not in err


def test_cli_dtype_default_on_gpu_is_bfloat16(monkeypatch):
    from forge_jax.cli import _flags

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    args = argparse.Namespace(dtype=None)
    _flags.resolve_dtype(args)
    assert args.dtype == "bfloat16"


def test_max_new_tokens_default_agrees():
    """generate's --max-new-tokens, chat's, generate_text's and ChatSession's default: one value."""
    args = argparse.Namespace(max_new_tokens=None)
    config = types.SimpleNamespace(max_position_embeddings=2048)
    assert generate_cli._prompt_new_tokens(args, config, [[1] * 5]) \
        == text.default_max_new_tokens(config, 5) == text.DEFAULT_MAX_NEW_TOKENS == 256
    assert generate_cli.DEFAULT_MAX_NEW_TOKENS == text.DEFAULT_MAX_NEW_TOKENS
    # Capped at the positions the model has left, so that the default never fails.
    small = types.SimpleNamespace(max_position_embeddings=64)
    assert generate_cli._prompt_new_tokens(args, small, [[1] * 9, [1]]) \
        == text.default_max_new_tokens(small, 9) == 55
    assert text.default_max_new_tokens(config, 5, text.GenerationConfig(max_new_tokens=7)) \
        == 7
    sub = argparse.ArgumentParser().add_subparsers()
    generate_cli.add_parser(sub)
    help_text = " ".join(sub.choices["generate"].format_help().split())
    assert f"generation_config.json's, else {text.DEFAULT_MAX_NEW_TOKENS}" in help_text
