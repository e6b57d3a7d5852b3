"""How a GGUF file's byte-level BPE vocabulary splits text before its merges, from
``tokenizer.ggml.pre`` (the name llama.cpp's converter gives the checkpoint's
pre-tokenizer, by the hash of its tokenization of a fixed text).

The splits named here are the regular expressions of the checkpoints' own
``tokenizer.json`` (which llama.cpp's ``llama-vocab.cpp`` quotes beside its rewrites),
applied as those files apply them: a ``Split`` keeping each match, then byte-level mapping
without GPT-2's own split. Any other name splits as GPT-2 does (``ByteLevel`` with its
regular expression), as forge_jax always has.
"""

from __future__ import annotations

from typing import Any

# o200k (gpt-oss, GPT-4o): letter runs split at a lower-to-upper case change, numbers in
# runs of at most 3 digits, punctuation runs with trailing newlines and slashes.
O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}"
         "\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# Llama 3 (llama.cpp's "llama-bpe"): numbers in runs of at most 3 digits.
LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
          "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLITS = {"gpt-4o": O200K, "llama-bpe": LLAMA3}


def pre_tokenizer(pre: str | None) -> Any:
    """The ``tokenizers`` pre-tokenizer of ``tokenizer.ggml.pre`` = ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    regex = SPLITS.get(pre)
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
