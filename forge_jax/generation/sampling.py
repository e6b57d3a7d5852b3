"""Token sampling on device: greedy, temperature, top-k, top-p (nucleus), min-p, the
repetition penalty, and the log-probabilities of what was sampled.

The processors follow Hugging Face transformers' logits processors and their order in
``generate``: the repetition penalty (greedy decoding included), then divide by the
temperature, keep the top-k logits (ties with the k-th value kept), keep the smallest set
of most probable tokens whose probability reaches ``top_p`` (a token is dropped when the
cumulative probability of the tokens less probable than or as probable as it, in
ascending order, is at most ``1 - top_p``; the most probable token is always kept), and
keep the tokens whose probability is at least ``min_p`` times the largest.

Every parameter's value may be a traced scalar, so one compiled step serves them all; only
greedy versus sampling changes the compiled code (:attr:`SamplingParams.greedy`).

OpenAI's ``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` and a grammar
``constraint`` are per-request settings of the serving engine
(:mod:`forge_jax.serving.batch_step` applies them on the device, in that order, after the
repetition penalty). Log-probabilities (:func:`token_logprobs`) are taken from the logits
after the penalties and the logit bias, before the grammar mask, the temperature and the
filters: the model's distribution as the penalties left it, as vLLM documents its
``logprobs`` (at temperature 0 they are the model's log-softmax).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# Temperatures below float32's smallest normal number are greedy: float32 cannot divide
# logits by them faithfully (a denormal may be flushed to zero, 1e-50 rounds to zero, and
# the quotients overflow to inf, which samples the first index instead of the largest),
# and the distribution they ask for is the argmax anyway.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# top-k and top-p look at the CANDIDATES most likely tokens first (``lax.top_k``, ~0.1 ms
# over a 49k vocabulary on CPU) and sort the whole vocabulary (~10 ms there) only when the
# tokens they keep are not all among them.
CANDIDATES = 256

# The most alternatives per token that ``logprobs`` may ask for (OpenAI's ``top_logprobs``
# limit); the compiled steps take the top MAX_LOGPROBS always and the host cuts them.
MAX_LOGPROBS = 20


def _is_number(x) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Attributes:
      temperature: 0 for greedy (argmax); otherwise the logits are divided by it.
        Below :data:`GREEDY_BELOW` (~1.18e-38, float32's smallest normal) it is greedy
        too; above float32's largest finite value it is refused.
      top_k: keep only the k largest logits (None: all).
      top_p: nucleus threshold in (0, 1] (None or 1.0: no filtering).
      min_p: keep the tokens whose probability is at least ``min_p`` times the most
        probable one's, in [0, 1] (None or 0: no filtering).
      repetition_penalty: transformers' ``repetition_penalty``, > 0: the logit ``x`` of a
        token already in the sequence (prompt included) becomes ``x / penalty`` if
        positive, ``x * penalty`` otherwise (None or 1.0: off). Applies to greedy decoding
        too.
      seed: the seed of the ``jax.random`` key the tokens are sampled with (unused when
        greedy), an int in ``[-2**63, 2**63)``.
      presence_penalty: OpenAI's, in [-2, 2]: subtracted from the logit of every token
        already generated (the prompt excluded) (None or 0: off). Serving engine only.
      frequency_penalty: OpenAI's, in [-2, 2]: subtracted from a token's logit once per
        time it was generated (None or 0: off). Serving engine only.
      logit_bias: OpenAI's: ``{token id: bias in [-100, 100]}`` added to the logits (a
        mapping, kept as sorted ``(id, bias)`` pairs; None: none). Serving engine only.
      logprobs: None (off), or how many most likely alternatives to report with each
        token's log-probability, 0 to :data:`MAX_LOGPROBS` (0: the sampled token's
        alone). See :func:`token_logprobs` for which distribution they come from.
      constraint: a :class:`forge_jax.generation.constraints.Constraint` (JSON schema,
        regex, choice, grammar) the tokens must follow; None: free text. Serving engine
        only.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    logprobs: int | None = None
    constraint: object | None = None

    def __post_init__(self):
        if not _is_number(self.temperature) or not 0 <= self.temperature <= _FLOAT32_MAX:
            raise ValueError(f"temperature must be a number >= 0 that float32 holds (finite, "
                             f"<= {_FLOAT32_MAX:.4g}), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int | np.integer) or isinstance(
                self.top_k, bool) or not 0 < self.top_k < 2**31):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.min_p is not None and (not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        penalty = self.repetition_penalty
        if penalty is not None and (not _is_number(penalty) or not 0.0 < penalty <= _FLOAT32_MAX):
            raise ValueError(f"repetition_penalty must be a finite number > 0 or None, got "
                             f"{penalty!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int | np.integer) \
                or not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [-2**63, 2**63), got seed={self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2] or None, got {value!r}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(
                self.logprobs, int | np.integer) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got "
                             f"logprobs={self.logprobs!r}")
        if self.constraint is not None and not callable(getattr(self.constraint, "matcher",
                                                                None)):
            raise TypeError(f"constraint must be a forge_jax.generation.constraints."
                            f"Constraint or None, got {self.constraint!r:.80}")

    @property
    def needs_token_counts(self) -> bool:
        """Whether the presence or frequency penalty is on (the step then counts each
        sequence's generated tokens)."""
        return bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (argmax): the only setting that changes the compiled
        steps (their static ``greedy``). Every other one is an argument (:meth:`arrays`)."""
        return self.temperature < GREEDY_BELOW

    @property
    def mode(self) -> bool:
        """Deprecated name of :attr:`greedy` (removed in the next release)."""
        warnings.warn("SamplingParams.mode is deprecated: use SamplingParams.greedy",
                      DeprecationWarning, stacklevel=2)
        return self.greedy

    def arrays(self) -> dict[str, jax.Array]:
        """The parameters as scalars for a jitted step, the filters that are off at their
        neutral values (top_k 0 meaning all tokens)."""
        return dict(
            temperature=jnp.asarray(self.temperature, jnp.float32),
            top_k=jnp.asarray(0 if self.top_k is None else self.top_k, jnp.int32),
            top_p=jnp.asarray(1.0 if self.top_p is None else self.top_p, jnp.float32),
            min_p=jnp.asarray(0.0 if self.min_p is None else self.min_p, jnp.float32),
            repetition_penalty=jnp.asarray(
                1.0 if self.repetition_penalty is None else self.repetition_penalty, jnp.float32))


def _check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A ``logit_bias`` mapping (JSON's string keys included) as sorted ``(id, bias)``
    pairs; ValueError naming the bad entry."""
    items = bias.items() if hasattr(bias, "items") else bias
    out = {}
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.80}") from None
    for entry in items:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.80}")
        key, value = entry
        try:
            token = int(key) if not isinstance(key, bool | float) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias[{key!r}] must be a number in [-100, 100], got "
                             f"{value!r}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_LOGPROBS) -> dict:
    """The log-probabilities of the sampled ``tokens`` and of the ``k`` most likely ones.

    They are taken from ``logits`` as given: the callers pass the logits after the
    repetition, presence and frequency penalties and the logit bias, before the grammar
    mask, the temperature and the top-k/top-p/min-p filters (vLLM's documented point), so
    that at temperature 0 they are the model's ``log_softmax``.

    Args:
      logits: float ``[rows, vocab]``.
      tokens: int32 ``[rows]``, the sampled tokens.
      k: static, the alternatives per row (``lax.top_k``: ordered, most likely first).

    Returns:
      ``{"token": float32 [rows], "top_ids": int32 [rows, k], "top": float32 [rows, k]}``.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [rows, vocab]
    top, top_ids = jax.lax.top_k(logp, min(k, logp.shape[-1]))
    token = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return {"token": token, "top_ids": top_ids.astype(jnp.int32), "top": top}


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty) -> jax.Array:
    """transformers' ``RepetitionPenaltyLogitsProcessor``: the logits ``[batch, vocab]`` of
    the tokens marked in ``seen`` (bool ``[batch, vocab]``) divided by ``penalty`` where
    positive, multiplied by it elsewhere. Returns float32."""
    logits = logits.astype(jnp.float32)
    penalty = jnp.asarray(penalty, jnp.float32)
    penalised = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, penalised, logits)


def _kept_threshold(desc, total_lse, k, top_p, vocab):
    """The smallest logit that top-k and top-p keep, from the ``n`` largest logits sorted
    descending ``desc`` ``[batch, n]`` and the log-sum-exp of all of them ``[batch, 1]``;
    ``k`` int32 ``[batch]`` in ``[1, vocab]``, ``vocab`` meaning no top-k. Also returns,
    per row, whether that is exact: False when a token past the ``n`` largest may be kept."""
    n = desc.shape[-1]
    within = k <= n  # top-k's k-th value is among the candidates
    kth = jnp.take_along_axis(desc, (jnp.minimum(k, n) - 1)[:, None], axis=-1)  # [batch, 1]
    kth = jnp.where(within[:, None], kth, -jnp.inf)
    desc = jnp.where(desc < kth, -jnp.inf, desc)
    # top-p sees the probabilities renormalised over what top-k kept.
    lse = jnp.where(within[:, None], jax.nn.logsumexp(desc, axis=-1, keepdims=True), total_lse)
    probs = jnp.exp(desc - lse)
    above = jnp.cumsum(probs, axis=-1) - probs  # [batch, n]: mass of the more probable tokens
    keep = (above < top_p) | (top_p >= 1.0)
    keep = keep.at[:, 0].set(True)  # the most probable token always stays
    last = jnp.sum(keep, axis=-1, keepdims=True) - 1  # keep is a prefix of the ranks
    threshold = jnp.maximum(jnp.take_along_axis(desc, last, axis=-1), kth)
    # Past the candidates nothing is kept if top-k stops within them, or if top-p stops
    # within them and no top-k changes the normalisation (k == vocab: off).
    exact = within | ((k >= vocab) & (jnp.sum(probs, axis=-1) >= top_p))
    return threshold, exact


def filter_logits(logits: jax.Array, *, temperature=1.0, top_k=None, top_p=None,
                  min_p=None) -> jax.Array:
    """Temperature, top-k, top-p and min-p applied to logits ``[batch, vocab]``.

    Args:
      logits: float ``[batch, vocab]``.
      temperature: a positive float or a traced float32 scalar.
      top_k: None, a positive int or a traced int32 scalar (0 or >= vocab: all tokens).
      top_p: None, a float in (0, 1] or a traced float32 scalar (1: no filtering).
      min_p: None, a float in [0, 1] or a traced float32 scalar (0: no filtering).

    Returns:
      float32 ``[batch, vocab]`` with the filtered-out entries at ``-inf``.
    """
    logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    batch, vocab = logits.shape
    if top_k is not None or top_p is not None:
        k = jnp.asarray(0 if top_k is None else top_k, jnp.int32)
        k = jnp.broadcast_to(jnp.where((k <= 0) | (k > vocab), vocab, k), (batch,))
        p = jnp.asarray(1.0 if top_p is None else top_p, jnp.float32)
        total_lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        n = min(CANDIDATES, vocab)
        threshold, exact = _kept_threshold(jax.lax.top_k(logits, n)[0], total_lse, k, p,
                                           vocab)
        if n < vocab:
            threshold = jax.lax.cond(
                jnp.all(exact | ((k >= vocab) & (p >= 1.0))), lambda: threshold,
                lambda: _kept_threshold(-jnp.sort(-logits, axis=-1), total_lse, k, p, vocab)[0])
        no_filter = ((k >= vocab) & (p >= 1.0))[:, None]
        logits = jnp.where(~no_filter & (logits < threshold), -jnp.inf, logits)
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); min_p = 0 keeps everything.
        top = jnp.max(logits, axis=-1, keepdims=True)
        logits = jnp.where(logits < top + jnp.log(jnp.asarray(min_p, jnp.float32)), -jnp.inf,
                           logits)
    return logits


def sample(logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k=None, top_p=None,
           min_p=None, repetition_penalty=None, seen: jax.Array | None = None) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: float ``[batch, vocab]``.
      key: a ``jax.random`` key (unused when greedy).
      temperature: a Python number below :data:`GREEDY_BELOW` (``0`` included) selects
        greedy decoding (argmax, the first index on ties as ``torch.argmax``); otherwise a
        positive float or traced scalar.
      top_k, top_p, min_p: as in :func:`filter_logits`.
      repetition_penalty: None, or a float or traced float32 scalar > 0, applied to the
        tokens marked in ``seen`` (bool ``[batch, vocab]``), as
        :func:`apply_repetition_penalty`.

    Returns:
      int32 ``[batch]``.
    """
    if repetition_penalty is not None:
        if seen is None:
            raise ValueError("repetition_penalty needs seen, the tokens of each sequence so far")
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if isinstance(temperature, int | float) and temperature < GREEDY_BELOW:
        return _argmax(logits)
    # Shifted so the largest logit is 0 (the distribution is unchanged): divided by a tiny
    # temperature, the others then go to -inf instead of all overflowing to +inf.
    logits = logits.astype(jnp.float32)
    logits = logits - jnp.max(logits, axis=-1, keepdims=True)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def _argmax(logits: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, axis=-1)`` as int32: the first maximum, or the first NaN.

    Two plain reductions (max, then the smallest index that reaches it) instead of
    argmax's (value, index) pair reduction, which took ~170 us over a 32000-entry
    vocabulary on CPU against ~30 us, i.e. over 1% of a 125M model's decode step.
    """
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN if any entry is NaN
    hit = (logits == top) | jnp.isnan(logits)
    index = jnp.arange(vocab, dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, jnp.int32(vocab)), axis=-1)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability (:func:`token_logprobs`' distribution).

    Attributes:
      token: the token id.
      logprob: its log-probability (None for the first token of a scored sequence,
        :func:`forge_jax.generation.scoring.sequence_logprobs`: nothing comes before it).
      top: the most likely tokens as ``(id, logprob)`` pairs, most likely first (as many
        as :attr:`SamplingParams.logprobs` asked for).
    """

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def host_logprobs(arrays: dict, row: int, k: int) -> TokenLogprob:
    """Row ``row`` of :func:`token_logprobs`' output (NumPy arrays, on the host) as a
    :class:`TokenLogprob` with ``k`` alternatives; ``arrays`` also holds the sampled
    ``tokens`` ``[rows]``."""
    top = tuple((int(i), float(v)) for i, v in zip(arrays["top_ids"][row][:k],
                                                    arrays["top"][row][:k], strict=True))
    return TokenLogprob(int(arrays["tokens"][row]), float(arrays["token"][row]), top)
