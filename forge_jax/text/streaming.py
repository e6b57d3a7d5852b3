"""Streaming detokenization: the tokens a generate call streams turned into text pieces as
they arrive, a character split across tokens held back until it is settled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from forge_jax.text.tokenizer import Tokenizer


class TextStreamer:
    """Turns the tokens :func:`generate_with_stats` streams (``on_tokens(i, tokens)``)
    into text pieces, one incremental decoder per sequence
    (``tokenizers.decoders.DecodeStream``: a character split across tokens, or a merge
    that changes earlier text, is held back until it is settled). Calls
    ``on_text(index, piece)`` for each non-empty piece of sequence ``index``; a sequence
    stops at its first eos token (not decoded). :meth:`close` flushes what is still held
    back at the end (e.g. the bytes of an incomplete character, decoded as U+FFFD), so
    that the pieces of a sequence concatenate to the decoding of all its tokens.
    """

    def __init__(self, tokenizer: Tokenizer, batch: int, eos: Sequence[int],
                 on_text: Callable[[int, str], None], *, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.on_text, self.eos = tokenizer, on_text, frozenset(eos)
        self.skip_special_tokens = skip_special_tokens
        self.decoders = [DecodeStream(skip_special_tokens=skip_special_tokens)
                         for _ in range(batch)]
        self.finished = np.zeros((batch,), bool)
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.emitted = [0] * batch  # characters passed to on_text, per sequence

    def __call__(self, i: int, tokens: np.ndarray) -> None:
        for b, token in enumerate(np.asarray(tokens).tolist()):
            if self.finished[b]:
                continue
            if token in self.eos:
                self.finished[b] = True
                continue
            self.ids[b].append(token)
            self._emit(b, self.decoders[b].step(self.tokenizer.backend, token))

    def _emit(self, b: int, piece: str | None) -> None:
        if piece:
            self.emitted[b] += len(piece)
            self.on_text(b, piece)

    def close(self) -> None:
        """Passes on the text still held back (once the last token is in)."""
        for b, ids in enumerate(self.ids):
            full = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
            self._emit(b, full[self.emitted[b]:])
            self.finished[b] = True
