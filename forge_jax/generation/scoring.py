"""Scoring a sequence: the log-probability of each of its tokens given the ones before it
(an evaluation harness's ``echo`` with ``logprobs``), from one jitted forward pass.

The distribution is the model's own (no penalty, temperature or filter): the log-softmax of
its logits, as :func:`forge_jax.generation.sampling.token_logprobs` reports it at
temperature 0 without penalties.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation.steps import Static


@functools.partial(jax.jit, static_argnames=("graphdef", "k"))
def _score(state, tokens, *, graphdef, k: int):
    """tokens int32 ``[1, t]`` -> token_logprobs of tokens[1:] given the prefixes."""
    model = nnx.merge(Static.unwrap(graphdef), state)
    logits = model(tokens)[0, :-1]  # [t - 1, vocab]: the prediction of each next token
    return sampling_lib.token_logprobs(logits, tokens[0, 1:], k)


def _bucket(n: int) -> int:
    return max(8, 1 << max(n - 1, 0).bit_length())


def sequence_logprobs(model, ids: Sequence[int], k: int = 0, *, graphdef=None, state=None
                      ) -> list[sampling_lib.TokenLogprob]:
    """Each token of ``ids`` with its log-probability after the tokens before it and the
    ``k`` (0 to :data:`~forge_jax.generation.sampling.MAX_LOGPROBS`) most likely tokens
    there; the first token has none (``logprob`` None, no alternatives).

    Args:
      model: a :class:`~forge_jax.models.llama.Llama` (or pass ``graphdef`` and ``state``,
        its ``nnx.split``, to skip splitting it per call).
      ids: the token ids, non-empty.
      k: alternatives per token.

    Returns:
      One :class:`~forge_jax.generation.sampling.TokenLogprob` per token of ``ids``.
    """
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("ids must be non-empty")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= sampling_lib.MAX_LOGPROBS:
        raise ValueError(f"k must be an int in [0, {sampling_lib.MAX_LOGPROBS}], got k={k!r}")
    first = sampling_lib.TokenLogprob(ids[0], None, ())
    if len(ids) == 1:
        return [first]
    if graphdef is None:
        graphdef, state = nnx.split(model)
    # Padded to a power of two (one compiled variant per octave); the padding comes after
    # the tokens, so causal attention keeps it out of their predictions.
    tokens = np.zeros((1, _bucket(len(ids))), np.int32)
    tokens[0, :len(ids)] = ids
    out = jax.device_get(_score(state, jnp.asarray(tokens), graphdef=Static(graphdef),
                                k=max(1, k)))
    out["tokens"] = tokens[0, 1:]
    return [first] + [sampling_lib.host_logprobs(out, i, k) for i in range(len(ids) - 1)]
