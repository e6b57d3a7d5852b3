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

The new tokens are prefilled in chunks of one shape (``prefill_chunk``), so the session
compiles two steps, a prefill and a decode step, once: in its first turn (reported apart,
in :attr:`TurnStats.compile_seconds`) or in :meth:`ChatSession.warm_up`. A later turn,
whatever its length, compiles nothing.

A reply can be stopped mid-stream by closing its iterator (``close()``), or by an
exception such as a Ctrl-C while it runs: the turn ends with the reply so far in the
conversation and the cache consistent with it, and the next turn goes on from there.

Usage::

    from forge_jax import text
    from forge_jax.models import llama
    session = text.ChatSession(llama.from_pretrained(DIR), text.load_tokenizer(DIR))
    for piece in session.stream("Hello! Who are you?"):
        print(piece, end="", flush=True)
    reply = session.send("And what can you do?")   # only this turn's tokens are prefilled
    stream = session.stream("Tell me a long story.")
    for _, piece in zip(range(5), stream):     # five pieces, then stop the reply
        print(piece, end="", flush=True)
    stream.close()                             # the story so far stays in session.messages
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

from forge_jax.generation import compiled_cache, settings
from forge_jax.generation import loop as generation
from forge_jax.generation import steps as steps_lib
from forge_jax.generation.sampling import SamplingParams
from forge_jax.kv_cache import CacheSpec
from forge_jax.models.checkpoints.generation_config import GenerationConfig
from forge_jax.models.protocol import CausalLM
from forge_jax.text.chat_template import ChatTemplateError, check_messages
from forge_jax.text.streaming import TextStreamer
from forge_jax.text.tokenizer import Tokenizer, encode_chat

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
      compile_seconds: compiling the steps and their first run on nothing (per
        executable runtimes), in the session's first turn unless :meth:`ChatSession.warm_up`
        ran before; 0 in later turns. Not included in the times below.
      first_token_seconds: from the turn's start (the template rendered) to the first
        new token on the host, compilation excluded (the wall time to the first token
        is ``compile_seconds + first_token_seconds``).
      decode_seconds: the decode steps, from the first token to the last.
      decode_steps: decode steps run.
      context_full: the reply stopped because the context was full.
      stopped: the reply was cut short: its stream closed early, or an exception (a
        Ctrl-C) raised while it ran. The reply so far is kept in the conversation.
    """

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    new_tokens: int = 0
    compile_seconds: float = 0.0
    first_token_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    context_full: bool = False
    stopped: bool = False

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _deleted(cache) -> bool:
    """Whether a cache's buffers were donated to a step whose result was lost."""
    return any(leaf.is_deleted() for leaf in jax.tree.leaves(cache))


class ChatSession:
    """A conversation with a model that keeps its paged KV cache between turns.

    One turn is open at a time: :meth:`send`, :meth:`stream` or :meth:`reset` while an
    earlier :meth:`stream` is still open ends that turn first, as closing its iterator
    does (the reply so far is kept).

    Args:
      model: a :class:`~forge_jax.models.protocol.CausalLM` (a ``Llama``, ``DeepseekV3``, ...).
      tokenizer: a :class:`~forge_jax.text.Tokenizer` with a chat template.
      max_context: tokens the conversation may hold (prompt and replies); default the
        model's ``max_position_embeddings``, at most 4096. The cache for all of them is
        allocated up front (``forge_jax.memory`` checks it fits).
      cache: a :class:`~forge_jax.kv_cache.CacheSpec` of kind ``"paged"`` (None:
        ``CacheSpec()``, 16-token pages in the model's compute dtype; ``kv_dtype="int8"``
        or ``"fp8"`` quantizes it).
      prefill_chunk: a turn's new tokens are prefilled in chunks of this many (the last
        one padded), so that every turn runs the same compiled prefill: a turn whose
        length is new to the session compiles nothing. 32 keeps a short turn's padding
        cheap on a CPU, where a prefill's time grows with its rows from ~16 on.
      system: an optional system message that starts the conversation (kept by
        :meth:`reset`).
      max_new_tokens, sampling, eos_token_id, generation_config: as in
        :func:`~forge_jax.text.api.generate_text` (defaults from the checkpoint's
        generation_config.json, resolved by :func:`forge_jax.generation.settings.stopping`
        and :func:`~forge_jax.generation.settings.sampling_params`); ``max_new_tokens`` is
        per turn, and a turn also stops when the context is full.
      **deprecated: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``seed`` (now in ``sampling``), ``page_size``,
        ``cache_dtype`` and ``kv_cache_dtype`` (now in ``cache``): accepted with a
        ``DeprecationWarning`` until the next release.

    Raises:
      forge_jax.text.api.ChatTemplateError: the tokenizer has no chat template.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, *, max_context: int | None = None,
                 cache: CacheSpec | None = None, prefill_chunk: int = 32,
                 system: str | None = None, max_new_tokens: int | None = None,
                 sampling: SamplingParams | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 generation_config: GenerationConfig | None = None, **deprecated):
        legacy = settings.legacy_keywords("ChatSession", deprecated, sampling=sampling,
                                          cache=cache)
        cache = settings.cache_spec("ChatSession", cache, legacy)
        if cache.kind != "paged":
            raise ValueError(f"ChatSession keeps a paged cache, got cache={cache!r}")
        if not tokenizer.chat_template:
            raise ChatTemplateError(
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
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk=!r}")
        if system is not None:
            check_messages([{"role": "system", "content": system}])
        gen_config = tokenizer.generation_config if generation_config is None \
            else generation_config
        if sampling is None:
            sampling = settings.sampling_params(gen_config, **legacy.sampling)
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {sampling!r}")
        self.sampling = sampling
        if isinstance(max_new_tokens, bool) or max_new_tokens is not None and (
                not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=!r}")
        stop = settings.stopping(config, gen_config, eos_token_id=eos_token_id,
                                 max_new_tokens=max_new_tokens,
                                 tokenizer_eos_id=tokenizer.eos_token_id)
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.max_new_tokens = max(1, stop.max_new_tokens)
        self.prefill_chunk = prefill_chunk
        self.eos = frozenset(stop.eos_token_ids)
        self.key = jax.random.key(sampling.seed)
        self.max_context = max_context
        self.cache_spec = cache
        generation.check_generation_fits(
            model, batch=1, longest_prompt=max_context - 1, max_new_tokens=1, cache=cache,
            param_dtype=model.param_dtype, dtype=model.dtype)
        self._cache = self._new_cache()
        self._graphdef, self._state = nnx.split(model)
        self._statics = steps_lib.step_statics(self._graphdef, self.sampling.greedy)
        self._params = self.sampling.arrays()
        self._warm = {"prefill": False, "decode": False}  # steps run once in this session
        self._open: Iterator[str] | None = None  # the stream of the turn in progress
        self.turns = 0
        self.messages: list[dict[str, str]] = []
        self.cached_tokens: list[int] = []  # what the KV cache holds, position by position
        self.last_turn = TurnStats()
        self.reset()

    def _new_cache(self):
        """The model's paged cache of one row, its pages in order
        (:meth:`~forge_jax.models.protocol.CausalLM.create_cache`)."""
        spec = self.cache_spec
        pages = -(-self.max_context // spec.page_size)
        return self.model.create_cache(
            spec, batch=1, max_len=pages * spec.page_size, num_pages=pages,
            block_tables=np.arange(pages, dtype=np.int32)[None])

    @property
    def page_size(self) -> int:
        """Tokens per page of the session's cache (``cache_spec.page_size``)."""
        return self.cache_spec.page_size

    @property
    def kv_cache_dtype(self) -> str | None:
        """The cache's quantized format, ``"int8"`` or ``"fp8"`` (``cache_spec.kv_dtype``),
        or None."""
        return self.cache_spec.kv_dtype

    def reset(self) -> None:
        """Forgets the conversation (the system message stays); the next turn prefills
        from the start. An open stream is ended first."""
        self.stop()
        self.messages = [] if self.system is None else [{"role": "system",
                                                         "content": self.system}]
        self.cached_tokens = []

    def stop(self) -> None:
        """Ends the turn of an open :meth:`stream`, as closing its iterator does: the reply
        so far is kept (a stream not started yet is dropped, with its message). Nothing
        happens when no stream is open. Call it from the thread that iterates the stream,
        between two pieces."""
        stream, self._open = self._open, None
        if stream is not None:
            if getattr(stream, "gi_running", False):
                raise RuntimeError("a ChatSession turn cannot be ended from inside itself")
            stream.close()

    def warm_up(self) -> float:
        """Compiles the prefill and decode steps and runs each once on nothing (no token
        written), so that the first turn's time to first token is its work alone; the
        first turn does this itself otherwise (in its ``compile_seconds``). Returns the
        seconds it took (about one prefill and one decode step when the steps were
        compiled before in this process)."""
        self.stop()
        return self._warm_up(decode=True)

    def _check_cache(self) -> None:
        """A new cache (and nothing reused) if a step the cache was donated to was
        interrupted and its result lost (a Ctrl-C)."""
        if self._cache is None or _deleted(self._cache):
            self._cache, self.cached_tokens = self._new_cache(), []

    def _warm_up(self, decode: bool, run: bool = True) -> float:
        """The steps' first runs in this session, on nothing: compiling them if new to the
        process, and building their per-executable runtimes (a compiled step's first run
        costs several of its later runs on a CPU). Returns the seconds (0.0: nothing
        to do). ``run=False``: where the steps are kept on disk
        (:mod:`forge_jax.generation.compiled_cache`), the prefill is only loaded, and its
        first run is the turn's own (one prefill fewer before a start's first token)."""
        self._check_cache()
        if self._warm["prefill"] and (self._warm["decode"] or not decode):
            return 0.0
        start = time.perf_counter()
        seen = jnp.zeros((1, self.model.config.vocab_size), bool)
        if not self._warm["prefill"] and not run and compiled_cache.active_directory():
            steps_lib.prefill_step.compiled(
                self._state, self._cache, jnp.zeros((1, self.prefill_chunk), jnp.int32),
                jnp.zeros((1,), jnp.int32), self.key, self._params, seen, **self._statics)
            self._warm["prefill"] = True
        if not self._warm["prefill"]:
            tokens = jnp.zeros((1, self.prefill_chunk), jnp.int32)
            first, _, self._cache = steps_lib.prefill_step(
                self._state, self._cache, tokens, jnp.zeros((1,), jnp.int32), self.key,
                self._params, seen, **self._statics)
            jax.block_until_ready(first)
            self._warm["prefill"] = True
        if decode and not self._warm["decode"]:
            first, _, self._cache = steps_lib.decode_step(
                self._state, self._cache, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool),
                self.key, jnp.asarray(1, jnp.int32), self._params, seen, **self._statics)
            jax.block_until_ready(first)
            self._warm["decode"] = True
        return time.perf_counter() - start

    def _warm_decode(self, cache, token, key):
        """The decode step's first run, on the turn's cache with no row active (nothing
        written) and a ``seen`` of its own (the step donates it): (its seconds, the
        cache)."""
        start = time.perf_counter()
        _, _, cache = steps_lib.decode_step(
            self._state, cache, token, jnp.zeros((1,), bool), key, jnp.asarray(1, jnp.int32),
            self._params, jnp.zeros((1, self.model.config.vocab_size), bool), **self._statics)
        jax.block_until_ready(cache.lengths)
        self._warm["decode"] = True
        return time.perf_counter() - start, cache

    def send(self, content: str, *, on_text: Callable[[str], None] | None = None,
             max_new_tokens: int | None = None) -> str:
        """Adds a user message and returns the assistant's reply (also added);
        ``on_text(piece)`` is called with each piece of it as it is decoded. An
        exception (e.g. a KeyboardInterrupt in ``on_text``) ends the turn with the reply
        so far, then propagates."""
        pieces = []
        stream = self.stream(content, max_new_tokens=max_new_tokens)
        try:
            for piece in stream:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)
        finally:
            stream.close()
        return "".join(pieces)

    def stream(self, content: str, *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Adds a user message and yields the assistant's reply piece by piece as it is
        decoded. The message is checked, rendered and fitted to the context here, before
        anything runs; the conversation and the cache are updated when the reply ends,
        or when the iterator is closed early (``close()``: the reply so far is kept, and
        ``last_turn.stopped`` is set), or when an exception (a Ctrl-C) is raised while it
        runs. An earlier stream still open is ended first (:meth:`stop`)."""
        self.stop()
        message = {"role": "user", "content": content}
        check_messages([message])
        messages = [*self.messages, message]
        start = time.perf_counter()
        ids = encode_chat(self.tokenizer, messages)
        render_seconds = time.perf_counter() - start
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens=!r}")
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextFullError(
                f"the conversation with this message has {len(ids)} tokens and the context "
                f"holds {self.max_context} (max_context): /reset, or start a session with a "
                f"larger max_context")
        self._open = self._turn(messages, ids, min(max_new, room), room < max_new,
                                render_seconds)
        return self._open

    def _turn(self, messages, ids, max_new, capped, render_seconds) -> Iterator[str]:
        stats = TurnStats(prompt_tokens=len(ids))
        # Only the prefill before the first token; the decode step is made ready after it.
        stats.compile_seconds = self._warm_up(decode=False, run=False)
        start = time.perf_counter() - render_seconds  # the turn's start, compiling aside
        # At least the last prompt token is prefilled: its logits give the first token.
        reused = min(_common_prefix(self.cached_tokens, ids), len(ids) - 1)
        stats.reused_tokens, stats.prefilled_tokens = reused, len(ids) - reused
        seen = jnp.asarray(steps_lib.seen_tokens([ids], 1, self.model.config.vocab_size))
        key = jax.random.fold_in(self.key, self.turns)
        self.turns += 1
        self.cached_tokens = list(ids[:reused])  # the cache keeps these; the rest is rewritten
        cache = self._cache.with_lengths(jnp.asarray([reused], jnp.int32))
        self._cache = None  # donated below; put back (or remade) in `finally`
        held = reused  # the tokens of `ids` (then of the reply) the cache holds
        reply: list[int] = []
        pieces: list[str] = []
        streamer = TextStreamer(self.tokenizer, 1, self.eos,
                                         lambda b, piece: pieces.append(piece))

        def take(token: int) -> bool:  # a token on the host; True when it ends the reply
            reply.append(token)
            streamer(len(reply) - 1, np.asarray([token]))
            return token in self.eos

        steps, decode_start, done = 0, None, False
        try:
            # The new tokens in chunks of one shape; each continues the cache. Only the
            # last chunk's sample is the first token (each chunk is given the prompt's
            # `seen`, so the others' samples leave no trace).
            chunk = self.prefill_chunk
            for lo in range(reused, len(ids), chunk):
                new = ids[lo:lo + chunk]
                tokens = np.zeros((1, chunk), np.int32)
                tokens[0, :len(new)] = new
                first, first_seen, cache = steps_lib.prefill_step(
                    self._state, cache, jnp.asarray(tokens), jnp.asarray([len(new)], jnp.int32),
                    key, self._params, seen, **self._statics)
                held = lo + len(new)
            seen = first_seen
            done = take(int(np.asarray(first)[0]))
            stats.first_token_seconds = time.perf_counter() - start
            yield from pieces
            pieces.clear()
            if not done and max_new > 1 and not self._warm["decode"]:
                warm, cache = self._warm_decode(cache, first, key)
                stats.compile_seconds += warm
            decode_start = time.perf_counter()
            newest, i = first, 1
            active = jnp.ones((1,), bool)
            while not done and i < max_new:
                # Step i feeds token i - 1 and gives token i; token i - 1 is read on the
                # host while it runs (one step behind, as generate's eos check).
                following, seen, cache = steps_lib.decode_step(
                    self._state, cache, newest, active, key, jnp.asarray(i, jnp.int32),
                    self._params, seen, **self._statics)
                steps += 1
                held += 1
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
            self._end_turn(stats, messages, ids, reply, cache, held, steps, decode_start,
                           finished=done or len(reply) == max_new)

    def _end_turn(self, stats: TurnStats, messages, ids, reply, cache, held, steps,
                  decode_start, finished) -> None:
        """Keeps the conversation and the cache consistent however the turn ended: the
        reply so far joins the conversation (a turn with no token leaves it as it was),
        and ``cached_tokens`` is what the cache holds (if a step's inputs were donated
        and its result lost, to a Ctrl-C, the next turn starts a new cache)."""
        if steps and not _deleted(cache):
            jax.block_until_ready(cache.lengths)
        if steps:
            stats.decode_seconds = time.perf_counter() - decode_start
        self._cache = cache
        stats.decode_steps, stats.new_tokens = steps, len(reply)
        stats.stopped = not finished
        self.cached_tokens = (list(ids) + reply)[:held]
        if reply:
            text = self.tokenizer.decode(reply[:-1] if reply[-1] in self.eos else reply)
            self.messages = [*messages, {"role": "assistant", "content": text}]
        self.last_turn = stats
