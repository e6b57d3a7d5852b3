"""The serving engine's jitted step: the new tokens of many sequences (prefill chunks and
decode tokens alike) packed into one row, attended with :func:`forge_jax.ragged_paged_attention`
over the page pool, and one token sampled per sequence with its own parameters.

:class:`forge_jax.serving.engine.Engine` builds the :class:`StepBatch` on the host and runs
:func:`ragged_step`; the pages are donated (updated in place). Shapes are static per
``(tokens, sequences, table width)``; the engine buckets the tokens and the block tables' width
to powers of two (the sequences follow the tokens) so that new traffic reuses the compiled
variants.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from forge_jax.generation import compiled_cache
from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation.steps import Static
from forge_jax.kv_cache import BlockManager, PagedKVCache, RaggedMetadata
from forge_jax.serving.requests import Request


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's host-built inputs (NumPy).

    Attributes:
      tokens, positions, slots: int32 ``[tokens]`` (padding: token 0, position 0, slot -1;
        the device reads ``slots >= 0`` as the rows to write and derives each row's slot
        from its position and block table, :class:`~forge_jax.kv_cache.RaggedBatchCache`).
      block_tables: int32 ``[max_seqs, pages_per_seq]``.
      kv_lengths: int32 ``[max_seqs]``.
      cu_q_lens: int32 ``[max_seqs + 1]``.
      num_seqs: int, sequences in the step.
      last_rows: int32 ``[max_seqs]``, each sequence's last row (its logits are sampled).
      sampling: per sequence ``[max_seqs]`` arrays: ``temperature``, ``top_k`` (0: all),
        ``top_p``, ``min_p``, ``repetition_penalty``, ``seed`` (uint32) and ``step`` (the
        index of the token being drawn, folded into the seed's key).
      seen: bool ``[max_seqs, vocab]`` (each sequence's tokens, for the repetition
        penalty), or None when no sequence has a penalty (nothing that size is uploaded).
      greedy: whether every sequence is greedy without a penalty (the cheaper compiled mode).
      feed: int32 ``[tokens]``: for a row whose token the previous step draws (it is not on
        the host yet), that token's index in the previous step's tokens; -1 elsewhere.
      extras: the per-sequence logit adjustments some sequence asks for, each absent when
        none does: ``counts`` float32 ``[max_seqs, vocab]`` (each sequence's generated tokens
        counted, for the presence and frequency penalties, whose values are in
        ``sampling``), ``bias`` float32 ``[max_seqs, vocab]`` (``logit_bias``), ``mask``
        int32 ``[max_seqs, ceil(vocab / 32)]`` (the grammar's allowed tokens as a bitmask,
        bit ``t % 32`` of word ``t // 32``; all ones for a free sequence).
      logprobs: whether some sequence asks for log-probabilities (the step then returns them).
      verify: with speculative decoding (``k`` drafts at most), ``verify_rows`` int32
        ``[max_seqs, k + 1]`` (a sequence's last known row then its draft rows, padded with
        its last row) and ``draft_len`` int32 ``[max_seqs]``; None without. With a
        constrained sequence among the drafting ones, ``masks`` int32 ``[max_seqs, k + 1,
        ceil(vocab / 32)]``: each verify row's grammar bitmask (the state after the drafts
        before it; all ones for a free sequence), applied before verification, and
        ``host_drafts`` bool ``[max_seqs]``, the constrained sequences (their drafts are
        the grammar's, from the host). A draft model adds (on the device) its ``drafts``
        int32 ``[max_seqs, k]``, which replace the draft rows' tokens (but the host's), and
        their distributions ``q`` float32 ``[max_seqs, k, vocab]`` (one-hot for the host's
        drafts; :mod:`forge_jax.serving.drafting`).
      state: for a model keeping a state per sequence, ``state_slots`` int32 ``[seqs]``
        (each sequence's slot, ``-1`` past the step's) and ``segment_rows`` int32 ``[seqs,
        span]`` (the rows of each sequence's new tokens, ``-1`` past them; ``seqs`` and
        ``span`` powers of two): the :class:`~forge_jax.kv_cache.RaggedMetadata` fields of
        the same names. None otherwise.
    """

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    kv_lengths: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: int
    last_rows: np.ndarray
    sampling: dict[str, np.ndarray]
    seen: np.ndarray | None
    greedy: bool
    feed: np.ndarray
    extras: dict = dataclasses.field(default_factory=dict)
    logprobs: bool = False
    verify: dict | None = None
    state: dict | None = None

    @property
    def shape_key(self) -> tuple:
        """What selects a compiled variant of :func:`ragged_step`: the token rows, the block
        tables' shape, greedy or not, with a repetition penalty or not, the extras,
        logprobs, the per-sequence state grid, grammar masks on the verify rows and the
        verified rows."""
        return (self.tokens.shape[0], self.block_tables.shape, self.greedy,
                self.seen is not None, tuple(sorted(self.extras)), self.logprobs,
                None if self.state is None else self.state["segment_rows"].shape,
                self.verify is not None and "masks" in self.verify,
                None if self.verify is None else self.verify["verify_rows"].shape[1])


def adjust_logits(logits, sampling: dict, seen, extras: dict):
    """The logits ``[rows, vocab]`` after the repetition penalty (``seen``, None: off), the
    presence and frequency penalties (``extras["counts"]``) and the logit bias
    (``extras["bias"]``), in float32: the distribution the log-probabilities report
    (:func:`forge_jax.generation.sampling.token_logprobs`)."""
    logits = logits.astype(jnp.float32)
    if seen is not None:
        logits = sampling_lib.apply_repetition_penalty(
            logits, seen, sampling["repetition_penalty"][:, None])
    counts = extras.get("counts")
    if counts is not None:  # OpenAI's: presence once per generated token, frequency per time
        present = (counts > 0).astype(jnp.float32)
        logits = logits - sampling["presence_penalty"][:, None] * present \
            - sampling["frequency_penalty"][:, None] * counts
    if extras.get("bias") is not None:
        logits = logits + extras["bias"]
    return logits


def allowed_tokens(mask_words: jax.Array, vocab: int) -> jax.Array:
    """bool ``[rows, vocab]`` from a grammar's int32 bitmask ``[rows, ceil(vocab / 32)]``."""
    index = jnp.arange(vocab, dtype=jnp.int32)
    words = mask_words[:, index // 32]  # [rows, vocab]
    return ((words >> (index % 32)) & 1) == 1


def sample_rows(logits, sampling: dict, seen, *, greedy: bool, extras: dict | None = None,
                logprobs: bool = False):
    """One token per row of ``logits`` ``[rows, vocab]``, each row with its own parameters
    (``sampling``'s ``[rows]`` arrays, as :class:`StepBatch` describes) and ``extras``
    (:func:`adjust_logits`, then the grammar mask ``extras["mask"]``); greedy rows
    (temperature below :data:`~forge_jax.generation.sampling.GREEDY_BELOW`) take the argmax
    of the adjusted, masked logits (``seen`` None: no row has a repetition penalty).
    Returns int32 ``[rows]``, and with ``logprobs`` also
    :func:`~forge_jax.generation.sampling.token_logprobs`' dict of the adjusted logits
    (before the mask, the temperature and the filters)."""
    extras = extras or {}
    logits = adjust_logits(logits, sampling, seen, extras)
    adjusted = logits
    if extras.get("mask") is not None:
        logits = jnp.where(allowed_tokens(extras["mask"], logits.shape[-1]), logits, -jnp.inf)
    tokens = _draw(logits, sampling, greedy)
    if logprobs:
        return tokens, sampling_lib.token_logprobs(adjusted, tokens)
    return tokens


def _draw(logits, sampling: dict, greedy: bool):
    if greedy:
        return sampling_lib.sample(logits, None, temperature=0.0)
    argmax = sampling_lib.sample(logits, None, temperature=0.0)
    is_greedy = sampling["temperature"] < sampling_lib.GREEDY_BELOW
    temperature = jnp.where(is_greedy, 1.0, sampling["temperature"])
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
        sampling["seed"], sampling["step"])

    def one(row, key, t, k, p, m):
        return sampling_lib.sample(row[None], key, temperature=t, top_k=k, top_p=p,
                                   min_p=m)[0]

    drawn = jax.vmap(one)(logits, keys, temperature, sampling["top_k"], sampling["top_p"],
                          sampling["min_p"])
    return jnp.where(is_greedy, argmax, drawn)


def verify_rows(logits, drafts, draft_len, sampling: dict, *, greedy: bool, q=None):
    """Speculative verification of each sequence's drafts, each with its own parameters:
    :func:`forge_jax.generation.speculative.verify_drafts` row by row (greedy rows by argmax).
    ``logits`` ``[s, k + 1, vocab]``, ``drafts`` ``[s, k]``, ``draft_len`` ``[s]``, ``q``
    ``[s, k, vocab]`` (a draft model's distributions) or None.
    Returns ``(out [s, k + 1], count [s])``."""
    from forge_jax.generation import speculative

    argmax_out, argmax_count = speculative.verify_drafts(logits, drafts, draft_len, None, {},
                                                   greedy=True)
    if greedy:
        return argmax_out, argmax_count
    is_greedy = sampling["temperature"] < sampling_lib.GREEDY_BELOW
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed), step), 1))(sampling["seed"], sampling["step"])

    def one(row, draft, n, key, t, k, p, m, q_row):
        params = dict(temperature=t, top_k=k, top_p=p, min_p=m)
        out, count = speculative.verify_drafts(
            row[None], draft[None], n[None], key, params, greedy=False,
            q=None if q is None else q_row[None])
        return out[0], count[0]

    out, count = jax.vmap(one)(logits, drafts, draft_len, keys,
                               jnp.where(is_greedy, 1.0, sampling["temperature"]),
                               sampling["top_k"], sampling["top_p"], sampling["min_p"],
                               draft_len if q is None else q)
    return (jnp.where(is_greedy[:, None], argmax_out, out),
            jnp.where(is_greedy, argmax_count, count))


def packed_drafts(fed, verify):
    """The step's packed tokens with the drafts (``verify["drafts"]``, on the device) in
    their rows."""
    k = verify["verify_rows"].shape[1] - 1
    real = jnp.arange(k)[None, :] < verify["draft_len"][:, None]  # [s, k]
    rows = jnp.where(real, verify["verify_rows"][:, 1:], fed.shape[0])  # out of range: kept
    return fed.at[rows.reshape(-1)].set(verify["drafts"].reshape(-1), mode="drop")


@functools.partial(jax.jit, static_argnames=("graphdef", "weights_def", "greedy",
                                             "implementation_key", "logprobs"),
                   donate_argnames=("cache",))
def ragged_step(weights: list, cache: PagedKVCache, batch: dict, sampling: dict, seen,
                last_tokens, extras: dict | None = None, verify: dict | None = None, *,
                graphdef: nnx.GraphDef | Static, weights_def, greedy: bool,
                implementation_key=None, logprobs: bool = False):
    """Writes and attends one packed batch, samples one token per sequence (jitted; the
    cache is donated: use the returned one).

    Args:
      weights: the model's weights as a flat list, ``jax.tree.flatten(nnx.split(model)[1])``
        (a list flattens faster at each dispatch than the state).
      cache: the engine's page pools (its own block tables and lengths are not read: the
        step's come in ``batch``, as a :class:`~forge_jax.kv_cache.RaggedMetadata`).
      batch: :class:`StepBatch`'s arrays ``tokens``, ``positions``, ``slots``,
        ``block_tables``, ``kv_lengths``, ``cu_q_lens``, ``num_seqs`` and ``last_rows``.
      sampling, seen: as :class:`StepBatch` describes (``seen`` None when ``greedy`` or
        when no sequence has a repetition penalty).
      last_tokens: int32 ``[max_seqs]``, the previous step's tokens (what it returned), which
        ``batch["feed"]`` indexes: the rows it names take their token from there (and a
        sequence's ``seen`` counts it), so a step can be dispatched before the host has read
        the previous one's tokens.
      extras: :attr:`StepBatch.extras` (None or empty: none); a fed token counts in its
        sequence's ``counts``.
      verify: :attr:`StepBatch.verify` (None: no speculative decoding in this step).
      graphdef: static, ``nnx.split(model)[0]`` (or it in a :class:`Static`).
      weights_def: static, the tree structure of the state (``jax.tree.flatten``'s second).
      greedy: static, :attr:`StepBatch.greedy`.
      implementation_key: static, the active implementation preference
        (``fj.dispatch.current_preference()``), so that a preference change recompiles.
      logprobs: static, :attr:`StepBatch.logprobs`.

    Returns:
      ``(tokens, cache)``: int32 ``[max_seqs]`` (``last_tokens``' shape), the
      token drawn after each sequence's last row (meaningful for the rows that end their
      sequence's known tokens; zeros past the step's sequences). With ``logprobs`` or
      ``verify``, ``((tokens, aux), cache)``: ``aux["logprobs"]`` as
      :func:`~forge_jax.generation.sampling.token_logprobs` returns it, one row per
      sequence; ``aux["out"]`` int32 ``[s, k + 1]`` and ``aux["count"]`` ``[s]``, each
      sequence's new tokens (a speculating one's kept drafts and one more; ``tokens``
      holds its last); with both, ``aux["verified_logprobs"]``, those of ``aux["out"]``'s
      tokens, row ``i * (k + 1) + j`` for its ``[i, j]``.
    """
    del implementation_key
    graphdef = Static.unwrap(graphdef)
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    feed = batch["feed"]
    fed = jnp.where(feed >= 0, last_tokens[jnp.maximum(feed, 0)], batch["tokens"])  # [tokens]
    if verify is not None and "drafts" in verify:  # a draft model's, drawn on the device
        fed = packed_drafts(fed, verify)
    extras = dict(extras or {})
    if seen is not None or extras.get("counts") is not None:
        # A fed token is its sequence's first (and only) row.
        seqs = jnp.arange(batch["last_rows"].shape[0])
        first = jnp.minimum(batch["cu_q_lens"][:-1], fed.shape[0] - 1)  # [seqs]
        was_fed = (feed[first] >= 0) & (seqs < batch["num_seqs"])
        if seen is not None:
            seen = seen.at[seqs, fed[first]].set(seen[seqs, fed[first]] | was_fed)
        if extras.get("counts") is not None:
            extras["counts"] = extras["counts"].at[seqs, fed[first]].add(
                was_fed.astype(jnp.float32))
    metadata = RaggedMetadata(block_tables=batch["block_tables"],
                              kv_lengths=batch["kv_lengths"], cu_q_lens=batch["cu_q_lens"],
                              num_seqs=batch["num_seqs"], state_slots=batch.get("state_slots"),
                              segment_rows=batch.get("segment_rows"))
    tokens = fed[None]  # [1, tokens]: one packed row
    s = batch["last_rows"].shape[0]
    rows = batch["last_rows"]
    if verify is not None:  # the drafts' rows too: [s + s * (k + 1)]
        rows = jnp.concatenate([rows, verify["verify_rows"].reshape(-1)])
    logits, packed = model.forward_cached(tokens, batch["positions"][None],
                                          batch["slots"][None] >= 0,
                                          model.packed_cache(cache, metadata),
                                          logits_at=rows[None])
    next_tokens = sample_rows(logits[0, :s], sampling, seen, greedy=greedy, extras=extras,
                              logprobs=logprobs)  # [s]
    aux = {}
    if logprobs:
        next_tokens, aux["logprobs"] = next_tokens
    if verify is not None:
        k1 = verify["verify_rows"].shape[1]
        spec_logits = logits[0, s:].reshape(s, k1, -1).astype(jnp.float32)
        drafts = fed[verify["verify_rows"][:, 1:]]  # [s, k]
        masked = spec_logits
        if "masks" in verify:  # each row by the grammar's state after the drafts before it
            words = verify["masks"].shape[-1]
            allowed = allowed_tokens(verify["masks"].reshape(s * k1, words),
                                     spec_logits.shape[-1]).reshape(spec_logits.shape)
            masked = jnp.where(allowed, spec_logits, -jnp.inf)
        out, count = verify_rows(masked, drafts, verify["draft_len"], sampling,
                                 greedy=greedy, q=verify.get("q"))
        speculating = verify["draft_len"] > 0
        if logprobs:  # of each verified row's token (a speculating sequence has no penalty)
            aux["verified_logprobs"] = sampling_lib.token_logprobs(
                spec_logits.reshape(s * k1, -1), out.reshape(-1))
        last = jnp.take_along_axis(out, (count - 1)[:, None], axis=1)[:, 0]
        next_tokens = jnp.where(speculating, last, next_tokens)
        aux["out"] = jnp.where(speculating[:, None], out, next_tokens[:, None])
        aux["count"] = jnp.where(speculating, count, 1)
    next_tokens = jnp.zeros_like(last_tokens).at[:next_tokens.shape[0]].set(next_tokens)
    cache = packed.into_pool(cache)
    if model.mesh is not None:  # kept in their shards: the next step takes them donated
        cache = jax.lax.with_sharding_constraint(cache, model.cache_shardings(cache))
        next_tokens = jax.lax.with_sharding_constraint(next_tokens, model.mesh.replicated())
        aux = jax.lax.with_sharding_constraint(aux, model.mesh.replicated())
    if aux:
        return (next_tokens, aux), cache
    return next_tokens, cache


# Inside compiled_cache.use_step_cache (``forge-jax serve``), the step's variants run
# executables kept on disk by an earlier process, untraced; elsewhere it is the jitted step.
ragged_step = compiled_cache.CachedStep(
    ragged_step, "ragged", ("graphdef", "weights_def", "greedy", "implementation_key",
                            "logprobs"))


def pool_sharding(mesh, kv_heads: int):
    """The sharding of a page pool ``[kv_heads, num_pages, page_size, head_dim]`` on a
    model's mesh (``forge_jax.sharding.MeshConfig``): KV heads over the tensor axis when
    they divide, as :func:`forge_jax.models.llama_sharding.cache_shardings` places them."""
    return mesh.sharding(mesh.tp_name if kv_heads % mesh.tp == 0 else None, None, None, None)


def step_arrays(batch: StepBatch) -> dict[str, np.ndarray]:
    """The ``batch`` argument of :func:`ragged_step`."""
    return dict(tokens=batch.tokens, positions=batch.positions, slots=batch.slots,
                block_tables=batch.block_tables, kv_lengths=batch.kv_lengths,
                cu_q_lens=batch.cu_q_lens, num_seqs=np.int32(batch.num_seqs),
                last_rows=batch.last_rows, feed=batch.feed, **(batch.state or {}))


def pow2_at_least(n: int, low: int) -> int:
    """The smallest power of two at least ``n`` and ``low``."""
    return max(low, 1 << max(0, n - 1).bit_length())


def row_bucket(n: int, low: int) -> int:
    """The rows a step of ``n`` tokens is padded to: a power of two at least ``low``, or
    three quarters of one from 192 rows up (padding rows cost the linear layers as much as
    real ones: a 145-row prefill step would otherwise pay for 256)."""
    rows = pow2_at_least(n, low)
    three_quarters = rows * 3 // 4
    if rows >= 256 and max(n, low) <= three_quarters:
        return three_quarters
    return rows


# Block tables are as wide as the step's longest sequence needs, rounded up to a power of two
# pages at least this (and at most the context's): every row reads its table's width of
# slots, so a short step over a long context does not read the whole context per row.
MIN_TABLE_PAGES = 16


def build_batch(scheduled: list[tuple[Request, int]], manager: BlockManager, *, min_rows: int,
                max_seqs: int, pages_per_seq: int, vocab_size: int,
                speculative: int = 0, state_slots=None) -> StepBatch:
    """The :class:`StepBatch` of the engine's scheduled ``(request, new rows)`` pairs: rows
    padded to :func:`row_bucket`'s size, block tables as wide as the longest
    sequence needs (a power of two from :data:`MIN_TABLE_PAGES`, at most ``pages_per_seq``);
    with ``speculative`` (k drafts at most) and a request with drafts, its draft rows follow
    its last token and :attr:`StepBatch.verify` says where they are; with ``state_slots``
    (the engine's :class:`~forge_jax.serving.state_slots.StateSlots`) keeping a state per
    sequence, :attr:`StepBatch.state` names each sequence's slot and rows."""
    total = sum(n for _, n in scheduled)
    rows = row_bucket(total, min_rows)
    tokens = np.zeros((rows,), np.int32)
    positions = np.zeros((rows,), np.int32)
    slots = np.full((rows,), -1, np.int32)
    # Sequences per step at most: no more than rows, so that a small step (a few decodes)
    # does not project max_seqs rows onto the vocabulary. One variant per row bucket still.
    s = min(rows, max_seqs)
    cu = np.zeros((s + 1,), np.int32)
    kv = np.zeros((s,), np.int32)
    last = np.zeros((s,), np.int32)
    ids = [r.id for r, _ in scheduled]
    used = manager.block_tables(ids)  # [len(ids), the longest table]
    width = min(pages_per_seq, pow2_at_least(used.shape[1], MIN_TABLE_PAGES))
    tables = np.zeros((s, width), np.int32)
    tables[:len(ids), :used.shape[1]] = used
    sampling = dict(temperature=np.zeros((s,), np.float32), top_k=np.zeros((s,), np.int32),
                    top_p=np.ones((s,), np.float32), min_p=np.zeros((s,), np.float32),
                    repetition_penalty=np.ones((s,), np.float32),
                    presence_penalty=np.zeros((s,), np.float32),
                    frequency_penalty=np.zeros((s,), np.float32),
                    seed=np.zeros((s,), np.uint32), step=np.zeros((s,), np.int32))
    extras = _extras(scheduled, s, vocab_size)
    greedy = all(r.params.greedy for r, _ in scheduled)
    penalty = any(r.params.sampling.repetition_penalty not in (None, 1.0) for r, _ in scheduled)
    seen = np.zeros((s, vocab_size), bool) if penalty else None
    feed = np.full((rows,), -1, np.int32)
    at = 0
    for i, (r, n) in enumerate(scheduled):
        start = r.computed
        known = (r.tokens + r.drafts if r.drafts else r.tokens)[start:start + n]
        tokens[at:at + len(known)] = known
        if len(known) < n:  # its last row is the token the step in flight draws
            feed[at + n - 1] = r.pending_index
        positions[at:at + n] = np.arange(start, start + n)
        slots[at:at + n] = manager.slots(r.id, start, start + n)
        at += n
        cu[i + 1], kv[i], last[i] = at, start + n, at - 1
        p = r.params.sampling
        sampling["temperature"][i] = p.temperature
        sampling["top_k"][i] = p.top_k or 0
        sampling["top_p"][i] = 1.0 if p.top_p is None else p.top_p
        sampling["min_p"][i] = p.min_p or 0.0
        sampling["repetition_penalty"][i] = p.repetition_penalty or 1.0
        sampling["presence_penalty"][i] = p.presence_penalty or 0.0
        sampling["frequency_penalty"][i] = p.frequency_penalty or 0.0
        sampling["seed"][i] = r.seed
        sampling["step"][i] = len(r.generated) + r.pending
        if seen is not None:
            seen[i, r.tokens] = True  # (and a fed token, on the device)
    cu[len(scheduled) + 1:] = at
    logprobs = any(r.params.sampling.logprobs is not None for r, _ in scheduled)
    verify = None
    if speculative and any(r.drafts for r, _ in scheduled):
        verify_rows = np.repeat(last[:, None], speculative + 1, axis=1)  # [s, k + 1]
        draft_len = np.zeros((s,), np.int32)
        for i, (r, _) in enumerate(scheduled):
            d = len(r.drafts)
            verify_rows[i, :d + 1] = np.arange(last[i] - d, last[i] + 1)
            draft_len[i] = d
        verify = dict(verify_rows=verify_rows.astype(np.int32), draft_len=draft_len)
        if any(r.drafts and r.mask is not None for r, _ in scheduled):
            verify["masks"] = _verify_masks(scheduled, s, speculative, vocab_size)
            verify["host_drafts"] = np.array(  # (a draft model keeps these sequences' drafts)
                [bool(r.drafts) and r.mask is not None for r, _ in scheduled]
                + [False] * (s - len(scheduled)))
    state = _state(scheduled, cu, s, rows, manager, state_slots)
    return StepBatch(tokens, positions, slots, tables, kv, cu, len(scheduled), last, sampling,
                     seen, greedy, feed, extras, logprobs, verify, state)


def _state(scheduled, cu: np.ndarray, s: int, rows: int, manager: BlockManager,
           state_slots) -> dict | None:
    """:attr:`StepBatch.state` (None when the model keeps no state per sequence): the grid
    is a power of two of sequences (at most ``s``) by a power of two of rows (at most
    ``rows``), as small as holds the step's sequences and its longest one's new rows."""
    slots = None if state_slots is None else state_slots.assign(scheduled, manager)
    if slots is None:
        return None
    seqs = min(s, pow2_at_least(len(scheduled), 1))
    span = min(rows, pow2_at_least(max(n for _, n in scheduled), 1))
    state_slots = np.full((seqs,), -1, np.int32)
    state_slots[:len(slots)] = slots
    segment_rows = np.full((seqs, span), -1, np.int32)
    for i, (_, n) in enumerate(scheduled):
        segment_rows[i, :n] = np.arange(cu[i], cu[i] + n)
    return dict(state_slots=state_slots, segment_rows=segment_rows)


def _verify_masks(scheduled: list[tuple[Request, int]], s: int, k: int,
                  vocab_size: int) -> np.ndarray:
    """The grammar's bitmask at each verify row, int32 ``[s, k + 1, ceil(vocab / 32)]``: a
    constrained sequence's mask after its last token, then after each of its drafts (all
    ones for a free sequence and past the drafts)."""
    masks = np.full((s, k + 1, -(-vocab_size // 32)), -1, np.int32)
    for i, (r, _) in enumerate(scheduled):
        if r.drafts and r.mask is not None:
            masks[i, 0] = r.mask
            masks[i, 1:len(r.drafts) + 1] = r.draft_masks
    return masks


def _extras(scheduled: list[tuple[Request, int]], s: int, vocab_size: int) -> dict:
    """:attr:`StepBatch.extras` of the scheduled requests (host-built, NumPy)."""
    extras = {}
    params = [r.params.sampling for r, _ in scheduled]
    if any(p.needs_token_counts for p in params):
        counts = extras["counts"] = np.zeros((s, vocab_size), np.float32)
        for i, (r, _) in enumerate(scheduled):
            if r.params.sampling.needs_token_counts and r.generated:
                np.add.at(counts[i], np.asarray(r.generated, np.int64), 1.0)
    if any(p.logit_bias for p in params):
        bias = extras["bias"] = np.zeros((s, vocab_size), np.float32)
        for i, p in enumerate(params):
            for token, value in p.logit_bias or ():
                if token < vocab_size:
                    bias[i, token] = value
    if any(r.mask is not None for r, _ in scheduled):
        mask = extras["mask"] = np.full((s, -(-vocab_size // 32)), -1, np.int32)
        for i, (r, _) in enumerate(scheduled):
            if r.mask is not None:
                mask[i] = r.mask
    return extras
