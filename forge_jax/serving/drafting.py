"""The serving engine's draft model (speculative decoding with ``SpeculativeConfig(
draft_model=...)``): its page pool, the drafts it proposes for a step and the step's rows
written into its pool.

The draft's pool has the target's page count and page size and is indexed by the same
block tables (the engine's :class:`~forge_jax.kv_cache.BlockManager` hands out a page for
both), so a page holds the same tokens in both pools: every step's rows, prefill chunks,
decode tokens and drafts alike, are run through the draft too (:func:`fill_step`), which
keeps prefix-cached pages, preempted and recomputed requests and refused drafts right in
the draft's pool as they are in the target's. Before a step that verifies drafts, the draft
proposes them (:func:`propose_step`): from each speculating sequence's last token, ``k``
tokens one after another, each drawn from the draft's distribution with the sequence's own
sampling parameters; the tokens and their distributions stay on the device and go into the
target's step (:func:`forge_jax.serving.batch_step.ragged_step`), whose verification keeps
a draft ``d`` with probability ``min(1, p(d) / q(d))``. A constrained sequence keeps the
drafts its grammar gave on the host (:func:`forge_jax.serving.speculation.grammar_drafts`),
with a one-hot ``q``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation import speculative
from forge_jax.generation.steps import Static
from forge_jax.kv_cache import PagedKVCache, RaggedBatchCache, RaggedMetadata
from forge_jax.serving import batch_step


@dataclasses.dataclass
class DraftModel:
    """A draft model's weights and page pool in an engine.

    Attributes:
      graphdef: ``nnx.split(draft)[0]`` in a :class:`Static`.
      weights, weights_def: the flat weights and their tree structure.
      pool: its :class:`~forge_jax.kv_cache.PagedKVCache` (the engine's page geometry).
    """

    graphdef: Static
    weights: list
    weights_def: object
    pool: PagedKVCache

    @classmethod
    def create(cls, engine, model) -> DraftModel:
        """The draft ``model``'s state for ``engine`` (ValueError, one line, for a draft of
        another vocabulary or on a mesh)."""
        speculative.check_draft(engine.model, model)
        if engine.model.mesh is not None or model.mesh is not None:
            raise ValueError("speculative decoding with a draft model does not run on a mesh")
        graphdef, state = nnx.split(model)
        weights, weights_def = jax.tree.flatten(state)
        config, cache = model.config, engine.config.cache
        pool = PagedKVCache.create(
            num_layers=config.num_hidden_layers, num_pages=engine.manager.num_pages,
            page_size=engine.page_size, kv_heads=model.kv_heads, head_dim=config.head_dim,
            dtype=cache.resolved_dtype(model.dtype),
            block_tables=np.zeros((0, engine.pages_per_seq), np.int32),
            quantize=cache.kv_dtype, fold=False)
        return cls(Static(graphdef), weights, weights_def, pool)

    def statics(self, greedy: bool) -> dict:
        import forge_jax as fj

        return dict(graphdef=self.graphdef, weights_def=self.weights_def, greedy=greedy,
                    implementation_key=fj.dispatch.current_preference())


@functools.partial(jax.jit, static_argnames=("graphdef", "weights_def", "greedy",
                                             "implementation_key", "k"),
                   donate_argnames=("pool",))
def propose_step(weights: list, pool: PagedKVCache, tokens, positions, block_tables,
                 draft_len, num_seqs, sampling: dict, host=None, *, graphdef, weights_def,
                 greedy: bool, k: int, implementation_key=None):
    """``k`` drafts per sequence from the draft model (jitted; its pool donated).

    Args:
      weights, pool: the :class:`DraftModel`'s.
      tokens, positions: int32 ``[s]``, each sequence's last token (not in the pools yet)
        and its position.
      block_tables: int32 ``[s, width]``, the step's.
      draft_len: int32 ``[s]``: the drafts a sequence takes (0: none; it writes nothing).
      num_seqs: int32 scalar, the step's sequences.
      sampling: :class:`~forge_jax.serving.batch_step.StepBatch`'s ``sampling`` arrays.
      host: None, or ``(drafts int32 [s, k], rows bool [s])``: the sequences whose drafts
        came from the host (a grammar's) keep them, with a one-hot ``q`` (what the draft
        model writes for them is rewritten by :func:`fill_step`).
      graphdef, weights_def, greedy, k, implementation_key: static.

    Returns:
      ``(drafts, q, pool)``: int32 ``[s, k]``, float32 ``[s, k, vocab]`` (the distribution
      each draft was drawn from; one-hot for a greedy sequence) and the pool holding the
      last token and the drafts but the last.
    """
    del implementation_key
    model = nnx.merge(Static.unwrap(graphdef), jax.tree.unflatten(weights_def, weights))
    s = tokens.shape[0]
    cu = jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_seqs)
    is_greedy = sampling["temperature"] < sampling_lib.GREEDY_BELOW
    temperature = jnp.where(is_greedy, 1.0, sampling["temperature"])
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed), step), 2))(sampling["seed"], sampling["step"])

    def draw(logits, key, t, top_k, p, m):
        params = dict(temperature=t, top_k=top_k, top_p=p, min_p=m)
        token, q = speculative.draw_draft(logits[None], key, params, greedy=False)
        return token[0], q[0]

    def one(carry, j):
        pool, token = carry
        metadata = RaggedMetadata(block_tables=block_tables, kv_lengths=positions + j + 1,
                                  cu_q_lens=cu, num_seqs=num_seqs)
        valid = (draft_len > 0) & (j <= draft_len)  # a draft's page was appended for it
        logits, packed = model.forward_cached(token[None], (positions + j)[None], valid[None],
                                              RaggedBatchCache.from_pool(pool, metadata))
        logits = logits[0].astype(jnp.float32)  # [s, vocab]
        greedy_token, greedy_q = speculative.draw_draft(logits, None, {}, greedy=True)
        if greedy:
            drawn, q = greedy_token, greedy_q
        else:
            step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, j)
            drawn, q = jax.vmap(draw)(logits, step_keys, temperature, sampling["top_k"],
                                      sampling["top_p"], sampling["min_p"])
            drawn = jnp.where(is_greedy, greedy_token, drawn)
            q = jnp.where(is_greedy[:, None], greedy_q, q)
        return (packed.into_pool(pool), drawn), (drawn, q)

    (pool, _), (drafts, q) = jax.lax.scan(one, (pool, tokens), jnp.arange(k, dtype=jnp.int32))
    drafts, q = drafts.T, jnp.swapaxes(q, 0, 1)  # [s, k], [s, k, vocab]
    if host is not None:
        host_drafts, rows = host
        drafts = jnp.where(rows[:, None], host_drafts, drafts)
        q = jnp.where(rows[:, None, None], jax.nn.one_hot(host_drafts, q.shape[-1],
                                                          dtype=q.dtype), q)
    return drafts, q, pool


@functools.partial(jax.jit, static_argnames=("graphdef", "weights_def", "implementation_key"),
                   donate_argnames=("pool",))
def fill_step(weights: list, pool: PagedKVCache, batch: dict, last_tokens, verify: dict | None,
              *, graphdef, weights_def, implementation_key=None):
    """Writes a step's rows (``batch`` and ``last_tokens`` as
    :func:`~forge_jax.serving.batch_step.ragged_step` takes them, the drafts' rows from
    ``verify["drafts"]``) into the draft's ``pool`` (jitted; donated). Returns the pool."""
    del implementation_key
    model = nnx.merge(Static.unwrap(graphdef), jax.tree.unflatten(weights_def, weights))
    feed = batch["feed"]
    fed = jnp.where(feed >= 0, last_tokens[jnp.maximum(feed, 0)], batch["tokens"])
    if verify is not None:
        fed = batch_step.packed_drafts(fed, verify)
    metadata = RaggedMetadata(block_tables=batch["block_tables"],
                              kv_lengths=batch["kv_lengths"], cu_q_lens=batch["cu_q_lens"],
                              num_seqs=batch["num_seqs"])
    _, packed = model.forward_cached(fed[None], batch["positions"][None],
                                     batch["slots"][None] >= 0,
                                     RaggedBatchCache.from_pool(pool, metadata),
                                     logits_at=jnp.zeros((1,), jnp.int32))
    return packed.into_pool(pool)


def propose(engine, batch) -> dict | None:
    """``batch.verify`` (a :class:`~forge_jax.serving.batch_step.StepBatch`'s) with the
    draft model's ``drafts`` and their ``q`` (device arrays) for the sequences that take
    drafts; None when none does."""
    verify, draft = batch.verify, engine.draft
    if verify is None:
        return None
    first = verify["verify_rows"][:, 0]  # each sequence's last known row
    host = None
    if "host_drafts" in verify:  # a grammar's drafts, already in the step's tokens
        host = (batch.tokens[verify["verify_rows"][:, 1:]], verify["host_drafts"])
    drafts, q, draft.pool = propose_step(
        draft.weights, draft.pool, batch.tokens[first], batch.positions[first],
        batch.block_tables, verify["draft_len"], np.int32(batch.num_seqs), batch.sampling,
        host, **draft.statics(batch.greedy), k=verify["verify_rows"].shape[1] - 1)
    return dict(verify, drafts=drafts, q=q)


def fill(engine, arrays: dict, last_tokens, verify: dict | None) -> None:
    """Runs the step's rows (:func:`~forge_jax.serving.batch_step.step_arrays`) through the
    draft model, into its pool."""
    draft = engine.draft
    statics = draft.statics(False)
    del statics["greedy"]
    draft.pool = fill_step(draft.weights, draft.pool, arrays, last_tokens, verify, **statics)
