"""Constrained sampling: the tokens a sequence may generate next, from a grammar (a JSON
schema, a regular expression, a list of choices or a Lark grammar).

A :class:`Constraint` is data (frozen, hashable): it goes in
:attr:`forge_jax.generation.SamplingParams.constraint`. The serving engine builds a
:class:`Matcher` per request from it (:meth:`Constraint.matcher`), asks it for the bitmask
of the allowed next tokens on the host while the device runs a step, and applies the mask
to the logits on the device before sampling (:mod:`forge_jax.serving.batch_step`).

The grammar engine is llguidance (the one sglang-jax, vLLM and llama.cpp use): chosen over
xgrammar because its Python package needs neither torch nor transformers (xgrammar's depends
on torch), it builds its token trie straight from a ``tokenizers`` JSON (the tokenizer the
text layer already loads), it compiles a JSON schema lazily (a new schema per request costs
no precompilation; a mask takes tens of microseconds per token) and it takes JSON schemas,
regular expressions and Lark grammars through one interface. It is imported lazily, by
the constrained-sampling path only (``pip install 'forge-jax[serve]'`` installs it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# JSON written compactly (", " and ": " separators, no other whitespace): a free
# whitespace rule lets a sampled model pad the output with blanks until its token limit.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A grammar, schema, regex or choice list the grammar engine rejects."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("constrained sampling needs llguidance: pip install "
                          "'forge-jax[serve]' (or pip install llguidance)") from None
    return llguidance


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a sequence's text must follow.

    Make one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex`, :meth:`choice`
    or :meth:`grammar` (a Lark grammar, llguidance's dialect).

    Attributes:
      kind: one of :data:`KINDS`.
      spec: the schema (as canonical JSON text), the pattern, the choices (as a JSON list)
        or the grammar's text.
    """

    kind: str
    spec: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got kind={self.kind!r}")
        if not isinstance(self.spec, str):
            raise TypeError(f"spec must be a str, got {type(self.spec).__name__}")

    @classmethod
    def json_schema(cls, schema: Mapping | str) -> Constraint:
        """JSON text that validates against ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"a JSON schema must be an object, got {schema!r:.80}")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text matching ``pattern`` whole (Rust ``regex`` syntax, as llguidance reads it)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError(f"a regex must be a non-empty string, got {pattern!r:.80}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Exactly one of ``options`` (non-empty strings)."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options or \
                not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(f"choices must be a non-empty list of non-empty strings, got "
                                  f"{options!r:.80}")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        """Text the Lark grammar ``lark`` derives from its ``start`` rule."""
        if not isinstance(lark, str) or not lark.strip():
            raise ConstraintError(f"a grammar must be a non-empty string, got {lark!r:.80}")
        return cls("grammar", lark)

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint."""
        llg = _llguidance()
        if self.kind in ("json_schema", "json_object"):
            try:
                return llg.LLMatcher.grammar_from_json_schema(self.spec, overrides=_JSON_OPTIONS)
            except ValueError as e:
                raise ConstraintError(f"invalid JSON schema: {e}") from None
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            options = json.loads(self.spec)
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o) for o in options))
        return llg.LLMatcher.grammar_from_lark(self.spec)

    def validate(self, tokenizer: GrammarTokenizer | None = None) -> None:
        """Raises :class:`ConstraintError` (with the engine's reason) for a grammar the
        engine rejects, before any work is done with it."""
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(self.grammar_text(),
                                               None if tokenizer is None else tokenizer.ll)
        if error:
            raise ConstraintError(f"invalid {self.kind.replace('_', ' ')}: {error}")

    def matcher(self, tokenizer: GrammarTokenizer) -> Matcher:
        """A fresh :class:`Matcher` of this constraint over ``tokenizer``'s vocabulary."""
        llg = _llguidance()
        ll = llg.LLMatcher(tokenizer.ll, self.grammar_text(), log_level=0)
        if ll.is_error():
            raise ConstraintError(f"invalid {self.kind.replace('_', ' ')}: {ll.get_error()}")
        return Matcher(ll, tokenizer.vocab_size)


class GrammarTokenizer:
    """A tokenizer's vocabulary as the grammar engine reads it (built once per engine: it
    takes a fraction of a second for a large vocabulary).

    Args:
      tokenizer: a :class:`forge_jax.text.Tokenizer` whose backend is a Hugging Face
        ``tokenizers.Tokenizer``.
      vocab_size: the model's vocabulary (the logits' width; ids past the tokenizer's are
        never allowed).
      eos_token_ids: the ids that end a sequence: allowed where the grammar may end.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        backend = getattr(tokenizer, "backend", None)
        if not hasattr(backend, "id_to_token"):
            raise ConstraintError(f"constrained sampling needs a Hugging Face tokenizers "
                                  f"tokenizer, got {type(backend).__name__}")
        eos = sorted(int(e) for e in eos_token_ids)
        if not eos:
            raise ConstraintError("constrained sampling needs an eos token id to end the "
                                  "text where the grammar ends")
        self.vocab_size = int(vocab_size)
        llg = _llguidance()
        try:  # the tokenizer's own JSON: llguidance reads its byte-level and BPE models
            self.ll = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        except (ValueError, RuntimeError):  # other decoders: each token's bytes, spelled out
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(backend, self.vocab_size,
                                                                       eos[0])),
                                      n_vocab=self.vocab_size, eos_token=eos)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class _Vocabulary:
    """A ``tokenizers`` vocabulary as llguidance's ``TokenizerWrapper`` reads it: each id's
    bytes (byte-level pieces mapped back to bytes, ``<0xNN>`` byte tokens, ``▁`` as a
    space), the special tokens, and an encoder."""

    def __init__(self, backend, vocab_size: int, eos: int):
        self._backend = backend
        config = json.loads(backend.to_str())
        byte_level = "ByteLevel" in json.dumps(config.get("decoder"))
        alphabet = _byte_level_alphabet()
        self.special_token_ids = [t["id"] for t in config.get("added_tokens", ())
                                  if t.get("special")]
        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens = []
        for i in range(vocab_size):
            piece = backend.id_to_token(i)
            if piece is None:
                self.tokens.append(b"")
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                self.tokens.append(bytes([int(piece[3:5], 16)]))
            elif byte_level and all(c in alphabet for c in piece):
                self.tokens.append(bytes(alphabet[c] for c in piece))
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode("utf-8"))

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


class Matcher:
    """One sequence's position in its grammar (host-side, not thread-safe)."""

    def __init__(self, ll, vocab_size: int):
        self._ll, self.vocab_size = ll, vocab_size
        self.words = -(-vocab_size // 32)

    def mask(self) -> np.ndarray:
        """int32 ``[ceil(vocab / 32)]``: bit ``t % 32`` of word ``t // 32`` set when token
        ``t`` may come next."""
        out = np.zeros((1, self.words), np.int32)
        self._ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out[0]

    def allowed(self) -> np.ndarray:
        """bool ``[vocab]``, :meth:`mask` unpacked."""
        bits = np.unpackbits(self.mask().view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].astype(bool)

    def consume(self, token: int) -> bool:
        """Advances past ``token``; False if the grammar does not allow it (the matcher is
        then in error, :attr:`error`)."""
        return bool(self._ll.consume_token(int(token)))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (not consumed)."""
        return int(self._ll.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (the canonical tokens of the only bytes
        it allows next, e.g. a JSON key's quotes and name; none: ``[]``)."""
        return [int(t) for t in self._ll.compute_ff_tokens()]

    def rollback(self, n: int) -> None:
        """Undoes the last ``n`` consumed tokens (speculative drafts the model refused)."""
        if n and not self._ll.rollback(int(n)):
            raise RuntimeError(f"the grammar matcher could not roll back {n} tokens: "
                               f"{self._ll.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar allows nothing more (only an eos token)."""
        return bool(self._ll.is_stopped())

    @property
    def error(self) -> str | None:
        return self._ll.get_error() if self._ll.is_error() else None
