"""Checkpoints named on the Hugging Face Hub (``ORG/NAME``): ``from_pretrained``,
``load_config``, ``load_tokenizer``, ``load_generation_config`` and ``--checkpoint`` of
``generate`` and ``chat`` resolve them through huggingface_hub's ``snapshot_download``.

These machines cannot reach the Hub, so each test builds a Hub-layout cache in tmp
(``models--ORG--NAME/{blobs,refs,snapshots}``, as huggingface_hub writes it) and runs the real
code path with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing there."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from cases.chat_checkpoint import write_checkpoint

from forge_jax import cli
from forge_jax.models import llama
from forge_jax.models.checkpoints import hub
from forge_jax.text import api as text

REPO = "TestOrg/Tiny-Chat"
MAIN, V1 = "a" * 40, "b" * 40  # the commits refs/main and refs/v1 point at


def add_snapshot(cache: pathlib.Path, repo: str, commit: str, source: pathlib.Path,
                 refs=("main",)) -> pathlib.Path:
    """Copies ``source``'s files into ``cache`` as huggingface_hub lays out a download: each
    file a blob named by its hash, the snapshot a folder of relative symlinks, ``refs/REF``
    holding the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = root / "blobs", root / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, chat_checkpoint):
    """A Hub cache holding REPO at two revisions (main: the chat checkpoint; v1: the same
    with other weights and a generation_config.json), offline."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, MAIN, chat_checkpoint)
    other = write_checkpoint(tmp_path / "v1_source", seed=1,
                             generation_config={"max_new_tokens": 7})
    add_snapshot(cache, REPO, V1, other, refs=("v1",))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no local directory named TestOrg/
    return cache


def _weights(model):
    return np.asarray(model.embed_tokens[...])


def test_from_pretrained_reads_a_hub_name_from_the_cache(hub_cache, chat_checkpoint, chat_model):
    model = llama.from_pretrained(REPO)
    np.testing.assert_array_equal(_weights(model), _weights(chat_model))
    assert llama.load_config(REPO) == llama.load_config(chat_checkpoint)
    path = hub.resolve_checkpoint(REPO)
    assert path == hub_cache / "models--TestOrg--Tiny-Chat" / "snapshots" / MAIN


def test_revision_selects_the_snapshot(hub_cache, chat_model):
    by_ref = llama.from_pretrained(REPO, revision="v1")
    by_commit = llama.from_pretrained(REPO, revision=V1)
    np.testing.assert_array_equal(_weights(by_ref), _weights(by_commit))
    assert not np.array_equal(_weights(by_ref), _weights(chat_model))
    assert text.load_generation_config(REPO) is None
    assert text.load_generation_config(REPO, revision="v1").max_new_tokens == 7


def test_load_tokenizer_reads_a_hub_name(hub_cache, chat_tokenizer):
    tok = text.load_tokenizer(REPO)
    assert tok.chat_template == chat_tokenizer.chat_template
    assert tok.encode("Hello there!") == chat_tokenizer.encode("Hello there!")
    assert tok.generation_config == chat_tokenizer.generation_config


def test_a_local_directory_wins_over_a_hub_name(hub_cache, tmp_path):
    local = write_checkpoint(tmp_path / REPO, seed=2)  # ./TestOrg/Tiny-Chat exists
    assert hub.resolve_checkpoint(REPO) == pathlib.Path(REPO)
    np.testing.assert_array_equal(_weights(llama.from_pretrained(REPO)),
                                  _weights(llama.from_pretrained(local)))


@pytest.mark.parametrize("name", ["not a repo/na me", "a/b/c/d-missing", "--x/y", "missing"])
def test_neither_a_path_nor_a_repo_id_is_a_clear_error(hub_cache, name):
    with pytest.raises(llama.CheckpointError, match="does not exist, and it is not a Hugging "
                                                     "Face Hub repository id"):
        llama.from_pretrained(name)


def test_offline_with_nothing_cached_names_the_repo_and_hf_hub_offline(hub_cache):
    for call, kw in ((llama.from_pretrained, {}), (llama.load_config, {"revision": "v2"}),
                     (text.load_tokenizer, {})):
        with pytest.raises(llama.CheckpointError) as info:
            call("TestOrg/Not-Cached", **kw)
        message = str(info.value)
        assert "TestOrg/Not-Cached" in message and "HF_HUB_OFFLINE" in message
        assert "\n" not in message
    with pytest.raises(llama.CheckpointError, match="v2"):
        llama.from_pretrained(REPO, revision="v2")


def test_only_the_files_the_loader_reads_are_asked_for(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_checkpoint("Org/Name", revision="r1") == tmp_path
    (repo_id, kw), = calls
    assert repo_id == "Org/Name" and kw["revision"] == "r1"
    assert set(kw["allow_patterns"]) == {
        "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "special_tokens_map.json"}


def _cli(capsys, monkeypatch, *argv, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_and_chat_take_a_hub_name(hub_cache, capsys, monkeypatch):
    rc, out, err = _cli(capsys, monkeypatch, "generate", "--checkpoint", REPO, "--prompt",
                        "Hello there!", "--max-new-tokens", "3", "--no-stream")
    assert rc == 0, err
    assert "snapshots" in out
    rc, out, err = _cli(capsys, monkeypatch, "chat", "--checkpoint", REPO, "--revision", "v1",
                        "--max-new-tokens", "2", "--no-stats", stdin="Hello there!\n")
    assert rc == 0, err
    rc, out, err = _cli(capsys, monkeypatch, "generate", "--checkpoint", "TestOrg/Not-Cached",
                        "--prompt-ids", "1,2")
    assert rc != 0
    assert "TestOrg/Not-Cached" in err and "HF_HUB_OFFLINE" in err
    assert len(err.strip().splitlines()) == 1


def test_hf_hub_offline_from_the_environment(hub_cache, tmp_path):
    """The variables as a user sets them, read by huggingface_hub at import."""
    code = ("from forge_jax.models import llama; "
            f"print(llama.load_config({REPO!r}, revision='v1').vocab_size)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    env.pop("HF_HOME", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    snapshot = hub_cache / "models--TestOrg--Tiny-Chat" / "snapshots" / V1
    assert int(out.stdout.split()[-1]) == json.loads(
        (snapshot / "config.json").read_text())["vocab_size"]


def test_a_home_relative_path_is_expanded_for_a_directory_and_a_gguf_file(
        tmp_path, monkeypatch):
    from cases import gguf_files

    monkeypatch.setenv("HOME", str(tmp_path))
    directory = write_checkpoint(tmp_path / "models" / "chat")
    weights = gguf_files.random_llama(1)
    gguf_files.write(tmp_path / "models" / "tiny.gguf", weights, {})
    model = llama.from_pretrained("~/models/chat")
    np.testing.assert_array_equal(_weights(model), _weights(llama.from_pretrained(directory)))
    assert llama.load_config(pathlib.Path("~/models/chat")) == model.config
    assert text.load_tokenizer("~/models/chat").backend.get_vocab_size() == \
        model.config.vocab_size
    gguf = llama.from_pretrained("~/models/tiny.gguf")
    assert gguf.config == llama.load_config(tmp_path / "models" / "tiny.gguf")
    np.testing.assert_array_equal(np.asarray(gguf.embed_tokens[...]),
                                  weights["model.embed_tokens.weight"])
    assert llama.load_config("~/models/tiny.gguf").num_hidden_layers == 2
