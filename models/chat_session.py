"""A multi-turn conversation that keeps its KV cache between turns.

Each turn renders the whole conversation with the chat template, as :func:`text.chat`
does, but prefills only the tokens that the cache does not already hold: the cache keeps
the tokens of the conversation so far (the last prompt and the reply), and a new turn's
tokens are compared with them; the longest common prefix is kept and only the rest is
prefilled. When the template renders the history exactly as it was generated (the usual
case), that is the closing of the last reply and the new message; when it does not (a
template that rewrites earlier turns, a reply that re-encodes to other tokens), the cache
is cut back to where they first differ. The reply is therefore always the one a fresh
prefill of the whole conversation would give.

Usage::

    from forge_jax.models import llama, text
    from forge_jax.models.chat_session import ChatSession
    session = ChatSession(llama.from_pretrained(DIR), text.load_tokenizer(DIR))
    for piece in session.stream("Hello! Who are you?"):
        print(piece, end="", flush=True)
    reply = session.send("And what can you do?")   # only this turn's tokens are prefilled
    session.reset()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.kv_cache import PagedKVCache
from forge_jax.models import generation
from forge_jax.models import steps as steps_lib
from forge_jax.models import text as text_lib
from forge_jax.models.llama_model import Llama

DEFAULT_MAX_CONTEXT = 4096


class ContextFullError(ValueError):
    """The conversation with the new message does not fit the session's context."""


@dataclasses.dataclass
class TurnStats:
    """What one turn did.

    Attributes:
      prompt_tokens: the conversation's tokens with the new message, as rendered.
      reused_tokens: of those, the ones already in the KV cache (not prefilled again).
      prefilled_tokens: ``prompt_tokens - reused_tokens``, the tokens the prefill ran on.
      new_tokens: tokens generated (the eos that ended the reply included).
      first_token_seconds: from the turn's start (the template rendered) to the first
        new token on the host, compilation included if the prefill's shape is new.
      decode_seconds: the decode steps, from the first token to the last.
      decode_steps: decode steps run.
      context_full: the reply stopped because the context was full.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    new_tokens: int = 0
    first_token_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    context_full: bool = False

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class ChatSession:
    """A conversation with a model that keeps its paged KV cache between turns.

    Args:
      model: a :class:`~forge_jax.models.llama.Llama`.
      tokenizer: a :class:`~forge_jax.models.text.Tokenizer` with a chat template.
      max_context: tokens the conversation may hold (prompt and replies); default the
        model's ``max_position_embeddings``, at most 4096. The cache for all of them is
        allocated up front (``forge_jax.memory`` checks it fits).
      page_size: tokens per page of the paged cache.
      system: an optional system message that starts the conversation (kept by
        :meth:`reset`).
      max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed,
        eos_token_id, generation_config: as in :func:`~forge_jax.models.text.generate_text`
        (defaults from the checkpoint's generation_config.json).

    Raises:
      forge_jax.models.text.ChatTemplateError: the tokenizer has no chat template.
    """

    def __init__(self, model: Llama, tokenizer: text_lib.Tokenizer, *,
                 max_context: int | None = None, page_size: int = 16,
                 system: str | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int = 0,
                 eos_token_id: int | Sequence[int] | None = None,
                 generation_config: text_lib.GenerationConfig | None = None):
        if not tokenizer.chat_template:
            raise text_lib.ChatTemplateError(
                f"{tokenizer.name} has no chat template (no 'chat_template' in "
                f"tokenizer_config.json and no chat_template.jinja): a chat needs one")
        if getattr(model, "mesh", None) is not None:
            raise ValueError("ChatSession runs a model on one device; this one is sharded "
                             "over a mesh (load it without mesh=)")
        config = model.config
        if max_context is None:
            max_context = min(config.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context must be an int >= 2, got {max_context=!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size=!r}")
        if system is not None:
            text_lib.check_messages([{"role": "system", "content": system}])
        gen_config = tokenizer.generation_config if generation_config is None \
            else generation_config
        self.sampling = (gen_config or text_lib.GenerationConfig()).sampling_params(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty)
        if max_new_tokens is None:
            max_new_tokens = (gen_config.max_new_tokens if gen_config and gen_config.max_new_tokens
                              else text_lib.DEFAULT_MAX_NEW_TOKENS)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=!r}")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(text_lib.eos_ids(model, tokenizer, gen_config, eos_token_id))
        self.key = jax.random.key(seed)
        pages = -(-max_context // page_size)
        self.max_context = max_context
        generation.check_generation_fits(
            config, batch=1, longest_prompt=max_context - 1, max_new_tokens=1, cache="paged",
            page_size=page_size, param_dtype=model.param_dtype, dtype=model.dtype)
        self._cache = PagedKVCache.create(
            num_layers=config.num_hidden_layers, num_pages=pages, page_size=page_size,
            kv_heads=model.kv_heads, head_dim=config.head_dim, dtype=model.dtype,
            block_tables=np.arange(pages, dtype=np.int32)[None])
        self._graphdef, self._state = nnx.split(model)
        self._statics = steps_lib.step_statics(self._graphdef, self.sampling.mode)
        self._params = self.sampling.arrays()
        self.turns = 0
        self.messages: list[dict[str, str]] = []
        self.cached_tokens: list[int] = []  # what the KV cache holds, position by position
        self.last_turn = TurnStats()
        self.reset()

    def reset(self) -> None:
        """Forgets the conversation (the system message stays); the next turn prefills
        from the start."""
        self.messages = [] if self.system is None else [{"role": "system",
                                                         "content": self.system}]
        self.cached_tokens = []

    def send(self, content: str, *, on_text: Callable[[str], None] | None = None,
             max_new_tokens: int | None = None) -> str:
        """Adds a user message and returns the assistant's reply (also added);
        ``on_text(piece)`` is called with each piece of it as it is decoded."""
        pieces = []
        for piece in self.stream(content, max_new_tokens=max_new_tokens):
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)
        return "".join(pieces)

    def stream(self, content: str, *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Adds a user message and yields the assistant's reply piece by piece as it is
        decoded. The message is checked, rendered and fitted to the context before
        anything runs (errors are raised by the first ``next``); the conversation and the
        cache are updated when the reply ends, or when the iterator is closed early (with
        the reply so far)."""
        message = {"role": "user", "content": content}
        text_lib.check_messages([message])
        messages = [*self.messages, message]
        start = time.perf_counter()
        ids = text_lib.encode_chat(self.tokenizer, messages)
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=!r}")
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextFullError(
                f"the conversation with this message has {len(ids)} tokens and the context "
                f"holds {self.max_context} (max_context): /reset, or start a session with a "
                f"larger max_context")
        return self._turn(messages, ids, min(max_new, room), room < max_new, start)

    def _turn(self, messages, ids, max_new, capped, start) -> Iterator[str]:
        stats = TurnStats(prompt_tokens=len(ids))
        # At least the last prompt token is prefilled: its logits give the first token.
        reused = min(_common_prefix(self.cached_tokens, ids), len(ids) - 1)
        stats.reused_tokens, stats.prefilled_tokens = reused, len(ids) - reused
        new = ids[reused:]
        bucket = generation.prompt_bucket(len(new))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :len(new)] = new
        seen = jnp.asarray(steps_lib.seen_tokens([ids], 1, self.model.config.vocab_size))
        key = jax.random.fold_in(self.key, self.turns)
        self.turns += 1
        self.cached_tokens = list(ids[:reused])  # the cache keeps these; the rest is rewritten
        cache = self._cache.with_lengths(jnp.asarray([reused], jnp.int32))
        self._cache = None  # donated below
        first, seen, cache = steps_lib.prefill_step(
            self._state, cache, jnp.asarray(tokens), jnp.asarray([len(new)], jnp.int32), key,
            self._params, seen, **self._statics)
        active = jnp.ones((1,), bool)
        reply: list[int] = []
        pieces: list[str] = []
        streamer = text_lib.TextStreamer(self.tokenizer, 1, self.eos,
                                         lambda b, piece: pieces.append(piece))

        def take(token: int) -> bool:  # a token on the host; True when it ends the reply
            reply.append(token)
            streamer(len(reply) - 1, np.asarray([token]))
            return token in self.eos

        steps, decode_start = 0, None
        try:
            done = take(int(np.asarray(first)[0]))
            stats.first_token_seconds = time.perf_counter() - start
            decode_start = time.perf_counter()
            yield from pieces
            pieces.clear()
            newest, i = first, 1
            while not done and i < max_new:
                # Step i feeds token i - 1 and gives token i; token i - 1 is read on the
                # host while it runs (one step behind, as generate's eos check).
                following, seen, cache = steps_lib.decode_step(
                    self._state, cache, newest, active, key, jnp.asarray(i, jnp.int32),
                    self._params, seen, **self._statics)
                steps += 1
                if i >= 2:
                    done = take(int(np.asarray(newest)[0]))
                    yield from pieces
                    pieces.clear()
                newest, i = following, i + 1
            if not done and steps:  # the last step's token, not read yet
                done = take(int(np.asarray(newest)[0]))
            streamer.close()
            yield from pieces
            pieces.clear()
            stats.context_full = capped and not done
        finally:
            if steps:
                jax.block_until_ready(cache.lengths)
                stats.decode_seconds = time.perf_counter() - decode_start
            self._cache = cache
            stats.decode_steps, stats.new_tokens = steps, len(reply)
            # The cache now holds the prompt and the tokens the decode steps were fed.
            self.cached_tokens = list(ids) + reply[:steps]
            text = self.tokenizer.decode(reply[:-1] if reply and reply[-1] in self.eos
                                         else reply)
            self.messages = [*messages, {"role": "assistant", "content": text}]
            self.last_turn = stats
