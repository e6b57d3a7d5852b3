"""The serving engine's speculative decoding (its ``EngineConfig.speculative``): which
requests draft tokens, their prompt-lookup drafts, and what a verified step gives back.

A speculating request's last token and its drafts are rows of the same ragged step as the
other requests' (:func:`forge_jax.serving.batch_step.ragged_step` verifies them, as
:mod:`forge_jax.generation.speculative` does for ``generate``); the kept drafts enter its
tokens and its cache, and the pages of the refused ones go back to the pool.
"""

from __future__ import annotations

from forge_jax.generation import speculative
from forge_jax.serving.requests import Request


def speculates(engine, r: Request) -> bool:
    """Whether ``r`` drafts tokens in ``engine`` (an :class:`~forge_jax.serving.Engine`):
    speculative decoding on, and nothing in its sampling that the verification does not
    apply (a grammar, logprobs, penalties, a logit bias)."""
    p = r.params.sampling
    return engine.config.speculative is not None and r.matcher is None and (
        p.logprobs is None and p.repetition_penalty in (None, 1.0)
        and not p.needs_token_counts and not p.logit_bias)


def drafts(engine, r: Request, budget: int) -> list[int]:
    """Prompt-lookup drafts after ``r``'s last token, within its ``max_tokens``, the
    context and the step's token ``budget`` (its last token takes one)."""
    config = engine.config.speculative
    room = min(config.num_tokens, budget - 1, r.params.max_tokens - len(r.generated) - 1,
               engine.max_model_len - len(r.tokens) - 1)
    return speculative.propose_ngram(r.tokens, config)[:max(room, 0)]


def kept(engine, r: Request, new) -> list[int]:
    """Books a verified step of ``r`` that gave the tokens ``new`` (its kept drafts and one
    more): the counters, its computed tokens and its pages (the refused drafts' go back; a
    request preempted meanwhile is recomputed later, from its tokens). Returns ``new``."""
    new = [int(t) for t in new]
    stats = engine.stats
    stats.draft_tokens += len(r.drafts)
    stats.accepted_tokens += len(new) - 1
    stats.verified += 1
    r.drafts = []
    if r.id in engine.manager:  # still running
        r.computed += len(new) - 1
        engine.manager.truncate(r.id, r.computed)
    return new
