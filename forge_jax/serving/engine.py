"""A serving engine: continuous batching over ragged paged attention, chunked prefill, a
prefix cache, preemption, streaming and cancellation.

Requests are added and cancelled from any thread or asyncio task; each returns a
:class:`RequestStream` of :class:`Output` events (new token ids, their text, and at the
end a finish reason: ``stop``, ``length``, ``cancelled`` or ``error``). Every step packs
the decode token of each running request and chunks of waiting prompts into one
:func:`forge_jax.ragged_paged_attention` batch under a token budget
(:func:`forge_jax.serving.batch_step.ragged_step`, jitted for a few bucketed shapes,
pages donated)::

    engine = Engine(model, tokenizer, EngineConfig(max_batch_tokens=512, num_pages=512))
    engine.start()                                   # the step loop, in a thread
    stream = engine.submit(prompt_ids, RequestParams(
        max_tokens=32, sampling=SamplingParams(temperature=0.7)))
    for out in stream:                               # or: async for out in stream
        print(out.text, end="")
    engine.shutdown()

The engine's pools are the model's (:meth:`~forge_jax.models.protocol.CausalLM.create_pool`:
a :class:`forge_jax.kv_cache.PagedKVCache` for a Llama, a
:class:`forge_jax.kv_cache.PagedLatentCache` for DeepSeek-V3; its spec is the config's
``cache``); pages come from a :class:`forge_jax.kv_cache.BlockManager`; full pages
stay in the :class:`~forge_jax.serving.prefix_cache.PrefixCache` after their request ends and are
evicted (least recently used) only when the pool needs them. When the pool runs out, the
newest running request is preempted: its pages are freed and it is requeued, to be
recomputed from its prompt and the tokens it has so far. A request that could never fit
is refused at once (:class:`RequestRefused`, with the numbers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation import settings
from forge_jax.kv_cache import BlockManager, CacheFullError
from forge_jax.serving import admission, speculation
from forge_jax.serving import batch_step as serving_step
from forge_jax.serving import config as engine_config
from forge_jax.serving.batch_step import MIN_TABLE_PAGES  # noqa: F401  (the engine's API)
from forge_jax.serving.config import EngineConfig
from forge_jax.serving.prefix_cache import PrefixCache
from forge_jax.serving.requests import (  # noqa: F401  (the engine's API)
    FINISH_REASONS,
    PHASES,
    EngineStats,
    Output,
    PhaseClock,
    QueueFull,
    Request,
    RequestParams,
    RequestRefused,
    RequestStream,
)
from forge_jax.serving.state_slots import StateSlots


class Engine:
    """Continuous batching of many requests over one model and one page pool.

    Args:
      model: a model ``from_pretrained`` loads (its ``forward_cached`` takes the cache).
      tokenizer: a :class:`forge_jax.text.api.Tokenizer` for the text of the outputs
        and stop strings (None: token ids only).
      config: the engine's knobs, an :class:`~forge_jax.serving.config.EngineConfig`.
      **deprecated: the loose keywords of the last release (``max_batch_tokens=``,
        ``page_size=``, ``kv_cache_dtype=``, ...), mapped onto ``config`` with a
        ``DeprecationWarning``; removed in the next release.

    Attributes:
      config: the :class:`EngineConfig` it was built with.
      cache: the page pools (the model's ``create_pool``; for a Llama a
        :class:`~forge_jax.kv_cache.PagedKVCache`) of
        ``config.num_pages`` pages (never folded: its block tables are unused, ``[0,
        pages_per_seq]``; each step brings its own in a
        :class:`~forge_jax.kv_cache.RaggedMetadata`). On a mesh the pools are placed as
        the model's ``cache_shardings`` says (a Llama's split by KV head over the tensor
        axis; a latent pool, shared by every head, replicated).
      manager: the :class:`~forge_jax.kv_cache.BlockManager` handing out its pages.
    """

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None,
                 **deprecated):
        if deprecated:
            config = engine_config.from_keywords(config, deprecated)
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a forge_jax.serving.EngineConfig, got "
                            f"config={config!r:.80}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        model_config = model.config
        self.kv_cache_dtype = config.cache.kv_dtype
        self.max_model_len = int(config.max_model_len or model_config.max_position_embeddings)
        self.max_batch_tokens = serving_step.pow2_at_least(config.max_batch_tokens, 8)
        self.min_batch_tokens = serving_step.pow2_at_least(config.min_batch_tokens, 1)
        self.max_seqs, self.max_waiting = config.max_seqs, config.max_waiting
        self.overlap = config.overlap
        self.page_size = config.cache.page_size
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.manager = BlockManager(config.num_pages, self.page_size)
        self.prefix_cache = PrefixCache(self.manager, enabled=config.prefix_caching)
        # The generation front door resolves the eos ids, as for generate and chat.
        stop = settings.stopping(model_config, getattr(model, "generation_config", None),
                                 eos_token_id=config.eos_token_ids)
        self.eos = frozenset(stop.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.graphdef, self.state = nnx.split(model)
        # The weights as a flat list: a step's dispatch then flattens a list, not the state.
        self.weights, self.weights_def = jax.tree.flatten(self.state)
        self._graphdef = serving_step.Static(self.graphdef)  # hashed once, not per dispatch
        # The model's pool (on a mesh, created in its shards), whatever its pages hold.
        cache = model.create_pool(config.cache, num_pages=config.num_pages,
                                  pages_per_seq=self.pages_per_seq, max_seqs=config.max_seqs,
                                  prefix_caching=config.prefix_caching)
        self.cache = cache
        self.state_slots = StateSlots.of(cache)  # a model's state slot per running sequence
        self.draft = speculation.draft_model(self)  # a draft model's pool, or None
        # The last step's tokens on the device, [max_seqs] (the next step may read some),
        # and the step in flight: its tokens and the (index, request) pairs that drew one.
        tokens = jnp.zeros((self.max_seqs,), jnp.int32)
        self._last_tokens = tokens if model.mesh is None else jax.device_put(
            tokens, model.mesh.replicated())
        self._in_flight: tuple[jax.Array, list[tuple[int, Request]]] | None = None
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._waiting: list[Request] = []  # by arrival (preempted ones go back in order)
        self._running: list[Request] = []  # by arrival
        self._ids = itertools.count()
        self._rng = np.random.default_rng()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_error: Exception | None = None
        self.gauges: dict = {}
        self._grammar_tokenizer = None  # built at the first constrained request

    # -- the public API -------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: RequestParams | None = None, *,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Adds a request (any thread; from an asyncio task its stream is async by default).

        Raises:
          RequestRefused: an empty prompt, ids outside the vocabulary, or a prompt plus
            ``max_tokens`` that can never fit the context or the page pool.
          QueueFull: ``max_waiting`` requests are already waiting.
          forge_jax.generation.constraints.ConstraintError: the request's
            ``sampling.constraint`` is a grammar the grammar engine rejects, or this
            engine's tokenizer cannot serve one.
        """
        params = RequestParams() if params is None else params
        prompt = [int(t) for t in prompt]
        self.check_fits(prompt, params)
        matcher = self.matcher(params.sampling.constraint)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        stream = RequestStream(self, next(self._ids), loop)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        request = Request(stream.id, prompt, params, stream, seed, time.monotonic())
        if matcher is not None:
            request.matcher, request.mask = matcher, matcher.mask()
        with self._lock:
            if self._stopping:
                raise QueueFull("the engine is shutting down")
            if len(self._waiting) + len(self._inbox) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting) + len(self._inbox)} requests waiting, "
                                f"the limit is max_waiting={self.max_waiting}")
            self._inbox.append(request)
            self._wake.notify()
        return stream

    def matcher(self, constraint):
        """``constraint``'s grammar matcher here (None: None), or a ``ConstraintError``."""
        if constraint is None:
            return None
        from forge_jax.generation import constraints

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = constraints.GrammarTokenizer(
                self.tokenizer, self.vocab_size, sorted(self.eos))
        return constraint.matcher(self._grammar_tokenizer)

    def check_fits(self, prompt: Sequence[int], params: RequestParams) -> None:
        """Raises :class:`RequestRefused` for a request that could never be served."""
        if not prompt:
            raise RequestRefused("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRefused(f"token id {bad[0]} is outside the vocabulary "
                                 f"(vocab_size={self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRefused(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}: "
                f"{total} tokens, more than the context of {self.max_model_len} tokens")
        pages = -(-total // self.page_size)
        if pages > self.manager.num_pages:
            raise RequestRefused(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"needs {pages} pages of {self.page_size} tokens, the pool has "
                f"{self.manager.num_pages}")

    def cancel(self, request_id: int) -> None:
        """Ends a request with ``cancelled`` (any thread; unknown or finished ids: no-op)."""
        with self._lock:
            self._cancels.add(request_id)
            self._wake.notify()

    def start(self) -> Engine:
        """Runs :meth:`step` in a daemon thread until :meth:`shutdown`."""
        self._thread = threading.Thread(target=self._loop, name="forge-jax-engine",
                                        daemon=True)
        self._thread.start()
        return self

    def shutdown(self, *, wait: float = 0.0) -> dict[str, int]:
        """Stops taking requests, lets the running ones finish for up to ``wait`` seconds,
        cancels the rest and stops the loop. Returns ``{"finished": n, "cancelled": m}``,
        the in-flight requests that finished and that were cancelled meanwhile."""
        with self._lock:
            self._stopping = True
            before = dict(self.stats.finished)
        deadline = time.monotonic() + wait
        while self.has_work() and time.monotonic() < deadline and self._thread:
            time.sleep(0.01)
        with self._lock:
            for r in self._inbox + self._waiting + self._running:
                self._cancels.add(r.id)
            self._wake.notify()
        if self._thread is None:
            self.step()
        else:
            while self.has_work():
                time.sleep(0.01)
            with self._lock:
                self._thread, thread = None, self._thread
                self._wake.notify()
            thread.join()
        cancelled = self.stats.finished["cancelled"] - before["cancelled"]
        return {"finished": sum(self.stats.finished.values()) - sum(before.values())
                - cancelled, "cancelled": cancelled}

    @property
    def stopping(self) -> bool:
        """Whether :meth:`shutdown` has begun (new requests are refused)."""
        return self._stopping

    def has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running or self._in_flight)

    def snapshot(self) -> dict:
        """Gauges for ``/metrics`` (any thread): requests running and waiting; pages used,
        held by the prefix cache and reclaimable, and the prefix-cache counters, as of the
        last step."""
        return dict(self.gauges, running=len(self._running),
                    waiting=len(self._waiting) + len(self._inbox))

    def _update_gauges(self) -> None:
        usage = self.manager.usage()
        self.gauges = dict(pages_total=usage.total_pages, pages_used=usage.used_pages,
                           pages_cached=len(self.prefix_cache),
                           pages_reclaimable=self.prefix_cache.reclaimable(),
                           prefix=dataclasses.replace(self.prefix_cache.stats))

    # -- the step -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._cancels or self._waiting or self._running
                           or self._in_flight):
                    if self._thread is None:
                        return
                    self._wake.wait()
            try:
                self.step()
            except Exception as e:  # the step's requests got the error; the engine goes on
                self.last_error = e

    def step(self) -> int:
        """One scheduling step: takes new requests and cancellations, runs one batch and
        streams its tokens (with ``overlap``, those of the step before, while this one
        runs). Returns the sequences it ran and the tokens it handed out (0 when idle)."""
        clock = PhaseClock(self.stats.phase_seconds)
        with self._lock:
            self._waiting += self._inbox
            self._inbox, cancels, self._cancels = [], self._cancels, set()
        for r in [r for r in self._waiting + self._running if r.id in cancels]:
            self._finish(r, "cancelled")
        clock.lap("intake")
        try:
            scheduled = self._schedule()
            clock.lap("schedule")
            tokens = self._dispatch(scheduled, clock) if scheduled else None
            handed = self._read_in_flight(clock)  # the step before (overlap), if any
            if scheduled:
                self._in_flight = (tokens, self._book(scheduled))
                clock.lap("book")
                if not self.overlap:
                    handed += self._read_in_flight(clock)
        except Exception as e:  # a failed step ends its requests, not the engine
            self._in_flight = None
            for r in self._waiting:  # preempted with a token in flight: it is recomputed
                r.pending = 0
            for r in list(self._running):
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._update_gauges()
        return len(scheduled) + handed

    def _schedule(self) -> list[tuple[Request, int]]:
        """The (request, new tokens) pairs of the next batch, pages appended for them."""
        budget, batch = self.max_batch_tokens, []
        preemptions = self.stats.preemptions
        # Full pages this step computes (key -> page): a waiting request whose prefix
        # continues into them shares them in this same step. Each layer writes the whole
        # step's keys and values before it attends, so its rows read them once written.
        fresh: dict[bytes, int] = {}
        for r in list(self._running):
            if r not in self._running:  # preempted while making room for an earlier one
                continue
            if len(batch) == self.max_seqs or budget == 0:
                break
            if r.pending and (len(r.generated) + 1 >= r.params.max_tokens
                              or len(r.tokens) + 1 >= self.max_model_len):
                continue  # the token in flight is its last
            speculates = speculation.speculates(self, r)
            if r.pending and (r.matcher is not None or speculates):
                continue  # its next mask or drafts need the token in flight: next step
            n = min(len(r.tokens) + r.pending - r.computed, budget)
            r.drafts = speculation.drafts(self, r, budget) if speculates and n == 1 else []
            n += len(r.drafts)
            if self._make_room(r, n):
                batch.append((r, n))
                budget -= n
            else:
                r.drafts = []
        for r, n in batch:
            admission.note_fresh(self, r, n, fresh)
        # Full pages that running requests compute in a later step: a waiting request whose
        # prefix continues into one of them waits until it is cached, rather than computing
        # it again (a burst sharing a system prompt prefills it once).
        in_flight = set()
        for r in self._running:
            if r.computed < len(r.prompt):
                in_flight.update(admission.uncomputed_keys(self, r))
        in_flight.difference_update(fresh)
        # After a preemption the pool is short: admit nothing new (nor the preempted) now.
        at = 0
        while (at < len(self._waiting) and budget and len(batch) < self.max_seqs
               and self.stats.preemptions == preemptions
               and self.state_slots.room(len(self._running))):
            r = self._waiting[at]
            if r.pending or in_flight and admission.next_prefix_key(self, r, fresh) in in_flight:
                at += 1
                continue
            if not admission.admit(self, r, budget, fresh):
                break
            self._waiting.pop(at)
            r.drafts = []
            self._running.append(r)
            self._running.sort(key=lambda x: x.arrival)
            n = min(len(r.tokens) - r.computed, budget)
            batch.append((r, n))
            budget -= n
            admission.note_fresh(self, r, n, fresh)
            in_flight.update(admission.uncomputed_keys(self, r))
            in_flight.difference_update(fresh)
        return batch

    def _make_room(self, r: Request, n: int) -> bool:
        """Appends ``n`` tokens' room to running request ``r``, evicting cached pages and then
        preempting the newest running requests as needed; False if ``r`` itself went."""
        while True:
            try:
                self.manager.append(r.id, n)
                return True
            except CacheFullError as e:
                if self.prefix_cache.evict(e.requested_pages - e.free_pages):
                    continue
                victim = self._running[-1]
                self._preempt(victim)
                if victim is r:
                    return False

    def _preempt(self, r: Request) -> None:
        self.manager.free(r.id)
        self._running.remove(r)
        r.computed, r.cached_pages = 0, 0
        r.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.append(r)
        self._waiting.sort(key=lambda x: x.arrival)

    def _dispatch(self, scheduled: list[tuple[Request, int]], clock: PhaseClock) -> jax.Array:
        """Builds and dispatches (asynchronously) the step; returns its tokens, [max_seqs]."""
        copies = self.manager.take_pending_copies()
        if copies.size:  # only a shared, partly filled page is copied (never here today)
            self.cache = speculation.copy_pages(self, copies)  # (and the draft's pool)
        batch = serving_step.build_batch(
            scheduled, self.manager, min_rows=self.min_batch_tokens, max_seqs=self.max_seqs,
            pages_per_seq=self.pages_per_seq, vocab_size=self.vocab_size,
            speculative=getattr(self.config.speculative, "num_tokens", 0),
            state_slots=self.state_slots)
        self.stats.compiled.add(batch.shape_key)
        clock.lap("build")
        out, self.cache = speculation.dispatch(self, batch)  # (a draft model's steps too)
        self._last_tokens = out[0] if isinstance(out, tuple) else out
        clock.lap("dispatch")
        return out

    def _book(self, scheduled: list[tuple[Request, int]]) -> list[tuple[int, Request]]:
        """Counts a dispatched step's rows as computed and offers the pages they fill to the
        prefix cache; returns the (index, request) pairs that draw a token in it."""
        drawn = []
        for i, (r, n) in enumerate(scheduled):
            if r.finished:  # ended by the step before's token: this row is not used
                continue
            self.stats.prompt_tokens += max(0, min(n, len(r.prompt) - r.computed))
            r.computed += n - len(r.drafts)  # drafts count once kept (when read)
            if self.prefix_cache.enabled:
                r.cached_pages = self.prefix_cache.insert(
                    r.tokens[:r.computed], self.manager.block_table(r.id), r.cached_pages,
                    keys=r.page_keys(self.page_size, r.computed // self.page_size))
            if r.computed == len(r.tokens):  # its known tokens are in: a new one is drawn
                r.pending, r.pending_index = 1, i
                drawn.append((i, r))
        self.stats.steps += 1
        return drawn

    def _read_in_flight(self, clock: PhaseClock) -> int:
        """Waits for the step in flight and hands out its tokens; returns how many."""
        if self._in_flight is None:
            return 0
        (tokens, drawn), self._in_flight = self._in_flight, None
        aux = {}
        if isinstance(tokens, tuple):  # (tokens, {their log-probabilities, verified drafts})
            tokens, aux = jax.device_get(tokens)
        logprobs = dict(aux["logprobs"], tokens=tokens) if "logprobs" in aux else None
        tokens = np.asarray(jax.device_get(tokens))
        clock.lap("device")
        now = time.monotonic()
        self.stats.recent.append((now, len(drawn)))
        while self.stats.recent and self.stats.recent[0][0] < now - 60:
            self.stats.recent.popleft()
        for i, r in drawn:
            r.pending = 0
            if r.drafts and not r.finished:  # its kept drafts and one more
                new = speculation.kept(self, r, aux["out"][i, :aux["count"][i]])
                for j, token in enumerate(new):
                    if not r.finished:
                        speculation.logprobs(r, aux, i, j)
                        self._accept(r, token, now)
            elif not r.finished:  # (cancelled meanwhile: the token is dropped)
                k = r.params.sampling.logprobs
                if k is not None:
                    r.logprobs.append(sampling_lib.host_logprobs(logprobs, i, k))
                self._accept(r, int(tokens[i]), now)
        clock.lap("output")
        return len(drawn)

    # -- outputs --------------------------------------------------------------------------

    def _accept(self, r: Request, token: int, now: float) -> None:
        r.generated.append(token)
        self.stats.generated_tokens += 1
        if r.first_token_at is None:
            r.first_token_at = now
            self.stats.ttft.observe(now - r.arrival)
        elif r.last_token_at is not None:
            self.stats.inter_token.observe(now - r.last_token_at)
        r.last_token_at = now
        p = r.params
        reason = None
        if token in r.stop_ids(self.eos):
            reason = "stop"
        elif r.matcher is not None and not r.matcher.consume(token):
            self._finish(r, "error", error=f"the grammar refused {token}: {r.matcher.error}")
            return
        elif r.matcher is not None and r.matcher.done:
            reason = "stop"  # the grammar is complete: only an eos could follow
        elif len(r.generated) >= p.max_tokens or len(r.tokens) >= self.max_model_len:
            reason = "length"
        if r.matcher is not None and reason is None:
            r.mask = r.matcher.mask()  # for its next step, while the device runs this one
        text, stopped = r.new_text(self.tokenizer, self.eos, final=reason is not None)
        if stopped:
            reason = "stop"
        if reason:
            self._finish(r, reason, text=text)
        else:
            self._emit(r, text)

    def _emit(self, r: Request, text: str, reason: str | None = None,
              error: str | None = None) -> None:
        new = tuple(r.generated[r.sent_ids:])
        logprobs = tuple(r.logprobs[r.sent_ids:])
        r.sent_ids = len(r.generated)
        if new or text or reason:
            r.stream.put(Output(new, text, reason, error, len(r.prompt), len(r.generated),
                                logprobs))

    def _finish(self, r: Request, reason: str, *, text: str = "",
                error: str | None = None) -> None:
        r.finished = True
        if r in self._running:
            self._running.remove(r)
            self.manager.free(r.id)
        elif r in self._waiting:
            self._waiting.remove(r)
        self.stats.finished[reason] += 1
        self._emit(r, text, reason, error)
