"""The BOS decision: the token ids a text prompt is generated from.

Whether a prompt starts with a BOS token is the tokenizer's decision, nowhere else's: its
``tokenizer.json`` post-processor adds one (Llama 2's ``<s>``, Llama 3's
``<|begin_of_text|>``) or adds none (SmolLM2's, Qwen's), as transformers' ``tokenizer(text)``
does; a GGUF file's ``tokenizer.ggml.add_bos_token`` becomes that post-processor when
forge_jax builds the tokenizer from the file. The model's ``bos_token_id`` is never prepended
on its own: a model trained without a BOS before plain text answers differently with one.

The live text API (:meth:`forge_jax.text.Tokenizer.encode`), ``forge-jax generate`` and an
exported program's :meth:`~forge_jax.generation.exported.Program.generate_text` all encode
through :func:`encode_prompt`, so they give the model the same ids. This module imports
nothing but the standard library, so that an exported program loads without the model code.
"""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The token ids of the text prompt ``text``.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (a :class:`forge_jax.text.Tokenizer`'s
        ``backend``, or an exported program's saved ``tokenizer.json``).
      text: the prompt.
      add_special_tokens: apply the tokenizer's post-processor (the BOS it adds, if any).
        False for text that writes its own special tokens (a rendered chat template).

    Returns:
      The ids, with a BOS first exactly when the tokenizer adds one.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
