"""Grammar constraints over a vocabulary (llguidance): the tokens a matcher allows, walked
token by token, for a tokenizer llguidance reads from its JSON (byte-level BPE) and one
whose tokens are spelled out for it (the tiny model's word-level vocabulary)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from forge_jax.generation.constraints import (  # noqa: E402
    Constraint,
    ConstraintError,
    GrammarTokenizer,
)
from forge_jax.models import TINY_DIR  # noqa: E402
from forge_jax.text import api as text  # noqa: E402


def _walk(matcher, tokenizer, eos, rng, limit=60) -> str:
    """Random allowed tokens until eos or the grammar ends; the text."""
    out = []
    for _ in range(limit):
        allowed = np.flatnonzero(matcher.allowed())
        assert allowed.size
        token = int(rng.choice(allowed))
        if token == eos:
            break
        assert matcher.consume(token), matcher.error
        out.append(token)
        if matcher.done:
            break
    return tokenizer.decode(out)


def test_word_level_vocabulary_is_spelled_out():
    tokenizer = text.load_tokenizer(TINY_DIR)
    eos = tokenizer.token_id("<eos>")
    grammar = GrammarTokenizer(tokenizer, 15, [eos])
    rng = np.random.default_rng(0)
    for _ in range(5):
        got = _walk(Constraint.regex("[0-9]{2}\\+[0-9]=").matcher(grammar), tokenizer, eos, rng)
        assert len(got) == 5 and got[:2].isdigit() and got[2:3] == "+" and got[4] == "="
    mask = Constraint.choice(["12", "7"]).matcher(grammar).allowed()
    assert mask.shape == (15,)
    assert set(np.flatnonzero(mask)) == {tokenizer.token_id("1"), tokenizer.token_id("7")}


def test_byte_level_vocabulary_and_json(chat_tokenizer):
    eos = chat_tokenizer.token_id("<|im_end|>")
    grammar = GrammarTokenizer(chat_tokenizer, 400, [eos])
    schema = {"type": "object", "properties": {"k": {"enum": ["caf\u00e9", "\u65e5\u672c"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["k", "n"], "additionalProperties": False}
    rng = np.random.default_rng(1)
    for _ in range(5):
        value = json.loads(_walk(Constraint.json_schema(schema).matcher(grammar),
                                 chat_tokenizer, eos, rng))
        assert value["k"] in ("caf\u00e9", "\u65e5\u672c") and 0 <= value["n"] <= 99


def test_bad_constraints_are_refused_with_the_engines_reason(chat_tokenizer):
    grammar = GrammarTokenizer(chat_tokenizer, 400, [3])
    for constraint, fragment in ((Constraint.regex("a(b"), "unclosed group"),
                                 (Constraint.json_schema({"type": "nonsense"}), "nonsense"),
                                 (Constraint.grammar("start: missing"), "missing")):
        with pytest.raises(ConstraintError, match=fragment):
            constraint.validate(grammar)
    with pytest.raises(ConstraintError, match="choices"):
        Constraint.choice("yes")
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{")
    with pytest.raises(ConstraintError, match="eos"):
        GrammarTokenizer(chat_tokenizer, 400, [])
