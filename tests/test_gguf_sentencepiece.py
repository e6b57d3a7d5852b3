"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model == "llama"``): a BPE model
trained here with sentencepiece itself (byte fallback, identity normalization, as Llama 2's)
is written into a small GGUF file the way llama.cpp's converter writes one (pieces, scores,
token types); the tokenizer forge_jax builds from the file's metadata gives the ids
sentencepiece gives, and transformers' GGUF tokenizer conversion gives, on varied text, and
decodes them back to the text. A GGUF with another tokenizer model is one clear error."""

from __future__ import annotations

import io

import pytest
from cases import gguf_files

from forge_jax.models import llama
from forge_jax.text import api as text

pytest.importorskip("gguf", reason="GGUF tests need the gguf package (pip install gguf)")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces; the pieces map to ids.",
    "Hello world! Hello there, how are you doing today?",
    "Caf\u00e9 cr\u00e8me and na\u00efve r\u00e9sum\u00e9s are written with accents.",
    "Numbers like 12345 and 3.14159 appear in text too.",
    "def main():\n    return 42\n",
    "Spaces  between   words, and\ttabs, and new\nlines.",
    "The model reads the text and writes the next token, again and again.",
] * 8
USER = "<think>"
TEXTS = [
    "Hello world", "The lazy dog jumps over the quick fox.", "  two leading spaces",
    "trailing spaces   ", "tabs\tand\nnew\n\nlines\r\n", "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "bytes outside the vocabulary: \u65e5\u672c\u8a9e \U0001f642 \u2713 \u00df",
    "digits 0123456789",
    "", " ", "x", "ALL CAPS, punctuation!?;:",
]


@pytest.fixture(scope="module")
def sp():
    spm = pytest.importorskip("sentencepiece", reason="the reference is sentencepiece itself")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, user_defined_symbols=[USER], hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def vocabulary(sp) -> dict:
    """The file's tokenizer metadata, as llama.cpp's converter writes it from a
    SentencePiece model (``_create_vocab_sentencepiece``): pieces, scores, types."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 4 if tokens[-1] == USER else 1)
    return dict(model="llama", tokens=tokens, scores=scores, types=types,
                unk_token_id=sp.unk_id(), add_bos_token=True, add_eos_token=False)


def write(path, sp, **tokenizer):
    vocab = vocabulary(sp) | tokenizer
    config = dict(gguf_files.CONFIG, vocab_size=len(vocab["tokens"]), bos_token_id=sp.bos_id(),
                  eos_token_id=sp.eos_id())
    gguf_files.write(path, gguf_files.random_llama(0, config), {}, config=config,
                     tokenizer=vocab)
    return path


def test_ids_match_sentencepiece_and_decode_round_trips(tmp_path, sp):
    tok = text.load_tokenizer(write(tmp_path / "spm.gguf", sp))
    assert sp.is_byte(sp.piece_to_id("<0x0A>"))  # newlines and unseen characters: bytes
    for sample in TEXTS:
        want = sp.encode(sample)
        assert tok.encode(sample, add_special_tokens=False) == want, sample
        assert tok.encode(sample) == [sp.bos_id()] + want, sample  # add_bos_token
        assert tok.decode(want) == sample == sp.decode(want), sample
    # A user-defined token is matched whole; the text after it gets its own "▁", as after a
    # control token (llama.cpp; sentencepiece puts one "▁" before the whole text instead).
    ids = tok.encode(f"{USER}thinking", add_special_tokens=False)
    assert ids == [sp.piece_to_id(USER)] + sp.encode("thinking"), ids
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert tok.generation_config.eos_token_id == (sp.eos_id(),)


def test_ids_match_transformers_gguf_conversion(tmp_path, sp):
    transformers = pytest.importorskip("transformers")
    file = write(tmp_path / "spm.gguf", sp)
    tok = text.load_tokenizer(file)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    # Control tokens in the text are matched whole (sentencepiece reads them as characters).
    same = [t for t in TEXTS if not t.startswith(" ")] + ["Hi</s>", "Hello world<s>", "x</s>"]
    for sample in same:
        for special in (False, True):
            assert tok.encode(sample, add_special_tokens=special) == hf.encode(
                sample, add_special_tokens=special), (sample, special)
    # transformers puts no "▁" before a text that starts with a space (its Metaspace
    # pre-tokenizer); sentencepiece and llama.cpp do, and so does forge_jax.
    sample = "  two leading spaces"
    ours = tok.encode(sample, add_special_tokens=False)
    assert ours == sp.encode(sample) != hf.encode(sample, add_special_tokens=False)


def test_space_prefix_and_bos_follow_the_files_flags(tmp_path, sp):
    tok = text.load_tokenizer(write(tmp_path / "flags.gguf", sp, add_bos_token=False,
                                    add_space_prefix=False))
    ids = tok.encode("Hello world")
    assert ids[0] != sp.bos_id() and tok.decode(ids) == "Hello world"
    assert sp.id_to_piece(ids[0]) != sp.id_to_piece(sp.encode("Hello")[0])  # no "▁" first


def test_unknown_tokenizer_model_is_named(tmp_path, sp):
    file = write(tmp_path / "bert.gguf", sp, model="bert")
    with pytest.raises(llama.CheckpointError) as e:
        text.load_tokenizer(file)
    message = str(e.value)
    assert "\n" not in message and "tokenizer model 'bert'" in message, message
