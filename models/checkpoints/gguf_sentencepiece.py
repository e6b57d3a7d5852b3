"""SentencePiece-style vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``: Llama
2, Mistral, TinyLlama, ...) as a ``tokenizers.Tokenizer``.

The file holds each token with a score and a type (llama.cpp's ``llama_token_type``), no
merges. It encodes as SentencePiece's BPE does (and llama.cpp's ``llm_tokenizer_spm``): spaces
become ``▁`` and one ``▁`` is put before the text and after each special token
(``tokenizer.ggml.add_space_prefix``, default on; transformers' GGUF conversion puts none
before a text that starts with a space, nor after a special token); then, from single
characters, the adjacent pair whose join is the highest-scoring token is merged until none is a
token. That is BPE with a merge for every split of every normal token into two normal tokens,
ranked by the joined token's score, which is what is built here. A character no token holds
becomes its UTF-8 bytes, the ``<0xNN>`` byte tokens (byte fallback). Control tokens (``<s>``,
``</s>``) are special tokens, user-defined ones plain added tokens, both matched whole in the
text. Decoding maps ``▁`` back to spaces, joins byte tokens into their characters and drops the
prefix space. ``tokenizer.ggml.add_bos_token`` (default on, as llama.cpp and transformers read
such a file) and ``add_eos_token`` become the tokenizer's post-processor.
"""

from __future__ import annotations

from collections.abc import Sequence

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
           ) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scored merging: every split of a normal
    token into two normal tokens, best-scoring joined token first (ties: the earlier
    token, then the longer left piece)."""
    normal = {t for t, kind in zip(tokens, types, strict=True) if kind == NORMAL}
    ranked = []
    for index, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind != NORMAL:
            continue
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-float(score), index, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def tokenizer(tokens: Sequence[str], scores: Sequence[float] | None, types: Sequence[int] | None,
              *, unk_id: int | None, bos_id: int | None, eos_id: int | None,
              add_bos: bool = True, add_eos: bool = False, add_space_prefix: bool = True):
    """The ``tokenizers.Tokenizer`` of a SentencePiece-style GGUF vocabulary (see the
    module docstring). ``scores`` default to the negated position (earlier is better),
    ``types`` to normal."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens = list(tokens)
    types = [NORMAL] * len(tokens) if types is None else [int(t) for t in types]
    scores = [-float(i) for i in range(len(tokens))] if scores is None else list(scores)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated token keeps its first id
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(models.BPE(vocab, merges(tokens, scores, types), unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    # A normalizer, not Metaspace (transformers' choice, which adds no "▁" to a text that
    # starts with a space, nor after a special token): sentencepiece and llama.cpp put one
    # before every piece of text, after each special token too.
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True)
                                if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])
    ends = [(tokens[i], i) for i, on in ((bos_id, add_bos), (eos_id, add_eos))
            if on and i is not None and 0 <= i < len(tokens)]
    if ends:
        def one(seq: str, type_id: int) -> str:
            bos = f"{tokens[bos_id]}:{type_id} " if add_bos and bos_id is not None else ""
            eos = f" {tokens[eos_id]}:{type_id}" if add_eos and eos_id is not None else ""
            return f"{bos}{seq}:{type_id}{eos}"

        backend.post_processor = processors.TemplateProcessing(
            single=one("$A", 0), pair=f"{one('$A', 0)} {one('$B', 1)}",
            special_tokens=list(dict.fromkeys(ends)))
    return backend
