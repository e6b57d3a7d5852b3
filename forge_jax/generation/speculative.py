"""Speculative decoding for :func:`forge_jax.generation.generate_with_stats`: prompt-lookup
(n-gram) drafts or a smaller draft model's, verified by the model in one step, the accepted
ones kept.

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

With a draft model (``SpeculativeConfig(draft_model=...)``, a smaller model of the same
vocabulary with a KV cache of its own) the drafts are drawn from the draft's distribution
``q`` (the same temperature and filters; its argmax when greedy), ``num_tokens`` of them one
after another (:func:`draft_step`); a draft ``d`` is kept with probability
``min(1, p(d) / q(d))`` and the token at the first rejection is drawn from the residual
``max(p - q, 0)`` renormalised, which again leaves every token distributed as the target's.

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

from forge_jax.generation import compiled_cache
from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation.steps import Static

METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How :func:`~forge_jax.generation.generate_with_stats` drafts and verifies tokens.

    Attributes:
      method: ``"ngram"`` (prompt lookup) or ``"draft"`` (a draft model); None (the
        default): ``"draft"`` when ``draft_model`` is given, else ``"ngram"``.
      num_tokens: draft tokens per step at most (K >= 1); a step then verifies K + 1 rows
        per sequence and yields 1 to K + 1 tokens.
      max_ngram, min_ngram: the suffix lengths looked up, longest first (``"ngram"``).
        ``min_ngram=1`` (the default) proposes after any repeated token. It is kept
        because in ``generate`` every verify step has K + 1 rows per sequence whether it
        drafts or not, so a proposal costs nothing and a shorter match only adds kept
        tokens: on SmolLM2-135M-Instruct (greedy, K=4) the tokens per step with
        ``min_ngram`` 1 / 2 / 3 were 4.20 / 4.20 / 3.71 on a code edit, 1.66 / 1.43 / 1.31
        on a summary quoting its input and 1.29 / 1.15 / 1.09 on free text (the share of
        drafts kept rises with it, 16% / 22% / 38% on free text, the tokens per step do
        not). sglang also starts at 1 (its n-gram cache weighs matches by frequency);
        vLLM's 5 is, its code says, arbitrary. In the serving engine each draft is a row
        of the step: where rows cost (a CPU), a larger ``min_ngram`` drafts less.
      draft_model: with ``"draft"``, the draft model: any model ``from_pretrained`` loads
        whose vocabulary is the target's (:func:`check_draft`), usually a much smaller one
        of the same family.
    """

    method: str | None = None
    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    draft_model: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.draft_model is None else "draft")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(f"method='draft' takes a draft_model and only it does, got "
                             f"method={self.method!r} and draft_model="
                             f"{type(self.draft_model).__name__}")
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


def verify_drafts(logits, drafts, draft_len, key, sampling, greedy: bool, q=None):
    """The kept tokens of each row. ``logits`` float32 ``[b, k + 1, vocab]`` (after the
    last token and each draft), ``drafts`` int32 ``[b, k]``, ``draft_len`` int32 ``[b]``;
    ``q`` float32 ``[b, k, vocab]``, the distribution each draft was drawn from (a draft
    model's), or None for deterministic drafts (prompt lookup: a one-hot ``q``).
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
    if q is None:
        keep = (u < p_draft) & real
    else:  # kept with probability min(1, p(d) / q(d))
        q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [b, k]
        keep = (u * q_draft < p_draft) & real
    kept = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # [b]
    # The distribution of the token after the kept drafts: the residual where a draft was
    # rejected there, the target itself after the last real draft (or none).
    at = jnp.take_along_axis(filtered, kept[:, None, None], axis=1)[:, 0]  # [b, vocab]
    rejected = kept < draft_len
    if q is None:
        draft_at = jnp.take_along_axis(drafts, jnp.minimum(kept, k - 1)[:, None], axis=1)[:, 0]
        residual = at.at[jnp.arange(b), draft_at].set(-jnp.inf)
    else:
        p_at = jnp.take_along_axis(probs, kept[:, None, None], axis=1)[:, 0]  # [b, vocab]
        q_at = jnp.take_along_axis(q, jnp.minimum(kept, k - 1)[:, None, None], axis=1)[:, 0]
        rest = jnp.maximum(p_at - q_at, 0.0)
        # (p == q to the last bit leaves no residual, and no rejection to draw it for)
        residual = jnp.where(jnp.sum(rest, axis=-1, keepdims=True) > 0,
                             jnp.log(rest), at)
    final_logits = jnp.where(rejected[:, None], residual, at)
    final = jax.random.categorical(draw_key, final_logits, axis=-1).astype(jnp.int32)
    out = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [b, k + 1]
    out = out.at[jnp.arange(b), kept].set(final)
    return out, kept + 1


def draw_draft(logits, key, sampling: dict, greedy: bool):
    """A draft model's token per row of ``logits`` ``[b, vocab]`` and the distribution it
    was drawn from (float32 ``[b, vocab]``; with ``greedy``, the argmax and a one-hot)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = sampling_lib.sample(logits, None, temperature=0.0)
        return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)
    filtered = sampling_lib.filter_logits(
        logits - jnp.max(logits, axis=-1, keepdims=True), temperature=sampling["temperature"],
        top_k=sampling["top_k"], top_p=sampling["top_p"], min_p=sampling["min_p"])
    token = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    return token, jax.nn.softmax(filtered, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "num_tokens",
                                             "implementation_key"),
                   donate_argnames=("cache",))
def draft_step(state: nnx.State, cache, pair: jax.Array, start: jax.Array, active: jax.Array,
               key: jax.Array, sampling: dict, end: jax.Array | None = None, *, graphdef,
               greedy: bool, num_tokens: int, implementation_key=None):
    """``num_tokens`` draft tokens per row from a draft model, one after another (jitted;
    the draft's cache is donated).

    Args:
      state: the draft model's weights, ``nnx.split(draft)[1]``.
      cache: the draft's KV cache, holding each row's tokens before ``start`` (what it
        holds from ``start`` on is rewritten).
      pair: int32 ``[batch, 2]``: each row's token before the last and its last token, at
        positions ``start`` and ``start + 1`` (the one before is written again: after a
        step that kept every draft, the draft has not seen the last of them).
      start: int32 ``[batch]``.
      active: bool ``[batch]``; inactive rows are not written.
      key: this step's ``jax.random`` key (unused when greedy).
      sampling: :meth:`SamplingParams.arrays`.
      end: int32 ``[batch]``, the first position a row may not write (its cache's room;
        the drafts drawn there are not verified); None: no bound.
      graphdef, greedy, num_tokens, implementation_key: static.

    Returns:
      ``(drafts, q, cache)``: int32 ``[batch, num_tokens]``, float32 ``[batch, num_tokens,
      vocab]`` (the distribution each was drawn from), and the draft's cache.
    """
    del implementation_key
    model = nnx.merge(Static.unwrap(graphdef), state)
    b = pair.shape[0]
    start = start.astype(jnp.int32)
    cache = cache.with_lengths(jnp.where(active, start, cache.lengths.astype(jnp.int32)))
    end = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32) if end is None else end

    def writes(positions):  # [b, t]
        return active[:, None] & (positions < end[:, None])

    positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    logits, cache = model.forward_cached(pair, positions, writes(positions), cache,
                                         logits_at=jnp.ones((b,), jnp.int32))
    keys = jax.random.split(key, num_tokens)
    token, q = draw_draft(logits, keys[0], sampling, greedy)

    def one(carry, xs):
        cache, token = carry
        i, key = xs
        positions = (start + 2 + i)[:, None]
        logits, cache = model.forward_cached(token[:, None], positions, writes(positions),
                                             cache)
        token, q = draw_draft(logits[:, 0], key, sampling, greedy)
        return (cache, token), (token, q)

    (cache, _), (tokens, qs) = jax.lax.scan(
        one, (cache, token), (jnp.arange(num_tokens - 1, dtype=jnp.int32), keys[1:]))
    drafts = jnp.concatenate([token[:, None], tokens.T], axis=1)  # [b, k]
    q = jnp.concatenate([q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [b, k, vocab]
    return drafts, q, cache


def check_draft(target, draft, tokenizers=None) -> None:
    """ValueError (one line, naming both) unless ``draft`` can draft for ``target``: the
    same vocabulary size and, given ``tokenizers`` (``{"target": vocab, "draft": vocab}``,
    token -> id dicts), the same tokens at the same ids."""
    sizes = target.config.vocab_size, draft.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft model's vocabulary has {sizes[1]} tokens, the target's "
                         f"{sizes[0]}: a draft model must share the target's tokenizer")
    if tokenizers is None:
        return
    mine, theirs = tokenizers["target"], tokenizers["draft"]
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
    if differ:
        shown = ", ".join(f"{token!r}={i}" for token, i in differ[:4])
        raise ValueError(f"the draft model's tokenizer differs from the target's in "
                         f"{len(differ)} (token, id) pairs, e.g. {shown}")


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "implementation_key",
                                             "logprobs"),
                   donate_argnames=("cache",))
def verify_step(state: nnx.State, cache, tokens: jax.Array, draft_len: jax.Array,
                active: jax.Array, key: jax.Array, sampling: dict, q=None, *, graphdef,
                greedy: bool, implementation_key=None, logprobs: int = 0):
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
      q: float32 ``[batch, k, vocab]``, the distributions a draft model drew the drafts
        from (:func:`draft_step`), or None (prompt lookup's deterministic drafts).
      graphdef, greedy, implementation_key, logprobs: static, as
        :func:`~forge_jax.generation.steps.step_statics` gives them.

    Returns:
      ``(out, count, cache)``: int32 ``[batch, k + 1]`` and ``[batch]``, the first
      ``count`` of ``out`` being each row's new tokens (1 to ``k + 1``); the cache holding
      the last token and the kept drafts (its lengths advanced by ``count``). With
      ``logprobs`` > 0, a fourth: :func:`~forge_jax.generation.sampling.token_logprobs`'
      dict of ``out``'s tokens, row ``b * (k + 1) + j`` for ``out[b, j]``, each from the
      model's logits at the row that drew it (the distribution after the tokens before
      it), so that a kept draft's is what one-token decoding would have reported.
    """
    del implementation_key
    model = nnx.merge(Static.unwrap(graphdef), state)
    b, k1 = tokens.shape
    offsets = jnp.arange(k1, dtype=jnp.int32)[None, :]
    old = cache.lengths.astype(jnp.int32)
    positions = old[:, None] + offsets
    valid = active[:, None] & (offsets <= draft_len[:, None])
    logits, cache = model.forward_cached(tokens, positions, valid, cache)
    out, count = verify_drafts(logits.astype(jnp.float32), tokens[:, 1:], draft_len, key,
                               sampling, greedy, q)
    count = jnp.where(active, count, 0)
    cache = cache.with_lengths(old + count)
    if logprobs:
        return out, count, cache, sampling_lib.token_logprobs(
            logits.reshape(b * k1, -1), out.reshape(-1), logprobs)
    return out, count, cache


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


def check(config, sampling: sampling_lib.SamplingParams, callbacks, model=None) -> None:
    """TypeError/ValueError for a ``generate`` call (of ``model``) speculative decoding
    cannot serve."""
    if not isinstance(config, SpeculativeConfig):
        raise TypeError(f"speculative must be a SpeculativeConfig or None, got "
                        f"{config!r:.80}")
    # A model whose cache cannot drop rejected drafts (a recurrent state has absorbed them)
    # says why in ``speculation_refused``.
    reason = getattr(model, "speculation_refused", None)
    if reason:
        raise ValueError(f"speculative decoding: {reason}")
    if config.draft_model is not None and model is not None:
        check_draft(model, config.draft_model)
        if model.mesh is not None or config.draft_model.mesh is not None:
            raise ValueError("speculative decoding with a draft model does not run on a mesh")
    refused = [name for name, given in (
        ("repetition_penalty", sampling.repetition_penalty not in (None, 1.0)),
        ("on_tokens", callbacks.on_tokens is not None)) if given]
    if refused:
        raise ValueError(f"speculative decoding does not take {', '.join(refused)}")


def decode(state, kv, first, prompts: Sequence[Sequence[int]], padded_batch: int, key,
           params: dict, *, limit: int, eos: frozenset[int], config: SpeculativeConfig,
           statics: dict, stats, progress=None, draft=None,
           logprobs: int | None = None) -> list[list[int]]:
    """``generate``'s steps after its prefill's ``first`` tokens (int ``[padded_batch]``;
    with ``statics["logprobs"]``, ``(tokens, their token_logprobs dict)``), until every
    prompt has ``limit`` new tokens or an eos; counts the steps, their time and the drafts
    in ``stats`` (a :class:`~forge_jax.generation.GenerationStats`). ``draft``: with a
    draft model, ``(inputs, make_cache)``: the prefill's inputs and a function giving a
    model its empty cache for the plan. With ``logprobs`` (alternatives per token, as
    :attr:`SamplingParams.logprobs`), ``stats.logprobs`` gets each returned token's
    :class:`~forge_jax.generation.sampling.TokenLogprob`. Returns each prompt's new
    tokens."""
    import time

    batch = len(prompts)
    first_logprobs = None
    if isinstance(first, tuple):
        first, first_logprobs = first
    results = [[int(t)] for t in np.asarray(first)[:batch]]
    entries = None
    if logprobs is not None:
        host = dict(jax.device_get(first_logprobs), tokens=np.asarray(first))
        entries = [[sampling_lib.host_logprobs(host, b, logprobs)] for b in range(batch)]
    done = np.array([r[-1] in eos or len(r) >= limit for r in results])
    active = np.arange(padded_batch) < batch
    k1 = config.num_tokens + 1
    step, drafter = verify_step, None
    if not done.all():  # compiled ahead, so that the decode time is the steps' alone
        begin = time.perf_counter()
        if config.draft_model is not None:
            drafter = _Drafter(config, draft, key, params, statics, padded_batch)
        q = None if drafter is None else drafter.q_shape
        step = verify_step.compiled(
            state, kv, jnp.zeros((padded_batch, k1), jnp.int32),
            jnp.zeros((padded_batch,), jnp.int32), jnp.asarray(active), key, params, q,
            **statics)
        stats.compile_seconds += time.perf_counter() - begin
    steps = 0
    start = time.perf_counter()
    while not done.all():
        histories = [list(p) + r for p, r in zip(prompts, results, strict=True)]
        live = active.copy()
        live[:batch] &= ~done
        step_key = jax.random.fold_in(key, steps + 1)
        # Drafts past a row's limit are never kept: its cache has no room for them.
        room = np.zeros((padded_batch,), np.int32)
        room[:batch] = [limit - len(r) - 1 for r in results]
        if drafter is None:
            tokens, draft_len = draft_arrays(histories, done, padded_batch, config)
            q = None
        else:
            tokens, draft_len, q = drafter.propose(histories, live, step_key, limit)
        draft_len = np.minimum(draft_len, np.maximum(room, 0)).astype(np.int32)
        out, count, kv, *lp = step(state, kv, jnp.asarray(tokens), jnp.asarray(draft_len),
                                   jnp.asarray(live), step_key, params, q)
        out, count = np.asarray(out), np.asarray(count)
        if entries is not None:
            host = dict(jax.device_get(lp[0]), tokens=out.reshape(-1))
        steps += 1
        stats.draft_tokens += int(np.asarray(draft_len)[:batch][~done].sum())
        for b in np.flatnonzero(~done):
            new = [int(t) for t in out[b, :count[b]]]
            stats.accepted_tokens += len(new) - 1
            for j, t in enumerate(new):
                results[b].append(t)
                if entries is not None:
                    entries[b].append(sampling_lib.host_logprobs(host, b * k1 + j, logprobs))
                if t in eos or len(results[b]) >= limit:
                    done[b] = True
                    break
        if progress is not None:
            progress(min(limit, max(len(r) for r in results)), limit)
    stats.decode_steps, stats.decode_seconds = steps, time.perf_counter() - start
    if entries is not None:
        stats.logprobs = entries
    return results


class _Drafter:
    """A draft model's cache (prefilled with the prompts) and its compiled
    :func:`draft_step`, for :func:`decode`."""

    def __init__(self, config: SpeculativeConfig, draft, key, params: dict, statics: dict,
                 padded_batch: int):
        from forge_jax.generation.steps import prefill_step, step_statics

        inputs, make_cache = draft
        model = config.draft_model
        graphdef, self.state = nnx.split(model)
        prefill_statics = step_statics(graphdef, statics["greedy"])
        _, _, self.cache = prefill_step(self.state, make_cache(model), inputs.tokens,
                                        inputs.lengths, key, params, inputs.seen,
                                        **prefill_statics, empty_cache=True)
        self.key, self.params, self.k = key, params, config.num_tokens
        b = padded_batch
        self.prompt_lengths = np.asarray(inputs.lengths)
        self.step = draft_step.compiled(
            self.state, self.cache, jnp.zeros((b, 2), jnp.int32), jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), bool), key, params, jnp.zeros((b,), jnp.int32), **prefill_statics,
            num_tokens=self.k)
        self.q_shape = jax.ShapeDtypeStruct((b, self.k, model.config.vocab_size), jnp.float32)

    def propose(self, histories, live: np.ndarray, key, limit: int):
        """``(tokens [b, k + 1], draft_len [b], q [b, k, vocab])`` of a :func:`verify_step`:
        every live row drafts ``k`` tokens (writing its cache up to its prompt and
        ``limit`` new tokens, the room it has)."""
        b = live.shape[0]
        pair = np.zeros((b, 2), np.int32)
        start = np.zeros((b,), np.int32)
        for i, history in enumerate(histories):
            pair[i], start[i] = history[-2:], len(history) - 2
        drafts, q, self.cache = self.step(self.state, self.cache, jnp.asarray(pair),
                                          jnp.asarray(start), jnp.asarray(live),
                                          jax.random.fold_in(key, 1), self.params,
                                          jnp.asarray(self.prompt_lengths + limit))
        tokens = jnp.concatenate([jnp.asarray(pair[:, 1:]), drafts], axis=1)
        return tokens, np.where(live, self.k, 0).astype(np.int32), q


# Kept on disk (and in this process) inside ``compiled_cache.use_step_cache``, as the
# generation steps are: a later call of the same shapes does not compile them again.
verify_step = compiled_cache.CachedStep(verify_step, "verify",
                                        ("graphdef", "greedy", "implementation_key",
                                         "logprobs"))
draft_step = compiled_cache.CachedStep(draft_step, "draft",
                                       ("graphdef", "greedy", "num_tokens", "implementation_key"))
