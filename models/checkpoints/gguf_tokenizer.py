"""A GGUF file's tokenizer: its vocabulary, merges or scores, special tokens and chat
template, from the file's metadata (read with :mod:`forge_jax.models.checkpoints.gguf`), as a
``tokenizers.Tokenizer``. Inside
:func:`~forge_jax.models.checkpoints.gguf_cache.use_gguf_cache` the converted tokenizer is
read from (and kept in) the cache as ``tokenizer.json``."""

from __future__ import annotations

import logging
import os
from typing import Any

from forge_jax.models.checkpoints import gguf_cache
from forge_jax.models.checkpoints.generation_config import CheckpointError, GenerationConfig
from forge_jax.models.checkpoints.gguf import open_gguf

logger = logging.getLogger("forge_jax.models.checkpoints.gguf_tokenizer")


def tokenizer_parts(path: str | os.PathLike) -> dict[str, Any]:
    """The pieces of a GGUF file's tokenizer, for :func:`forge_jax.text.api.load_tokenizer`:
    ``backend`` (a ``tokenizers.Tokenizer``), ``special_tokens``, ``chat_template`` and
    ``generation_config`` (how: :func:`_convert`); from the cache when one is active and
    holds them."""
    parts = _kept(path)
    if parts is None:
        parts = _convert(path)
        eos = parts["generation_config"].eos_token_id
        gguf_cache.put(path, "tokenizer", {
            "special_tokens": parts["special_tokens"], "chat_template": parts["chat_template"],
            "eos_token_id": list(eos)}, extra_files=[
            ("tokenizer.json", parts["backend"].to_str().encode())])
    return parts


def _kept(path) -> dict[str, Any] | None:
    info = gguf_cache.get(path, "tokenizer")
    if not isinstance(info, dict):
        return None
    data = gguf_cache.read_file(path, "tokenizer.json")
    if data is None:
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_str(data.decode())
        return dict(backend=backend, special_tokens=dict(info["special_tokens"]),
                    chat_template=info["chat_template"],
                    generation_config=GenerationConfig(
                        eos_token_id=tuple(int(i) for i in info["eos_token_id"])))
    except Exception as e:  # noqa: BLE001  (tokenizers raises its own error types)
        logger.warning("ignoring the kept GGUF tokenizer of %s: %s", path, e)
        return None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _convert(path: str | os.PathLike) -> dict[str, Any]:
    """The pieces of a GGUF file's tokenizer, for :func:`forge_jax.text.api.load_tokenizer`:
    ``backend`` (a ``tokenizers.Tokenizer``), ``special_tokens``, ``chat_template`` and
    ``generation_config``.

    ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` and
    ``merges``, control tokens as special tokens, a BOS first when
    ``tokenizer.ggml.add_bos_token`` is set (Llama 3's). ``llama``: SentencePiece-style tokens with
    scores and types (:mod:`forge_jax.models.checkpoints.gguf_sentencepiece`). Another model is a
    CheckpointError naming it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from forge_jax.models.checkpoints import gguf_sentencepiece

    reader = open_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: its tokenizer model {kind!r} (tokenizer.ggml.model) is "
                              f"not supported; forge_jax builds 'gpt2' (byte-level BPE) and "
                              f"'llama' (SentencePiece) vocabularies from GGUF files")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        get = lambda name: _field(reader, f"tokenizer.ggml.{name}")
        flag = lambda name, default: bool(default if get(name) is None else get(name))
        backend = gguf_sentencepiece.tokenizer(
            tokens, get("scores"), types, unk_id=get("unknown_token_id"),
            bos_id=get("bos_token_id"), eos_id=get("eos_token_id"),
            add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
            add_space_prefix=flag("add_space_prefix", True))
        return _parts(reader, tokens, backend)
    merges = _field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=False) if kind in (3, 4)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # tokenizer.ggml.add_bos_token (off unless set, as llama.cpp reads a BPE vocabulary's):
    # the post-processor adds the BOS, so that every prompt is encoded as llama.cpp does.
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token") and bos is not None \
            and 0 <= bos < len(tokens):
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return _parts(reader, tokens, backend)


def _parts(reader, tokens: list[str], backend) -> dict[str, Any]:
    special = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            special[{"unknown": "unk_token", "padding": "pad_token"}.get(
                name, f"{name}_token")] = tokens[i]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return dict(backend=backend, special_tokens=special,
                chat_template=_field(reader, "tokenizer.chat_template"),
                generation_config=GenerationConfig(eos_token_id=() if eos is None else (eos,)))
