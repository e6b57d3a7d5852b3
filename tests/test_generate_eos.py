"""generate() stops at the checkpoint's eos ids unless told otherwise, as transformers'
``generate`` does: generation_config.json's ids, else config.json's; ``eos_token_id=()``
turns stopping off."""

from __future__ import annotations

import json

import pytest
from cases.chat_checkpoint import write_checkpoint

from forge_jax.models import llama
from forge_jax.text import api as text

PROMPTS = [[5, 17, 33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [70, 7, 64]]
NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The chat checkpoint, with config.json's eos set to a token the greedy continuation
    of PROMPTS[1] produces mid-way (a random model never produces its ``<|im_end|>``)."""
    directory = write_checkpoint(tmp_path_factory.mktemp("eos_ckpt"))
    free = llama.generate(llama.from_pretrained(directory), PROMPTS, NEW, eos_token_id=())
    assert all(len(row) == NEW for row in free)
    eos = free[1][4]
    assert eos not in free[1][:4]
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = eos
    (directory / "config.json").write_text(json.dumps(config))
    return directory, free, eos


def _cut(rows, eos):
    eos = {eos} if isinstance(eos, int) else set(eos)
    out = []
    for row in rows:
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        out.append(row if stop is None else row[:stop + 1])
    return out


def test_generate_stops_at_the_config_eos_by_default(checkpoint):
    directory, free, eos = checkpoint
    model = llama.from_pretrained(directory)
    assert model.config.eos_token_ids == (eos,)
    expected = _cut(free, eos)
    assert expected[1] == free[1][:5]  # the eos ends it, and is included
    assert llama.generate(model, PROMPTS, NEW) == expected
    tokens, stats = llama.generate_with_stats(model, PROMPTS, NEW)
    assert tokens == expected and stats.new_tokens == sum(map(len, expected))
    # The explicit opt-out: always max_new_tokens tokens.
    assert llama.generate(model, PROMPTS, NEW, eos_token_id=()) == free
    # An explicit id replaces the default.
    other = free[0][2]
    assert llama.generate(model, PROMPTS, NEW, eos_token_id=other) == _cut(free, other)


def test_generation_config_eos_takes_precedence(checkpoint, tmp_path):
    directory, free, eos = checkpoint
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    other = free[2][3]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [other]}))
    model = llama.from_pretrained(tmp_path)
    assert model.generation_config.eos_token_id == (other,)
    assert llama.generate(model, PROMPTS, NEW) == _cut(free, other)
    # generate_text applied the same ids already; it still does, and () still opts out.
    tokenizer = text.load_tokenizer(tmp_path)
    ids = text.generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW)[1]
    assert ids == _cut(free, other)
    assert text.generate_ids(model, tokenizer, PROMPTS, max_new_tokens=NEW,
                             eos_token_id=())[1] == free


def test_default_eos_matches_transformers(checkpoint):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory, free, eos = checkpoint
    model = llama.from_pretrained(directory)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert expected[1][-1] == eos and len(expected[1]) < NEW  # transformers stopped
    assert llama.generate(model, PROMPTS, NEW) == expected



@pytest.mark.parametrize("eos", ["2", ["2"], [1, -3], True, 2.0])
def test_config_refuses_eos_that_is_not_a_token_id(eos):
    # A string used to pass through and be read as a tuple of characters.
    from forge_jax.models.llama_config import LlamaConfig

    with pytest.raises(ValueError, match=r"eos_token_id must be a token id .* got eos_token_id="):
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, eos_token_id=eos)


def test_config_keeps_eos_ids_as_ints():
    import numpy as np

    from forge_jax.models.llama_config import LlamaConfig

    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2)
    assert LlamaConfig(**kw, eos_token_id=[3, np.int64(7)]).eos_token_ids == (3, 7)
    assert LlamaConfig(**kw, eos_token_id=np.int32(5)).eos_token_ids == (5,)
    assert type(LlamaConfig(**kw, eos_token_id=np.int32(5)).eos_token_id) is int
