"""A GGUF file's conversion kept on disk (``models.checkpoints.gguf_cache``): a second load
reads the kept config, tokenizer and weights without opening the GGUF file and gives the same
model, bit for bit, and the same tokens; an entry for a changed file, or written by another
JAX, is ignored with one log line and replaced; a corrupted weights file or tokenizer is
never trusted."""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import chat_checkpoint, gguf_files

from forge_jax.models import llama
from forge_jax.models.checkpoints import gguf_cache, gguf_reader
from forge_jax.text import api as text

pytest.importorskip("gguf", reason="GGUF tests need the gguf package (pip install gguf)")

TOKENS = jnp.asarray([[1, 5, 9, 33, 70, 2, 4, 12]], jnp.int32)
# Quantized projections of three layouts, a float16 embedding, a quantized untied head.
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_1", "output": "Q8_0",
         "token_embd": "F16"}
LOG = "forge_jax.models.checkpoints.gguf_cache"


def _write(file, seed=0, types=TYPES, tie=False):
    original = chat_checkpoint.build_tokenizer()
    vocab = json.loads(original.to_str())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(original.to_str())["model"]["merges"]]
    config = dict(gguf_files.CONFIG, vocab_size=len(tokens), tie_word_embeddings=tie,
                  bos_token_id=tokens.index("<s>"), eos_token_id=tokens.index("<|im_end|>"))
    specials = set(chat_checkpoint.SPECIALS)
    gguf_files.write(file, gguf_files.random_llama(seed, config), types, config=config,
                     seed=seed, tokenizer=dict(
                         tokens=tokens, merges=merges,
                         types=[3 if t in specials else 1 for t in tokens],
                         chat_template=chat_checkpoint.TEMPLATE))
    return file


def _forget():
    """What this process remembers of files and entries (a new process remembers none)."""
    gguf_cache._ENTRIES.clear()
    gguf_cache._identity.cache_clear()
    gguf_reader._LAST_READER.clear()


def _load(file):
    """(config, tokenizer, model) as a command loads them; every leaf of the model."""
    config = llama.load_config(file)
    tokenizer = text.load_tokenizer(file)
    model = llama.from_pretrained(file, dtype=jnp.float32)
    return config, tokenizer, model


def _same_model(a, b):
    from flax import nnx

    la, lb = (jax.tree.leaves(nnx.state(m)) for m in (a, b))
    assert len(la) == len(lb) and len(la) > 10
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(a(TOKENS)), np.asarray(b(TOKENS)))


def _same_tokenizer(a, b):
    for sample in chat_checkpoint.CORPUS[:4] + ["<|im_start|>user\nHi \u00e9<|im_end|>"]:
        assert a.encode(sample, add_special_tokens=False) == b.encode(
            sample, add_special_tokens=False)
    assert a.special_tokens == b.special_tokens and a.chat_template == b.chat_template
    assert a.generation_config.eos_token_id == b.generation_config.eos_token_id


def _no_gguf_reads(monkeypatch):
    def refuse(path):
        raise AssertionError(f"the GGUF file {path} was read")

    monkeypatch.setattr(gguf_reader, "_open_gguf", refuse)


@pytest.fixture
def fresh():
    _forget()
    yield
    _forget()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-quantized-head"])
def test_a_kept_conversion_loads_the_same_model_without_reading_the_file(
        tmp_path, fresh, monkeypatch, caplog, tie):
    types = dict(TYPES, token_embd="Q4_1") if tie else TYPES
    file = _write(tmp_path / "m.gguf", types={k: v for k, v in types.items()
                                              if not (tie and k == "output")}, tie=tie)
    config0, tok0, model0 = _load(file)  # no cache
    _forget()
    with gguf_cache.use_gguf_cache(tmp_path / "cache"):
        config1, tok1, model1 = _load(file)  # a miss: converted, kept
    entry = next((tmp_path / "cache").iterdir())
    assert {p.name for p in entry.iterdir()} == {
        "entry.json", "tokenizer.json", "weights-float32.safetensors"}
    _forget()
    _no_gguf_reads(monkeypatch)
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        config2, tok2, model2 = _load(file)  # a hit: the file is never opened
    assert not caplog.records
    assert config0 == config1 == config2
    _same_tokenizer(tok0, tok2)
    _same_model(model0, model1)
    _same_model(model0, model2)
    assert (model0.lm_head is None) == (model2.lm_head is None) == False  # noqa: E712


def _cached(tmp_path, file):
    with gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _load(file)
    _forget()
    return next((tmp_path / "cache").iterdir())


def test_an_entry_for_a_changed_file_is_ignored_with_one_line_and_replaced(
        tmp_path, fresh, caplog):
    file = _write(tmp_path / "m.gguf", seed=0)
    _cached(tmp_path, file)
    _write(file, seed=1)  # the same name, other weights
    _, tok0, model0 = _load(file)
    _forget()
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _, tok1, model1 = _load(file)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "written for another" in warnings[0], warnings
    assert "mtime_ns" in warnings[0] or "header_sha256" in warnings[0]
    _same_model(model0, model1)
    _same_tokenizer(tok0, tok1)
    _forget()
    caplog.clear()
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _same_model(model0, _load(file)[2])  # the replaced entry
    assert not caplog.records


def test_an_entry_another_jax_wrote_is_ignored(tmp_path, fresh, caplog):
    file = _write(tmp_path / "m.gguf")
    entry = _cached(tmp_path, file)
    meta = json.loads((entry / "entry.json").read_text())
    meta["key"]["jax"] = "0.0.1"
    (entry / "entry.json").write_text(json.dumps(meta))
    _, _, model0 = _load(file)
    _forget()
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _same_model(model0, _load(file)[2])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "written for another jax" in warnings[0], warnings
    assert json.loads((entry / "entry.json").read_text())["key"]["jax"] == jax.__version__


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "bad header"])
def test_a_corrupted_weights_file_is_never_trusted(tmp_path, fresh, caplog, damage):
    file = _write(tmp_path / "m.gguf")
    entry = _cached(tmp_path, file)
    weights = entry / "weights-float32.safetensors"
    data = bytearray(weights.read_bytes())
    good = gguf_cache._views(bytes(data))
    if damage == "flipped byte":
        data[-5] ^= 0x40  # the last tensor's data
        # the damage is real: the file's own arrays would differ
        bad = gguf_cache._views(bytes(data))
        assert any(not np.array_equal(good[k], bad[k]) for k in good)
    elif damage == "truncated":
        data = data[:len(data) // 2]
    else:
        data[8:12] = b"\xff\xfe{["
    weights.write_bytes(bytes(data))
    _, _, model0 = _load(file)
    _forget()
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _same_model(model0, _load(file)[2])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "corrupted" in warnings[0], warnings


def test_a_corrupted_entry_or_tokenizer_is_never_trusted(tmp_path, fresh, caplog):
    file = _write(tmp_path / "m.gguf")
    entry = _cached(tmp_path, file)
    (entry / "tokenizer.json").write_text("{not json")
    _, tok0, _ = _load(file)
    _forget()
    with caplog.at_level(logging.INFO), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        _same_tokenizer(tok0, text.load_tokenizer(file))
    assert len([r for r in caplog.records if "tokenizer" in r.getMessage()]) == 1
    (entry / "entry.json").write_text("[1, 2")
    _forget()
    caplog.clear()
    with caplog.at_level(logging.INFO, LOG), gguf_cache.use_gguf_cache(tmp_path / "cache"):
        config = llama.load_config(file)
    assert config == llama.load_config(file)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "unreadable" in warnings[0], warnings


def test_chat_twice_on_a_gguf_file_reads_it_once(tmp_path, fresh, monkeypatch, capsys):
    import io

    from forge_jax import cli

    file = _write(tmp_path / "m.gguf")

    def chat():
        monkeypatch.setattr("sys.stdin", io.StringIO("Hello there!\n"))
        rc = cli.main(["chat", "--checkpoint", str(file), "--compilation-cache",
                       str(tmp_path / "cache"), "--max-new-tokens", "6", "--temperature", "0"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return out

    first = chat()
    assert {p.name for p in next((tmp_path / "cache" / "gguf").iterdir()).iterdir()} == {
        "entry.json", "tokenizer.json", "weights-float32.safetensors"}
    _forget()
    _no_gguf_reads(monkeypatch)
    assert chat() == first and first.strip()
