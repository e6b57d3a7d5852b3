"""What a serving request is made of: its parameters (:class:`RequestParams`), the events
of its stream (:class:`Output`, :class:`RequestStream`), the engine's refusals, and the
engine's counters (:class:`EngineStats`). :mod:`forge_jax.serving.engine` re-exports them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import queue
import time

from forge_jax.generation import sampling as sampling_lib
from forge_jax.serving.prefix_cache import page_keys

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# The phases of one engine step, in order: taking new requests and cancellations, choosing the
# batch (pages included), building its arrays, dispatching the jitted step, booking it on the
# host while the device runs, waiting for the device, and handing out the tokens (text, stop
# checks, streams).
PHASES = ("intake", "schedule", "build", "dispatch", "book", "device", "output")


class RequestRefused(ValueError):
    """A request the engine can never serve (too long for the context or the pool)."""


class QueueFull(RuntimeError):
    """More requests waiting than the engine's ``max_waiting``."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's generation parameters.

    Attributes:
      max_tokens: new tokens at most (>= 1).
      sampling: how each token is drawn, a
        :class:`forge_jax.generation.sampling.SamplingParams` (greedy by default).
      seed: the seed of this request's sampling (None: drawn by the engine).
      stop_token_ids: ids that end the request (besides the model's eos ids), included in
        its token ids but not in its text.
      stop: strings that end the request; the text stops before the first one.
      ignore_eos: do not stop at the model's eos ids.
    """

    max_tokens: int = 16
    sampling: sampling_lib.SamplingParams = sampling_lib.SamplingParams()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.sampling, sampling_lib.SamplingParams):
            raise TypeError(f"sampling must be a forge_jax.generation.SamplingParams, got "
                            f"sampling={self.sampling!r:.80}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """Greedy without a repetition penalty (the step's cheaper compiled mode)."""
        return self.sampling.greedy and self.sampling.repetition_penalty in (None, 1.0)


@dataclasses.dataclass(frozen=True)
class Output:
    """One event of a request's stream.

    Attributes:
      token_ids: the new token ids since the previous event.
      text: their text (held back while a character or a stop string may be incomplete).
      finish_reason: None while the request runs; then one of :data:`FINISH_REASONS`.
      error: the message of an ``error`` finish.
      prompt_tokens, completion_tokens: counts so far.
      logprobs: with the request's ``sampling.logprobs`` set, one
        :class:`~forge_jax.generation.sampling.TokenLogprob` per token of ``token_ids``;
        else empty.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple = ()


class RequestStream:
    """The events of one request, iterable from any thread (``for``, blocking) or, when it
    was submitted with a ``loop`` (by default the running asyncio loop of the caller), from
    a task of that loop (``async for``); :meth:`cancel` ends it with ``cancelled``."""

    def __init__(self, engine, request_id: int, loop: asyncio.AbstractEventLoop | None):
        self.engine, self.id, self.loop = engine, request_id, loop
        self._queue: queue.Queue = queue.Queue()
        self._ready = asyncio.Event() if loop else None  # set by put, on the loop
        self.finish_reason: str | None = None

    def put(self, out: Output) -> None:
        self._queue.put(out)
        if self.loop is not None:
            # A closed loop raises RuntimeError: no one is listening any more.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._ready.set)

    def cancel(self) -> None:
        self.engine.cancel(self.id)

    def __iter__(self):
        while self.finish_reason is None:
            out = self._queue.get()
            self.finish_reason = out.finish_reason
            yield out

    async def __aiter__(self):
        if self._ready is None:
            raise RuntimeError("this stream was submitted outside an asyncio loop: iterate it "
                               "with for, or submit with loop=")
        while self.finish_reason is None:
            try:
                out = self._queue.get_nowait()
            except queue.Empty:
                await self._ready.wait()
                self._ready.clear()
                continue
            self.finish_reason = out.finish_reason
            yield out

    def result(self) -> tuple[list[int], str, str]:
        """Waits for the end (threads only): ``(token_ids, text, finish_reason)``."""
        ids, text = [], []
        for out in self:
            ids += out.token_ids
            text.append(out.text)
        return ids, "".join(text), self.finish_reason


class PhaseClock:
    """Adds the seconds since the previous lap to ``totals[phase]`` (perf_counter)."""

    def __init__(self, totals: dict):
        self.totals, self.last = totals, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now


@dataclasses.dataclass(eq=False)
class Request:
    """The engine's record of one request (its thread only)."""

    id: int
    prompt: list[int]
    params: RequestParams
    stream: RequestStream
    seed: int
    arrival: float
    generated: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens in the cache
    cached_pages: int = 0  # full pages already offered to the prefix cache
    # A token drawn by the step in flight, not read yet (0 or 1), and its index among that
    # step's sampled sequences: the next step may feed it to the device without reading it.
    pending: int = 0
    pending_index: int = 0
    finished: bool = False
    sent_ids: int = 0
    sent_text: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    keys: list[bytes] = dataclasses.field(default_factory=list)  # full pages' prefix keys
    # With sampling.logprobs: a TokenLogprob per generated token.
    logprobs: list = dataclasses.field(default_factory=list)
    # With sampling.constraint: its grammar matcher and the bitmask (int32 [ceil(vocab/32)])
    # of the tokens it allows next, computed on the host when the previous token arrives.
    matcher: object | None = None
    mask: object | None = None
    # Speculative decoding: the draft tokens scheduled after its last token this step.
    drafts: list = dataclasses.field(default_factory=list)
    # With a grammar too: the bitmask after each draft (the matcher rolled back after them).
    draft_masks: list = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    def page_keys(self, page_size: int, count: int) -> list[bytes]:
        """The prefix-cache keys of the first ``count`` full pages of the tokens (hashed
        once each: the tokens only grow)."""
        if count > len(self.keys):
            self.keys = page_keys(self.tokens, page_size, count, self.keys)
        return self.keys[:count]

    def stop_ids(self, eos: frozenset) -> tuple[int, ...]:
        p = self.params
        return p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *eos)

    def new_text(self, tokenizer, eos: frozenset, *, final: bool) -> tuple[str, bool]:
        """The text to send since the last call (None ``tokenizer``: none), and whether a
        stop string ended it."""
        if tokenizer is None:
            return "", False
        ids = self.generated
        if ids and ids[-1] in self.stop_ids(eos):
            ids = ids[:-1]
        full = tokenizer.decode(ids)
        for s in self.params.stop:
            at = full.find(s, max(0, self.sent_text - len(s) + 1))
            if at >= 0:
                full = full[:at]
                piece = full[self.sent_text:]
                self.sent_text = len(full)
                return piece, True
        if not final:
            if full.endswith("\ufffd"):  # an incomplete character: wait for its bytes
                return "", False
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            end = max(self.sent_text, len(full) - hold)
            piece, self.sent_text = full[self.sent_text:end], end
            return piece, False
        piece, self.sent_text = full[self.sent_text:], len(full)
        return piece, False


class Histogram:
    """A Prometheus histogram: counts per upper bound (seconds), their sum and count."""

    BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self):
        self.counts = [0] * len(self.BOUNDS)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.BOUNDS):
            if value <= bound:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, ``+Inf`` last."""
        out = list(zip(map(str, self.BOUNDS), itertools.accumulate(self.counts), strict=True))
        return out + [("+Inf", self.count)]


@dataclasses.dataclass
class EngineStats:
    """Counters and histograms since the engine was made (read by ``/metrics``)."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    finished: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Histogram = dataclasses.field(default_factory=Histogram)  # seconds
    inter_token: Histogram = dataclasses.field(default_factory=Histogram)
    compiled: set = dataclasses.field(default_factory=set)  # StepBatch.shape_key seen
    # Speculative decoding: drafts verified, drafts kept, and the sequences verified.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verified: int = 0
    # Why some requests decoded one token per step (each reason logged once).
    not_speculating: set = dataclasses.field(default_factory=set)
    # Host seconds per phase of the step loop (PHASES), for profiling; "device" is the time
    # spent waiting for a step's tokens after the host's own work on that step was done.
    phase_seconds: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    created: float = dataclasses.field(default_factory=time.time)
    recent: collections.deque = dataclasses.field(default_factory=collections.deque)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Tokens generated per second over the last ``window`` seconds."""
        now = time.monotonic()
        recent = [n for t, n in list(self.recent) if t > now - window]
        return sum(recent) / window
