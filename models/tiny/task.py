"""The embedded tiny model's task: multi-digit addition with the answer written backwards.

A problem is two non-negative integers of 1 to ``max_digits`` digits each (the number of digits
of each operand drawn uniformly, so short and long prompts mix in one batch). The prompt is
``"{a}+{b}="``; the answer is the decimal digits of ``a + b`` least significant first, followed by
the end-of-sequence token::

    prompt "123+459="   answer "285" <eos>     (123 + 459 = 582)

Writing the sum backwards lets the model produce each digit from the two operand digits of the
same weight and the carry it has just written, the order in which one adds by hand; written
forwards, the first digit would depend on every carry at once, and a model this small learns that
far more slowly. :func:`read_answer` turns a completion back into the integer.

The tokenizer is character-level: one token per character of ``0123456789+=``, plus
``<pad>``, ``<bos>`` and ``<eos>``. It prepends ``<bos>`` when encoding and skips the special tokens
when decoding, so ``decode(encode(text).ids) == text`` for any text over those characters.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = "0123456789+="
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The expected completion (without the eos token): the sum's digits, backwards."""
        return str(self.a + self.b)[::-1]

    @property
    def held_out(self) -> bool:
        """True for the ~10% of problems training never sees (a hash of the prompt)."""
        return zlib.crc32(self.prompt.encode()) % 10 == 0


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    """Addition of two integers of 1 to ``max_digits`` digits each."""

    max_digits: int = 3

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.max_digits + 2

    @property
    def max_answer_chars(self) -> int:
        return self.max_digits + 1

    def sample(self, rng: np.random.Generator, n: int, *, split: str = "test") -> list[Problem]:
        """``n`` random problems; the digit count of each operand is uniform in [1, max_digits].

        ``split="train"`` draws only problems that are not :attr:`Problem.held_out`,
        ``split="test"`` only held-out ones, so a test problem was never trained on.
        """
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split=!r}")
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n=!r}")
        want_held_out = split == "test"
        out = []
        while len(out) < n:
            p = Problem(self._operand(rng), self._operand(rng))
            if p.held_out == want_held_out:
                out.append(p)
        return out

    def _operand(self, rng: np.random.Generator) -> int:
        digits = int(rng.integers(1, self.max_digits + 1))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return int(rng.integers(low, 10**digits))


def task_from_config(config: dict) -> AdditionTask | None:
    """The task a checkpoint's ``config.json`` says its model solves (its ``forge_jax_task``
    entry, written by ``forge_jax.models.tiny.train``), or None for any other checkpoint."""
    entry = config.get("forge_jax_task")
    if not isinstance(entry, dict) or entry.get("name") != "addition":
        return None
    return AdditionTask(max_digits=int(entry.get("max_digits", AdditionTask.max_digits)))


def decode(ids: Sequence[int]) -> tuple[str, bool]:
    """Generated ids -> (the text before the first eos, whether an eos ended it).

    Special tokens other than eos are dropped; this is the tokenizer's decoding, without
    needing the tokenizer object.
    """
    chars = []
    for i in ids:
        if i == EOS_ID:
            return "".join(chars), True
        if i >= len(SPECIAL_TOKENS):
            chars.append(CHARACTERS[i - len(SPECIAL_TOKENS)])
    return "".join(chars), False


def encode_prompt(problem: Problem) -> list[int]:
    """``<bos>`` and the prompt's characters, as the tokenizer encodes them."""
    return [BOS_ID] + [VOCAB[c] for c in problem.prompt]


def read_answer(completion: str) -> int | None:
    """The integer a completion states (its digits read backwards), or None if it is not one."""
    if not completion or not completion.isdigit():
        return None
    return int(completion[::-1])


def is_correct(problem: Problem, ids: Sequence[int]) -> bool:
    """Exact match: the generated ids are the answer's digits followed by eos."""
    text, finished = decode(ids)
    return finished and text == problem.answer


def solve(model, problems: Sequence[Problem], **generate_kwargs):
    """Generates the model's answers to ``problems`` in one batch (greedy by default).

    Args:
      model: a ``forge_jax.models.llama.Llama`` trained on this task.
      problems: the problems.
      **generate_kwargs: arguments of ``forge_jax.generation.generate_with_stats``
        (``sampling``, ``cache``, ``callbacks``, ...); ``max_new_tokens`` defaults to the
        longest possible answer (one digit more than the longest operand) plus its eos.

    Returns:
      ``(generated, stats)``: the new token ids of each problem (eos included when
      produced) and the ``GenerationStats``.
    """
    from forge_jax.models import llama

    longest = max(len(str(max(p.a, p.b))) + 1 for p in problems)
    generate_kwargs.setdefault("max_new_tokens", longest + 1)
    generate_kwargs.setdefault("eos_token_id", EOS_ID)
    return llama.generate_with_stats(model, [encode_prompt(p) for p in problems],
                                     **generate_kwargs)


def accuracy(problems: Sequence[Problem], generated: Sequence[Sequence[int]]) -> float:
    """The fraction of problems answered exactly right."""
    return sum(is_correct(p, g) for p, g in zip(problems, generated, strict=True)) / len(problems)


def build_tokenizer():
    """The character-level ``tokenizers.Tokenizer`` for this task (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
    return tok


def encode_problems(problems: list[Problem], *, with_answer: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids for a batch, right-padded: ``<bos> prompt [answer <eos>]``.

    Returns:
      ids: int32 [batch, max_len], padded with ``PAD_ID``.
      loss_mask: float32 [batch, max_len]; 1 where ``ids[:, t + 1]`` is an answer token or the
        eos (the positions whose next-token prediction training scores), else 0.
    """
    rows = []
    for p in problems:
        text = p.prompt + (p.answer if with_answer else "")
        row = [BOS_ID] + [VOCAB[c] for c in text] + ([EOS_ID] if with_answer else [])
        rows.append((row, 1 + len(p.prompt)))
    width = max(len(r) for r, _ in rows)
    ids = np.full((len(rows), width), PAD_ID, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (row, prompt_len) in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, prompt_len - 1:len(row) - 1] = 1.0
    return ids, mask
