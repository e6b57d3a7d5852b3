"""The serving engine's speculative decoding (its ``EngineConfig.speculative``): which
requests draft tokens, their prompt-lookup drafts, and what a verified step gives back.

The drafts are prompt lookup's (drawn on the host) or a draft model's
(:mod:`forge_jax.serving.drafting`: drawn on the device just before the step; the host
schedules their rows and holds placeholders). A speculating request's last token and its
drafts are rows of the same ragged step as the other requests'
(:func:`forge_jax.serving.batch_step.ragged_step` verifies them, as
:mod:`forge_jax.generation.speculative` does for ``generate``); the kept drafts enter its
tokens and its cache, and the pages of the refused ones go back to the pool.
"""

from __future__ import annotations

import logging

from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation import speculative
from forge_jax.serving.requests import Request

log = logging.getLogger("forge_jax.serve")


def draft_model(engine):
    """The :class:`~forge_jax.serving.drafting.DraftModel` of ``engine``'s speculative
    config (None without a draft model)."""
    config = engine.config.speculative
    # A model whose cache cannot drop rejected drafts (a recurrent state has absorbed them)
    # says why in ``speculation_refused``.
    reason = getattr(engine.model, "speculation_refused", None)
    if config is not None and reason:
        raise ValueError(f"speculative decoding: {reason}")
    if config is None or config.draft_model is None:
        return None
    from forge_jax.serving import drafting

    return drafting.DraftModel.create(engine, config.draft_model)


# Why a request decodes one token per step in a speculating engine.
PENALTIES = ("a request with a repetition, presence or frequency penalty or a logit bias "
             "decodes one token per step: the verification does not apply them")


def not_speculating(engine, r: Request) -> str | None:
    """Why ``r`` does not draft tokens in ``engine`` (an :class:`~forge_jax.serving.Engine`
    whose config has ``speculative``), or None: it does."""
    p = r.params.sampling
    if p.repetition_penalty not in (None, 1.0) or p.needs_token_counts or p.logit_bias:
        return PENALTIES
    return None


def speculates(engine, r: Request) -> bool:
    """Whether ``r`` drafts tokens in ``engine``: speculative decoding on and nothing in its
    sampling that the verification cannot apply (:func:`not_speculating`; the reason is
    logged once per engine). A grammar is applied: each verified row is masked by the
    grammar's state after the drafts before it (:func:`grammar_drafts`)."""
    if engine.config.speculative is None:
        return False
    reason = not_speculating(engine, r)
    if reason is not None and reason not in engine.stats.not_speculating:
        engine.stats.not_speculating.add(reason)
        log.info("speculative decoding: %s", reason)
    return reason is None


def drafts(engine, r: Request, budget: int) -> list[int]:
    """Prompt-lookup drafts after ``r``'s last token, within its ``max_tokens``, the
    context and the step's token ``budget`` (its last token takes one); with a draft model,
    as many placeholders (0) as fit, for the drafts it draws on the device. A constrained
    request's drafts are the grammar's (:func:`grammar_drafts`), drawn on the host with or
    without a draft model: the mask of each verify row needs them before the step."""
    config = engine.config.speculative
    room = max(0, min(config.num_tokens, budget - 1, r.params.max_tokens - len(r.generated) - 1,
                      engine.max_model_len - len(r.tokens) - 1))
    if r.matcher is not None:
        return grammar_drafts(r, speculative.propose_ngram(r.tokens, config)[:room], room)
    if config.draft_model is not None:
        return [0] * room
    proposals = speculative.propose_ngram(r.tokens, config)[:room]
    if not proposals and getattr(engine, "warming_up", False):
        # (the warm-up's random prompts rarely repeat: any drafts compile the verify steps)
        proposals = [r.tokens[-1]] * room
    return proposals


def grammar_drafts(r: Request, proposals: list[int], room: int) -> list[int]:
    """The drafts of a constrained request ``r``: the longest prefix of ``proposals`` its
    grammar allows, or the tokens the grammar forces from here (a JSON key's quotes and
    name: jump-forward decoding's tokens, verified as drafts) where those are more. Sets
    ``r.draft_masks``, the grammar's mask after each draft, for the verify step's rows;
    the matcher is rolled back to ``r``'s last token (the kept drafts are consumed when
    they are read)."""
    matcher = r.matcher
    drafts = proposals[:matcher.valid_prefix(proposals)]
    forced = matcher.forced()[:room]
    if len(forced) > len(drafts):
        drafts = forced
    r.draft_masks = []
    for token in drafts:
        if not matcher.consume(token):
            raise RuntimeError(f"the grammar refused draft {token} it had allowed: "
                               f"{matcher.error}")
        r.draft_masks.append(matcher.mask())
    matcher.rollback(len(drafts))
    return drafts


def copy_pages(engine, copies):
    """Applies page copies to a draft model's pool; returns the engine's cache, copied."""
    if engine.draft is not None:
        engine.draft.pool = engine.draft.pool.copy_pages(copies)
    return engine.cache.copy_pages(copies)


def dispatch(engine, batch):
    """Dispatches ``engine``'s step of ``batch`` (a
    :class:`~forge_jax.serving.batch_step.StepBatch`): with a draft model, its drafts
    proposed before and the step's rows written into its pool after. Returns
    ``ragged_step``'s output."""
    import forge_jax as fj
    from forge_jax.serving import batch_step

    arrays = batch_step.step_arrays(batch)
    last_tokens, verify = engine._last_tokens, batch.verify
    if engine.draft is not None:
        from forge_jax.serving import drafting

        verify = drafting.propose(engine, batch)
    out = batch_step.ragged_step(
        engine.weights, engine.cache, arrays, batch.sampling, batch.seen, last_tokens,
        batch.extras or None, verify, graphdef=engine._graphdef,
        weights_def=engine.weights_def, greedy=batch.greedy, logprobs=batch.logprobs,
        implementation_key=fj.dispatch.current_preference())
    if engine.draft is not None:
        drafting.fill(engine, arrays, last_tokens, verify)
    return out


def logprobs(r: Request, aux: dict, i: int, j: int) -> None:
    """Appends to ``r.logprobs`` (if it asks for them) those of the ``j``-th new token of
    the verified sequence ``i`` (``aux``: the step's, on the host), from the target's
    logits at that row."""
    k = r.params.sampling.logprobs
    if k is None:
        return
    out = aux["out"]
    arrays = dict(aux["verified_logprobs"], tokens=out.reshape(-1))
    r.logprobs.append(sampling_lib.host_logprobs(arrays, i * out.shape[1] + j, k))


def kept(engine, r: Request, new) -> list[int]:
    """Books a verified step of ``r`` that gave the tokens ``new`` (its kept drafts and one
    more): the counters, its computed tokens and its pages (the refused drafts' go back; a
    request preempted meanwhile is recomputed later, from its tokens). Returns ``new``."""
    new = [int(t) for t in new]
    stats = engine.stats
    stats.draft_tokens += len(r.drafts)
    stats.accepted_tokens += len(new) - 1
    stats.verified += 1
    r.drafts, r.draft_masks = [], []
    if r.id in engine.manager:  # still running
        r.computed += len(new) - 1
        engine.manager.truncate(r.id, r.computed)
    return new
