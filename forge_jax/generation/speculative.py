"""Speculative decoding for :func:`forge_jax.generation.generate_with_stats`: prompt-lookup
(n-gram) drafts, verified by the model in one step, the accepted ones kept.

Each step the host proposes up to ``num_tokens`` draft tokens per sequence: the tokens that
followed the latest earlier occurrence of the sequence's last ``n`` tokens (``n`` from
``max_ngram`` down to ``min_ngram``; prompt and generated text alike), as vLLM's and
tpu-inference's "ngram" method. :func:`verify_step` runs the last token and the drafts
through the model at once (they continue the KV cache), then keeps the drafts the model
agrees with:

* greedy: a draft is kept while it equals the argmax after the tokens before it, and the
  argmax after the last kept one is the bonus token: the output is the greedy output of
  one-token decoding, token for token.
* sampling: rejection sampling (Leviathan et al., 2023) with a deterministic draft: draft
  ``d`` at a position whose target distribution is ``p`` (after temperature, top-k, top-p,
  min-p) is kept with probability ``p(d)``; at the first rejection the token is drawn from
  ``p`` with ``d`` removed and renormalised (the residual ``max(p - q, 0)`` for the draft's
  one-hot ``q``); after all are kept a bonus token is drawn from the last ``p``. Each token
  is then distributed as the target model's.

The cache is written for every row; a sequence's length is then set to its kept tokens, so
the rejected drafts' keys and values are never read (the next step overwrites them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation.steps import Static

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How :func:`~forge_jax.generation.generate_with_stats` drafts and verifies tokens.

    Attributes:
      method: ``"ngram"`` (prompt lookup).
      num_tokens: draft tokens per step at most (K >= 1); a step then verifies K + 1 rows
        per sequence and yields 1 to K + 1 tokens.
      max_ngram, min_ngram: the suffix lengths looked up, longest first.
    """

    method: str = "ngram"
    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got method={self.method!r}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram must be <= max_ngram, got {self.min_ngram} > "
                             f"{self.max_ngram}")


def propose_ngram(tokens: Sequence[int], config: SpeculativeConfig) -> list[int]:
    """Up to ``config.num_tokens`` drafts: what followed the latest earlier occurrence of
    the last ``n`` tokens, for the longest ``n`` in ``[min_ngram, max_ngram]`` that has one
    (none: ``[]``)."""
    tokens = list(tokens)
    k = config.num_tokens
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def verify_drafts(logits, drafts, draft_len, key, sampling, greedy: bool):
    """The kept tokens of each row. ``logits`` float32 ``[b, k + 1, vocab]`` (after the
    last token and each draft), ``drafts`` int32 ``[b, k]``, ``draft_len`` int32 ``[b]``.
    Returns ``(tokens [b, k + 1], count [b])``: the first ``count`` tokens are the output
    (``count - 1`` kept drafts and one more)."""
    b, k1, vocab = logits.shape
    k = k1 - 1
    index = jnp.arange(k, dtype=jnp.int32)[None, :]
    real = index < draft_len[:, None]  # [b, k]
    if greedy:
        target = sampling_lib.sample(logits.reshape(b * k1, vocab), None,
                                     temperature=0.0).reshape(b, k1)
        keep = (drafts == target[:, :k]) & real
        kept = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # [b]
        return target, kept + 1
    flat = logits.reshape(b * k1, vocab)
    flat = flat - jnp.max(flat, axis=-1, keepdims=True)
    filtered = sampling_lib.filter_logits(
        flat, temperature=sampling["temperature"], top_k=sampling["top_k"],
        top_p=sampling["top_p"], min_p=sampling["min_p"]).reshape(b, k1, vocab)
    probs = jax.nn.softmax(filtered, axis=-1)  # [b, k + 1, vocab]
    accept_key, draw_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [b, k]
    u = jax.random.uniform(accept_key, (b, k))
    keep = (u < p_draft) & real
    kept = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # [b]
    # The distribution of the token after the kept drafts: the residual where a draft was
    # rejected there, the target itself after the last real draft (or none).
    at = jnp.take_along_axis(filtered, kept[:, None, None], axis=1)[:, 0]  # [b, vocab]
    rejected = kept < draft_len
    draft_at = jnp.take_along_axis(drafts, jnp.minimum(kept, k - 1)[:, None], axis=1)[:, 0]
    residual = at.at[jnp.arange(b), draft_at].set(-jnp.inf)
    final_logits = jnp.where(rejected[:, None], residual, at)
    final = jax.random.categorical(draw_key, final_logits, axis=-1).astype(jnp.int32)
    out = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [b, k + 1]
    out = out.at[jnp.arange(b), kept].set(final)
    return out, kept + 1


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "implementation_key"),
                   donate_argnames=("cache",))
def verify_step(state: nnx.State, cache, tokens: jax.Array, draft_len: jax.Array,
                active: jax.Array, key: jax.Array, sampling: dict, *, graphdef, greedy: bool,
                implementation_key=None):
    """Runs each row's last token and its drafts through the model and keeps the drafts it
    agrees with (jitted; the cache is donated).

    Args:
      state: the model's weights, ``nnx.split(model)[1]``.
      cache: the KV cache; row ``b``'s tokens continue it at ``cache.lengths[b]``.
      tokens: int32 ``[batch, k + 1]``: the last token (not in the cache yet), then ``k``
        drafts (padding past ``draft_len``).
      draft_len: int32 ``[batch]``, the real drafts of each row (0 to ``k``).
      active: bool ``[batch]``; inactive rows are not written and keep their length.
      key: this step's ``jax.random`` key (unused when greedy).
      sampling: :meth:`SamplingParams.arrays` (the repetition penalty is not applied).
      graphdef, greedy, implementation_key: static, as :func:`~forge_jax.generation.steps.
        step_statics` gives them.

    Returns:
      ``(out, count, cache)``: int32 ``[batch, k + 1]`` and ``[batch]``, the first
      ``count`` of ``out`` being each row's new tokens (1 to ``k + 1``); the cache holding
      the last token and the kept drafts (its lengths advanced by ``count``).
    """
    del implementation_key
    model = nnx.merge(Static.unwrap(graphdef), state)
    b, k1 = tokens.shape
    offsets = jnp.arange(k1, dtype=jnp.int32)[None, :]
    old = cache.lengths.astype(jnp.int32)
    positions = old[:, None] + offsets
    valid = active[:, None] & (offsets <= draft_len[:, None])
    logits, cache = model.forward_cached(tokens, positions, valid, cache)
    out, count = verify_drafts(logits.astype(jnp.float32), tokens[:, 1:], draft_len, key, sampling,
                         greedy)
    count = jnp.where(active, count, 0)
    return out, count, cache.with_lengths(old + count)


def draft_arrays(histories: Sequence[Sequence[int]], done: np.ndarray, batch: int,
                 config: SpeculativeConfig) -> tuple[np.ndarray, np.ndarray]:
    """The ``tokens`` and ``draft_len`` of a :func:`verify_step` for each row's tokens so
    far (``histories``: prompt and new tokens, the last not in the cache yet); rows past
    the histories and finished ones draft nothing."""
    k = config.num_tokens
    tokens = np.zeros((batch, k + 1), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i, history in enumerate(histories):
        tokens[i, 0] = history[-1]
        if done[i]:
            continue
        drafts = propose_ngram(history, config)
        tokens[i, 1:1 + len(drafts)] = drafts
        lengths[i] = len(drafts)
    return tokens, lengths


def check(config, sampling: sampling_lib.SamplingParams, callbacks) -> None:
    """TypeError/ValueError for a ``generate`` call speculative decoding cannot serve."""
    if not isinstance(config, SpeculativeConfig):
        raise TypeError(f"speculative must be a SpeculativeConfig or None, got "
                        f"{config!r:.80}")
    refused = [name for name, given in (
        ("repetition_penalty", sampling.repetition_penalty not in (None, 1.0)),
        ("logprobs", sampling.logprobs is not None),
        ("on_tokens", callbacks.on_tokens is not None)) if given]
    if refused:
        raise ValueError(f"speculative decoding does not take {', '.join(refused)}")


def decode(state, kv, first, prompts: Sequence[Sequence[int]], padded_batch: int, key,
           params: dict, *, limit: int, eos: frozenset[int], config: SpeculativeConfig,
           statics: dict, stats, progress=None) -> list[list[int]]:
    """``generate``'s steps after its prefill's ``first`` tokens (int ``[padded_batch]``),
    until every prompt has ``limit`` new tokens or an eos; counts the steps, their time
    and the drafts in ``stats`` (a :class:`~forge_jax.generation.GenerationStats`).
    Returns each prompt's new tokens."""
    import time

    batch = len(prompts)
    results = [[int(t)] for t in np.asarray(first)[:batch]]
    done = np.array([r[-1] in eos or len(r) >= limit for r in results])
    active = np.arange(padded_batch) < batch
    statics = {k: v for k, v in statics.items() if k != "logprobs"}
    step = verify_step
    if not done.all():  # compiled ahead, so that the decode time is the steps' alone
        begin = time.perf_counter()
        k1 = config.num_tokens + 1
        step = verify_step.lower(
            state, kv, jnp.zeros((padded_batch, k1), jnp.int32),
            jnp.zeros((padded_batch,), jnp.int32), jnp.asarray(active), key, params,
            **statics).compile()
        stats.compile_seconds += time.perf_counter() - begin
    steps = 0
    start = time.perf_counter()
    while not done.all():
        histories = [list(p) + r for p, r in zip(prompts, results, strict=True)]
        tokens, draft_len = draft_arrays(histories, done, padded_batch, config)
        live = active.copy()
        live[:batch] &= ~done
        out, count, kv = step(state, kv, jnp.asarray(tokens), jnp.asarray(draft_len),
                              jnp.asarray(live), jax.random.fold_in(key, steps + 1), params)
        out, count = np.asarray(out), np.asarray(count)
        steps += 1
        stats.draft_tokens += int(draft_len[:batch][~done].sum())
        for b in np.flatnonzero(~done):
            new = [int(t) for t in out[b, :count[b]]]
            stats.accepted_tokens += len(new) - 1
            for t in new:
                results[b].append(t)
                if t in eos or len(results[b]) >= limit:
                    done[b] = True
                    break
        if progress is not None:
            progress(min(limit, max(len(r) for r in results)), limit)
    stats.decode_steps, stats.decode_seconds = steps, time.perf_counter() - start
    return results
