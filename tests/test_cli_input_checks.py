"""Input the ``forge-jax`` commands used to take and then fail on (or silently ignore):
each is now one line on stderr naming the argument and its value, exit code 2, before the
model loads. And the Python API's ``from_pretrained`` names a dtype that is not a float
dtype."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import pytest
from cases.cli import assert_one_line_error, run

from forge_jax import dispatch
from forge_jax.models import llama
from forge_jax.models.tiny import train as train_tiny

TINY = train_tiny.TINY_DIR


def _tiny_copy(directory, **config_changes):
    """The embedded tiny model's files in ``directory``, config.json changed."""
    directory.mkdir()
    config = json.loads((TINY / "config.json").read_text()) | config_changes
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, directory)
    (directory / "model.safetensors").symlink_to(TINY / "model.safetensors")
    return directory


@pytest.mark.parametrize("command", ["generate", "chat", "demo"])
def test_implementation_env_typo_is_one_line_before_any_work(capsys, monkeypatch, no_model_load,
                                                             chat_checkpoint, command):
    monkeypatch.setenv(dispatch.ENV_VAR, "palas")
    argv = ["--checkpoint", str(chat_checkpoint)] if command == "chat" else []
    assert_one_line_error(run(capsys, command, *argv), "FORGE_JAX_IMPLEMENTATION='palas'",
                          "registered: ", "pallas", prog=f"forge-jax {command}")


def test_implementation_env_with_a_registered_name_still_runs(capsys, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "xla")
    rc, out, err = run(capsys, "generate", "--num-problems", "4", "--show", "0")
    assert rc == 0, err
    assert "rms_norm         xla (env, cpu)" in out, out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_compilation_cache_that_cannot_be_created_is_refused_before_loading(
        capsys, monkeypatch, tmp_path, no_model_load, chat_checkpoint, command):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    argv = [command, "--checkpoint", str(chat_checkpoint), "--prompt", "Hi"]
    if command == "chat":
        argv.remove("--prompt"), argv.remove("Hi")
    assert_one_line_error(run(capsys, *argv, "--compilation-cache", str(blocker / "cache")),
                          f"--compilation-cache {blocker / 'cache'}", "cannot create",
                          prog=f"forge-jax {command}")
    monkeypatch.setenv("FORGE_JAX_COMPILATION_CACHE", str(blocker))
    assert_one_line_error(run(capsys, *argv), f"$FORGE_JAX_COMPILATION_CACHE={blocker}",
                          prog=f"forge-jax {command}")


@pytest.mark.parametrize("ids, position", [("1,,2", "position 2 of 3"), ("1,2,", "position 3 of 3"),
                                           (",1", "position 1 of 2"), ("1, ,2", "position 2 of 3")])
def test_prompt_ids_with_an_empty_item(capsys, no_model_load, ids, position):
    assert_one_line_error(run(capsys, "generate", "--prompt-ids", ids), f"--prompt-ids {ids!r}",
                          "empty item", position)


@pytest.mark.parametrize("argv, fragments", [
    (["--prompt-ids", "1,2", "--num-problems", "8"], ["--num-problems 8", "--prompt-ids",
                                                       "ignored"]),
    (["--prompt", "1+1=", "--show", "2"], ["--show 2", "with --prompt", "ignored"]),
])
def test_task_flags_with_a_prompt_are_refused(capsys, no_model_load, argv, fragments):
    assert_one_line_error(run(capsys, "generate", *argv), *fragments)


def test_task_flags_given_at_their_defaults_still_run_the_task(capsys):
    rc, out, err = run(capsys, "generate", "--num-problems", "256", "--show", "5")
    assert rc == 0, err
    assert "accuracy: " in out and "/256 = " in out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_checkpoint_given_as_its_config_file(capsys, no_model_load, chat_checkpoint, command):
    config = chat_checkpoint / "config.json"
    assert_one_line_error(run(capsys, command, "--checkpoint", str(config)),
                          f"{str(config)!r} is a file", f"{str(chat_checkpoint)!r}",
                          prog=f"forge-jax {command}")


def test_eos_token_id_as_a_string(capsys, tmp_path, no_model_load):
    ckpt = _tiny_copy(tmp_path / "config_eos", eos_token_id="14")
    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(ckpt), "--prompt-ids",
                              "1,2,13"), "config.json: eos_token_id", "got '14'")
    ckpt = _tiny_copy(tmp_path / "generation_config_eos")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "14"}))
    assert_one_line_error(run(capsys, "generate", "--checkpoint", str(ckpt), "--prompt-ids",
                              "1,2,13"), "generation_config.json: eos_token_id", "got '14'")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(dtype=jnp.int8), "dtype=int8"),
    (dict(dtype="int32"), "dtype=int32"),
    (dict(dtype="floaty"), "dtype='floaty'"),
    (dict(param_dtype=jnp.bool_), "param_dtype=bool"),
])
def test_from_pretrained_refuses_a_dtype_that_is_not_a_float(kwargs, fragment):
    with pytest.raises(ValueError, match="must be a float dtype") as info:
        llama.from_pretrained(TINY, **kwargs)
    assert fragment in str(info.value)
