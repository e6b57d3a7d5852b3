"""The jitted prefill and decode steps of a model with a KV cache: explicit cache in, cache
out, donated under ``jax.jit`` (updated in place), and the sampling of each step's token.

:func:`forge_jax.generation.loop.generate` runs them over a batch of prompts and
:class:`forge_jax.text.chat_session.ChatSession` over a conversation; a server can run
them as they do::

    graphdef, state = nnx.split(model)
    statics = steps.step_statics(graphdef, greedy=sampling.greedy)
    params = sampling.arrays()
    tokens, seen, cache = steps.prefill_step(state, cache, prompt, lengths, key, params,
                                             seen, **statics)
    for i in range(1, n):
        tokens, seen, cache = steps.decode_step(state, cache, tokens, active, key,
                                                jnp.int32(i), params, seen, **statics)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax.generation import compiled_cache
from forge_jax.generation import sampling as sampling_lib
from forge_jax.models.protocol import CausalLM


def _sample(logits, key, sampling, seen, greedy, logprobs=0):
    """One token per row of ``logits`` [batch, vocab] with the traced parameters
    ``sampling`` (:meth:`SamplingParams.arrays`); ``seen`` bool [batch, vocab] marks each
    sequence's tokens so far (for the repetition penalty). Returns (tokens, seen with them),
    and with ``logprobs`` (static) > 0 their :func:`~forge_jax.generation.sampling.token_logprobs`
    (``logprobs`` alternatives) after them."""
    logits = sampling_lib.apply_repetition_penalty(logits, seen, sampling["repetition_penalty"])
    tokens = sampling_lib.sample(
        logits, key, temperature=0.0 if greedy else sampling["temperature"],
        top_k=sampling["top_k"], top_p=sampling["top_p"], min_p=sampling["min_p"])
    seen = seen.at[jnp.arange(seen.shape[0]), tokens].set(True)
    if logprobs:
        return tokens, seen, sampling_lib.token_logprobs(logits, tokens, logprobs)
    return tokens, seen


def seen_tokens(prompts: Sequence[Sequence[int]], batch: int, vocab_size: int) -> np.ndarray:
    """bool ``[batch, vocab_size]``: row ``b`` marks the tokens of ``prompts[b]`` (the
    repetition penalty's memory; rows past the prompts stay False)."""
    seen = np.zeros((batch, vocab_size), bool)
    for b, p in enumerate(prompts):
        seen[b, np.asarray(p, np.int64)] = True
    return seen


class Static:
    """A static argument of a jitted function, hashed once: ``nnx.GraphDef``'s hash walks the
    whole graph (about 2 ms for a 30-layer model), and jit hashes its static arguments at
    every call. Equal when the values are."""

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Static) and (self.value is other.value
                                              or self.value == other.value)

    @staticmethod
    def unwrap(x):
        """``x``'s value if it is a :class:`Static`, else ``x``."""
        return x.value if isinstance(x, Static) else x


def step_statics(graphdef: nnx.GraphDef | Static, greedy: bool, logprobs: int = 0) -> dict:
    """The static keyword arguments of :func:`prefill_step` and :func:`decode_step`:
    ``graphdef`` (``nnx.split(model)[0]``, in a :class:`Static`), ``greedy``
    (:attr:`SamplingParams.greedy`: argmax instead of sampling) and
    ``implementation_key``, the active implementation preference
    (``fj.use_implementation``, the environment).

    Ops pick their implementation when traced and jit's cache does not see the
    preference, so the steps take it as a static argument: one compiled step per
    preference. (Left out, it is None: the step compiled first serves every preference.)

    ``logprobs`` > 0 (a compiled variant of its own): the steps also return the sampled
    tokens' log-probabilities and the ``logprobs`` most likely alternatives
    (:func:`~forge_jax.generation.sampling.token_logprobs`); left 0, the statics do not name
    it and the steps return what they always did.
    """
    if not isinstance(graphdef, Static):
        graphdef = Static(graphdef)  # hashed once, not at every step's dispatch
    statics = dict(graphdef=graphdef, greedy=greedy,
                   implementation_key=fj.dispatch.current_preference())
    if logprobs:
        statics["logprobs"] = int(logprobs)
    return statics


_STATIC = ("graphdef", "greedy", "implementation_key", "logprobs")


@functools.partial(jax.jit, static_argnames=(*_STATIC, "empty_cache"),
                   donate_argnames=("cache",))
def prefill_step(state: nnx.State, cache, tokens: jax.Array, lengths: jax.Array,
                 key: jax.Array, sampling: dict[str, jax.Array], seen: jax.Array, *,
                 graphdef: nnx.GraphDef | Static, greedy: bool, implementation_key=None,
                 empty_cache: bool = False, logprobs: int = 0):
    """Prefills new tokens into a KV cache and samples the first token after them (jitted;
    ``cache`` is donated: use the returned one).

    ``graphdef`` is a :class:`~forge_jax.models.protocol.CausalLM`'s (any model the
    runtime takes). Row ``b``'s new tokens continue its cache: they take positions
    ``cache.lengths[b]`` onwards (0 for a new cache; the conversation so far in a chat).

    Args:
      state: the model's weights, ``nnx.split(model)[1]``.
      cache: a ``ContiguousKVCache`` or ``PagedKVCache`` with ``batch`` rows.
      tokens: int32 ``[batch, t]``, the new tokens right-padded (``t`` bucketed, see
        :func:`forge_jax.generation.loop.prompt_bucket`, so that one compiled step
        serves nearby lengths).
      lengths: int32 ``[batch]``, the new tokens of each row; padding past them is not
        written (a row of 0 writes nothing).
      key: the ``jax.random`` key; the prefill samples with ``fold_in(key, 0)``.
      sampling: :meth:`SamplingParams.arrays`, scalars.
      seen: bool ``[batch, vocab]``, each row's tokens so far (:func:`seen_tokens`), for
        the repetition penalty.
      graphdef, greedy, implementation_key: static (:func:`step_statics`).
      empty_cache: static; True when ``cache`` holds no token yet (``cache.lengths``
        all 0: :func:`~forge_jax.generation.loop.generate`'s prefill). The tokens then
        attend to themselves alone rather than to the cache's whole capacity (see
        :meth:`~forge_jax.models.protocol.CausalLM.forward_cached`): the same result, a
        fraction of the work when the cache is much longer than the prompt. Left False,
        any cache works.

      logprobs: static (:func:`step_statics`); > 0 adds the tokens' log-probabilities.

    Returns:
      ``(tokens, seen, cache)``: the first new token of each row, int32 ``[batch]``;
      ``seen`` with it marked; the cache holding the new tokens. With ``logprobs`` > 0, a
      fourth: :func:`~forge_jax.generation.sampling.token_logprobs`' dict.
    """
    model = nnx.merge(Static.unwrap(graphdef), state)
    batch, t = tokens.shape
    offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    valid = offsets < lengths[:, None]
    positions = cache.lengths.astype(jnp.int32)[:, None] + offsets
    logits, cache = model.forward_cached(tokens, positions, valid, cache,
                                         logits_at=jnp.maximum(lengths - 1, 0),
                                         empty_cache=empty_cache)
    return _placed(model, *_sample(logits, jax.random.fold_in(key, 0), sampling, seen, greedy,
                                   logprobs), cache=cache)


# The decode step also donates ``seen`` (each step's is the previous step's output), so the
# [batch, vocab] mask is updated in place rather than allocated per token. The prefill does
# not: generate's warm-up run passes the same ``seen`` again.
@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache", "seen"))
def decode_step(state: nnx.State, cache, tokens: jax.Array, active: jax.Array,
                key: jax.Array, step: jax.Array, sampling: dict[str, jax.Array],
                seen: jax.Array, *, graphdef: nnx.GraphDef | Static, greedy: bool,
                implementation_key=None, logprobs: int = 0):
    """One new token per sequence (jitted; ``cache`` and ``seen`` are donated: use the
    returned ones).

    Args:
      state: the model's weights, ``nnx.split(model)[1]``.
      cache: the KV cache :func:`prefill_step` (or the previous step) returned.
      tokens: int32 ``[batch]``, each row's latest token, written at position
        ``cache.lengths[b]``.
      active: bool ``[batch]``; rows with False (batch padding) are not written.
      key: the ``jax.random`` key; step ``step`` samples with ``fold_in(key, step)``.
      step: int32 scalar, 1 for the first decode step, then 2, 3, ...
      sampling, seen: as for :func:`prefill_step`.
      graphdef, greedy, implementation_key, logprobs: static (:func:`step_statics`).

    Returns:
      ``(tokens, seen, cache)``: the next token of each row, int32 ``[batch]``; ``seen``
      with it marked; the cache one token longer per active row. With ``logprobs`` > 0, a
      fourth: :func:`~forge_jax.generation.sampling.token_logprobs`' dict.
    """
    model = nnx.merge(Static.unwrap(graphdef), state)
    positions = cache.lengths[:, None]  # [batch, 1]
    logits, cache = model.forward_cached(tokens[:, None], positions, active[:, None], cache,
                                         logits_at=jnp.zeros_like(cache.lengths))
    return _placed(model, *_sample(logits, jax.random.fold_in(key, step), sampling, seen,
                                   greedy, logprobs), cache=cache)


def _placed(model: CausalLM, tokens, seen, logprobs=None, *, cache):
    """On a mesh: the sampled tokens, ``seen`` and the log-probabilities replicated (every
    process can read them) and the cache kept in its shardings (so the next step takes it
    donated, with no recompile). Returns ``(tokens, seen, cache)``, and the
    log-probabilities after them when there are some."""
    if model.mesh is not None:
        replicated = model.mesh.replicated()
        tokens, seen, logprobs = jax.lax.with_sharding_constraint(
            (tokens, seen, logprobs), replicated)
        cache = jax.lax.with_sharding_constraint(cache, model.cache_shardings(cache))
    return (tokens, seen, cache) if logprobs is None else (tokens, seen, cache, logprobs)


# Inside compiled_cache.use_step_cache (the CLI's commands), the steps run executables kept
# on disk by an earlier process, untraced; elsewhere they are the jitted functions above.
prefill_step = compiled_cache.CachedStep(prefill_step, "prefill", (*_STATIC, "empty_cache"))
decode_step = compiled_cache.CachedStep(decode_step, "decode", _STATIC)
