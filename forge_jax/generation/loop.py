"""The generation loop: a jitted prefill, then jitted decode steps with a donated KV cache
(paged or contiguous), over a batch of prompts of different lengths.

The steps themselves are :func:`forge_jax.generation.steps.prefill_step` and
:func:`~forge_jax.generation.steps.decode_step`; this module checks the arguments, buckets the
shapes, creates the cache, runs the steps and times them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import forge_jax as fj
from forge_jax import memory as fj_memory
from forge_jax.generation import sampling as sampling_lib
from forge_jax.generation import settings
from forge_jax.generation import speculative as speculative_lib
from forge_jax.generation.sampling import SamplingParams
from forge_jax.generation.speculative import SpeculativeConfig
from forge_jax.generation.stats import GenerationStats
from forge_jax.generation.steps import decode_step, prefill_step, seen_tokens, step_statics
from forge_jax.kv_cache import BlockManager, CacheSpec
from forge_jax.models import llama_sharding
from forge_jax.models.llama_model import LlamaConfig
from forge_jax.models.protocol import CausalLM
from forge_jax.ops import kv_quant


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def prompt_bucket(n: int) -> int:
    """The length ``n`` new tokens are padded to for a prefill, so that nearby lengths
    share one compiled :func:`prefill_step`: a power of two up to 64 (at least 8), then a
    multiple of an eighth of the next power of two (four buckets per octave: 80, 96, 112,
    128, 160, ..., 1280, 1536, 1792, 2048, 2560, ...), so that padding adds at most a
    quarter of the work (a 1100-token prompt runs as 1280, not 2048)."""
    if n <= 64:
        return max(8, _next_pow2(n))
    step = _next_pow2(n) // 8
    return -(-n // step) * step


def _check_prompt_array(prompts, vocab_size) -> list[list[int]]:
    """A NumPy or JAX ``[batch, seq]`` integer array of equal-length prompts -> lists."""
    if isinstance(prompts, jax.core.Tracer):
        raise TypeError("prompts must be concrete token ids, not a traced array: generate "
                        "runs its own jitted steps and needs the ids on the host")
    if not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise TypeError(f"prompts must hold integer token ids, got "
                        f"prompts.dtype={np.dtype(prompts.dtype).name}")
    if prompts.ndim != 2:
        hint = " (one prompt: prompts[None])" if prompts.ndim == 1 else ""
        raise ValueError(f"prompts as an array must be [batch, seq], got "
                         f"prompts.shape={tuple(prompts.shape)}{hint}")
    if 0 in prompts.shape:
        raise ValueError(f"prompts must be non-empty, got prompts.shape={tuple(prompts.shape)}")
    ids = np.asarray(prompts)
    lo, hi = int(ids.min()), int(ids.max())  # Python ints: no overflow whatever the dtype
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"prompts has token ids outside [0, {vocab_size}): min {lo}, max {hi}")
    return ids.astype(np.int64).tolist()


def _check_prompts(prompts, vocab_size) -> list[list[int]]:
    if hasattr(prompts, "ndim") and hasattr(prompts, "dtype"):
        return _check_prompt_array(prompts, vocab_size)
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of lists of token ids, got "
                         f"{prompts!r:.80}")
    out = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not (np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"prompts[{i}] must be a non-empty list of ints, got {prompt!r:.80}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): "
                             f"min {ids.min()}, max {ids.max()}")
        out.append([int(x) for x in ids])
    return out


def check_sequence_length(config: LlamaConfig, prompt_tokens: int, max_new_tokens: int, *,
                          allow_beyond_max_positions: bool = False, what: str = "the prompt"
                          ) -> None:
    """Raises ValueError if ``prompt_tokens + max_new_tokens`` exceeds the config's
    ``max_position_embeddings`` (unless ``allow_beyond_max_positions``, for a model whose
    RoPE scaling extends the range). ``what`` names the prompt in the message."""
    total = prompt_tokens + max_new_tokens
    limit = config.max_position_embeddings
    if total > limit and not allow_beyond_max_positions:
        raise ValueError(
            f"{what} has {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} the "
            f"sequence reaches {total} positions, beyond the model's "
            f"max_position_embeddings={limit}. Pass allow_beyond_max_positions=True if its "
            f"RoPE scaling extends the range")


def cache_plan(batch: int, longest_prompt: int, max_new_tokens: int, cache: str,
                page_size: int, batch_multiple: int = 1) -> tuple[int, int, int, int]:
    """(padded batch, prompt bucket, cache length per sequence, pages per sequence).

    The batch is padded to a power of two, then to a multiple of ``batch_multiple`` (the
    data axis of a mesh, so that it splits evenly)."""
    padded_batch = -(-_next_pow2(batch) // batch_multiple) * batch_multiple
    bucket = prompt_bucket(longest_prompt)
    cache_len = _next_pow2(bucket + max_new_tokens)
    max_pages = -(-cache_len // page_size)
    if cache == "paged":
        cache_len = max_pages * page_size
    return padded_batch, bucket, cache_len, max_pages


def check_generation_fits(config: LlamaConfig | CausalLM, *, batch: int, longest_prompt: int,
                          max_new_tokens: int, cache: CacheSpec | None = None,
                          param_dtype=jnp.float32, dtype=jnp.float32, mesh=None,
                          **deprecated) -> None:
    """Raises ``forge_jax.memory.InsufficientMemoryError`` if :func:`generate` with these
    sizes would not fit its KV cache and activations in the device's free memory.

    :func:`generate` runs this check itself; it is public so that a caller can run it
    before building a large batch of prompts (the CLI does, for ``--num-problems``).
    ``config``: a :class:`LlamaConfig`, or a model
    (:class:`~forge_jax.models.protocol.CausalLM`: its ``cache_bytes`` counts its own cache,
    on its own mesh). ``cache``: the :class:`~forge_jax.kv_cache.CacheSpec` (default
    ``CacheSpec()``: paged, 16 tokens a page, in ``dtype``; ``kv_dtype="int8"``/``"fp8"``
    counts a byte per value and a float32 scale per token and KV head). ``mesh`` (a
    :class:`forge_jax.sharding.MeshConfig`, as on a sharded model): count one device's
    share of the cache. The keywords ``page_size``, ``cache_dtype`` and ``kv_cache_dtype``
    (and ``cache`` as a kind's name) are deprecated: they go in the ``CacheSpec``.
    """
    legacy = settings.legacy_keywords("check_generation_fits", deprecated, cache=cache)
    spec = settings.cache_spec("check_generation_fits", cache, legacy)
    model = config if isinstance(config, CausalLM) else None
    if model is not None:
        config, mesh = model.config, model.mesh
    cache, page_size, kv_cache_dtype = spec.kind, spec.page_size, spec.kv_dtype
    cache_dtype = spec.resolved_dtype(dtype)
    padded_batch, prompt_bucket, cache_len, max_pages = cache_plan(
        batch, longest_prompt, max_new_tokens, cache, page_size,
        batch_multiple=1 if mesh is None else mesh.dp)
    if model is not None:
        cache_bytes = model.cache_bytes(
            dataclasses.replace(spec, dtype=cache_dtype), batch=padded_batch,
            max_len=cache_len, num_pages=padded_batch * max_pages)
    else:
        kv_dim = config.num_key_value_heads * config.head_dim
        if mesh is not None:  # one device's KV heads (copies included), and batch rows
            kv_dim = llama_sharding.layout_for(config, mesh.tp).kv_repeat * kv_dim // mesh.tp
            if cache != "paged":
                kv_dim //= mesh.dp
        # A paged pool depends on the bucketed shapes only (so other prompt lengths in the
        # same buckets reuse the compiled steps): room for every row at full length.
        slots = max_pages * page_size if cache == "paged" else cache_len
        cache_bytes = int(2 * config.num_hidden_layers * padded_batch * slots * kv_dim
                          * kv_quant.bytes_per_value(kv_cache_dtype, cache_dtype,
                                                     config.head_dim))
    need = fj_memory.estimate_inference_memory(
        config, batch=padded_batch, max_len=cache_len, prefill_len=prompt_bucket,
        param_dtype=param_dtype, dtype=dtype, cache_dtype=cache_dtype,
        kv_cache_dtype=kv_cache_dtype)
    fj_memory.check_fits(cache_bytes + need.activations,
                         what=f"a {cache} KV cache for {padded_batch} x {cache_len} tokens "
                              f"plus activations")


def default_eos_token_ids(model: CausalLM) -> tuple[int, ...]:
    """The ids :func:`generate` stops at when not given ``eos_token_id``, as transformers'
    ``generate`` chooses them: the model's ``generation_config.json`` ids (read by
    ``from_pretrained``), else its ``config.json`` ``eos_token_id``, else none. The same
    as ``settings.stopping(model.config, model.generation_config).eos_token_ids``, the
    front door every caller asks."""
    return _stopping(model).eos_token_ids


def _stopping(model: CausalLM, *, eos_token_id=None, max_new_tokens=None, longest_prompt=None
              ) -> settings.Stopping:
    return settings.stopping(model.config, getattr(model, "generation_config", None),
                             eos_token_id=eos_token_id, max_new_tokens=max_new_tokens,
                             longest_prompt=longest_prompt)


def generate_with_stats(model: CausalLM, prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
                        max_new_tokens: int | None = None, *,
                        sampling: SamplingParams | None = None, cache: CacheSpec | None = None,
                        eos_token_id: int | Sequence[int] | None = None,
                        allow_beyond_max_positions: bool = False,
                        callbacks: settings.Callbacks | None = None, warm_up: bool = False,
                        speculative: SpeculativeConfig | None = None,
                        **deprecated) -> tuple[list[list[int]], GenerationStats]:
    """:func:`generate`, also returning a :class:`GenerationStats` with the timings.

    ``callbacks`` (:class:`~forge_jax.generation.settings.Callbacks`): ``progress(done,
    total)`` after the prefill and each decode step (e.g. for a progress bar), and
    ``on_tokens(i, tokens)`` with the ``i``-th new token of every prompt as soon as it
    reaches the host (streaming; read one decode step behind the device, as the eos check
    reads them, so it adds no wait per token; a sequence's tokens after its eos are passed
    too, and steps may run past ``max_new_tokens``' useful end by one, as the eos check
    does).

    ``warm_up=True`` runs the compiled prefill once on no tokens before timing it: the
    first run of a compiled step initialises per-executable runtimes (on CPU, ~0.45 s for
    a 30-layer 135M model), which then counts in ``compile_seconds``, not in
    ``prefill_seconds`` (the time to the first token). The CLI uses it; it costs one more
    prefill's time in total.

    ``speculative`` (a :class:`~forge_jax.generation.speculative.SpeculativeConfig`):
    draft ``num_tokens`` tokens per step by prompt lookup and verify them in one step
    (:mod:`forge_jax.generation.speculative`): greedy output is the same, sampled output is
    distributed as without it; the statistics count the drafted and accepted tokens, and
    ``logprobs`` are each kept token's from the model's logits at the row that drew it. It
    takes neither a repetition penalty nor ``on_tokens``, and the cache holds
    ``num_tokens`` more positions (the last step's drafts).

    The other arguments are :func:`generate`'s, and so are its deprecated keywords
    (plus ``progress`` and ``on_tokens``, now in ``callbacks``).
    """
    legacy = settings.legacy_keywords("generate_with_stats", deprecated, sampling=sampling,
                                      cache=cache,
                                      other=dict.fromkeys(("progress", "on_tokens"),
                                                          "callbacks=Callbacks"))
    if legacy.other:
        if callbacks is not None:
            raise TypeError("generate_with_stats() got callbacks= and "
                            f"{', '.join(legacy.other)}=: put them in the Callbacks")
        callbacks = settings.Callbacks(**legacy.other)
    callbacks = callbacks or settings.Callbacks()
    if sampling is None:
        sampling = SamplingParams(**legacy.sampling)
    elif not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, got {sampling!r}")
    _check_engine_only(sampling)
    if speculative is not None:
        speculative_lib.check(speculative, sampling, callbacks, model)
    spec = settings.cache_spec("generate_with_stats", cache, legacy)
    prompts = _check_prompts(prompts, model.config.vocab_size)
    stop = _stopping(model, eos_token_id=eos_token_id, max_new_tokens=max_new_tokens,
                     longest_prompt=max(len(p) for p in prompts))
    # Speculative steps write up to num_tokens positions past the last kept token.
    extra = 0 if speculative is None or not stop.max_new_tokens else speculative.num_tokens
    plan = _plan(model, prompts, stop.max_new_tokens + extra, spec,
                 allow_beyond_max_positions=allow_beyond_max_positions)
    if extra:
        plan = dataclasses.replace(plan, max_new_tokens=stop.max_new_tokens)
    eos = frozenset(stop.eos_token_ids)
    cache_dtype = spec.resolved_dtype(model.dtype)
    stats = GenerationStats(
        batch=plan.batch, padded_batch=plan.padded_batch, prompt_bucket=plan.prompt_bucket,
        cache_len=plan.cache_len, cache=plan.cache, max_new_tokens=plan.max_new_tokens,
        prompt_tokens=int(plan.lengths.sum()), kv_cache_dtype=spec.kv_dtype)
    if plan.max_new_tokens == 0:
        return [[] for _ in plan.prompts], stats

    kv = _create_cache(model, plan, cache_dtype, spec.kv_dtype)
    graphdef, state = nnx.split(model)
    stats.weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(state))
    stats.cache_bytes = kv.nbytes
    inputs = _place_inputs(model, plan, sampling)
    # logprobs=0 still needs the sampled token's: the steps take one alternative at least.
    top = None if sampling.logprobs is None else max(1, sampling.logprobs)
    statics = step_statics(graphdef, sampling.greedy, logprobs=top or 0)

    start = time.perf_counter()
    prefill, decode, kv = _compile_steps(state, kv, inputs, statics, plan, warm_up)
    stats.compile_seconds = time.perf_counter() - start

    tokens, seen, kv, stats.prefill_seconds = _prefill(prefill, state, kv, inputs)
    if callbacks.progress is not None:
        callbacks.progress(1, plan.max_new_tokens)
    if speculative is not None:
        results = speculative_lib.decode(
            state, kv, tokens, plan.prompts, plan.padded_batch, inputs.key, inputs.params,
            limit=plan.max_new_tokens, eos=eos, config=speculative, statics=statics,
            stats=stats, progress=callbacks.progress, logprobs=sampling.logprobs,
            draft=(inputs, lambda m: _create_cache(m, plan, cache_dtype, spec.kv_dtype)))
        stats.new_tokens = sum(len(r) for r in results)
        stats.decode_tokens = stats.new_tokens - plan.batch
        return results, stats

    outputs, stats.decode_steps, stats.decode_seconds = _decode_loop(
        decode, state, kv, tokens, seen, inputs, plan, eos, callbacks)
    if top is not None:  # each step's output is (tokens, its logprobs)
        outputs, logprobs = [o[0] for o in outputs], [o[1] for o in outputs]
    results = _collect(outputs, plan.batch, eos)
    if top is not None:
        stats.logprobs = _collect_logprobs(logprobs, outputs, results, sampling.logprobs)
    stats.new_tokens = sum(len(r) for r in results)
    stats.decode_tokens = stats.new_tokens - plan.batch  # the prefill gave each its first
    return results, stats


# The stages of generate_with_stats, in order.

@dataclasses.dataclass(frozen=True)
class _Plan:
    """A checked :func:`generate` call: its prompts and the bucketed shapes it runs with
    (see :func:`cache_plan`)."""

    prompts: list[list[int]]
    max_new_tokens: int
    cache: str
    page_size: int
    padded_batch: int
    prompt_bucket: int
    cache_len: int
    max_pages: int

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def lengths(self) -> np.ndarray:
        """int32 ``[batch]``, the prompts' lengths."""
        return np.array([len(p) for p in self.prompts], np.int32)


def _plan(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, spec: CacheSpec, *,
          allow_beyond_max_positions) -> _Plan:
    """Checks the lengths (ValueError naming them, before any work) and buckets the
    shapes; the prompts are checked, and ``max_new_tokens`` resolved, before."""
    config = model.config
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    check_sequence_length(config, len(prompts[longest]), max_new_tokens,
                          allow_beyond_max_positions=allow_beyond_max_positions,
                          what=f"prompts[{longest}]")
    mesh = model.mesh  # a forge_jax.sharding.MeshConfig for a sharded model, else None
    shapes = cache_plan(len(prompts), len(prompts[longest]), max_new_tokens, spec.kind,
                        spec.page_size, batch_multiple=1 if mesh is None else mesh.dp)
    return _Plan(prompts, max_new_tokens, spec.kind, spec.page_size, *shapes)


def _create_cache(model: CausalLM, plan: _Plan, cache_dtype, kv_cache_dtype):
    """The model's cache for the plan (:meth:`CausalLM.create_cache`), after checking that it
    fits (on a mesh: created in its shards). A paged cache has each prompt's pages allocated
    up front for its prompt and ``max_new_tokens``; batch padding rows hold none."""
    spec = CacheSpec(plan.cache, plan.page_size, cache_dtype, kv_cache_dtype)
    check_generation_fits(model, batch=plan.batch, longest_prompt=int(plan.lengths.max()),
                          max_new_tokens=plan.max_new_tokens, cache=spec,
                          param_dtype=model.param_dtype, dtype=model.dtype)
    num_pages = plan.padded_batch * plan.max_pages
    sizes = dict(batch=plan.padded_batch, max_len=plan.cache_len, num_pages=num_pages)
    block_tables = None
    if plan.cache == "paged":
        manager = BlockManager(num_pages, plan.page_size)
        for b in range(plan.batch):
            manager.allocate(b, int(plan.lengths[b]) + plan.max_new_tokens)
        block_tables = np.zeros((plan.padded_batch, plan.max_pages), np.int32)
        block_tables[:plan.batch] = manager.block_tables(list(range(plan.batch)),
                                                         plan.max_pages)
    return model.create_cache(spec, **sizes, block_tables=block_tables)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The steps' inputs at the bucketed shapes, on the device (on a mesh: global arrays,
    each device given its slice, which works across processes too)."""

    tokens: jax.Array  # int32 [padded_batch, prompt_bucket], prompts right-padded with 0
    lengths: jax.Array  # int32 [padded_batch]; 0 for batch padding rows (never written)
    no_lengths: jax.Array  # int32 [padded_batch] zeros: the warm-up writes no token
    active: jax.Array  # bool [padded_batch]: the rows that are prompts
    seen: jax.Array  # bool [padded_batch, vocab]: the repetition penalty's memory
    params: dict[str, jax.Array]  # SamplingParams.arrays(): arguments, so no recompile
    key: jax.Array
    first: jax.Array  # int32 [padded_batch], shaped like the tokens the prefill samples
    step: Callable[[int], jax.Array]  # a decode step's number, as the steps take it


def _place_inputs(model: CausalLM, plan: _Plan, sampling: SamplingParams) -> _Inputs:
    """The padded inputs: prompts right-padded with token 0 and extra batch rows of
    length 0 (neither is written to the cache), put on the device or the mesh."""
    mesh, seed = model.mesh, sampling.seed
    tokens = np.zeros((plan.padded_batch, plan.prompt_bucket), np.int32)
    for b, p in enumerate(plan.prompts):
        tokens[b, :len(p)] = p
    lengths = np.zeros((plan.padded_batch,), np.int32)
    lengths[:plan.batch] = plan.lengths
    active = np.arange(plan.padded_batch) < plan.batch
    params = {name: np.asarray(value) for name, value in sampling.arrays().items()}
    seen = seen_tokens(plan.prompts, plan.padded_batch, model.config.vocab_size)
    no_lengths = np.zeros_like(lengths)
    if mesh is None:
        tokens, lengths, no_lengths, active, seen = map(
            jnp.asarray, (tokens, lengths, no_lengths, active, seen))
        return _Inputs(tokens, lengths, no_lengths, active, seen,
                       {name: jnp.asarray(value) for name, value in params.items()},
                       key=jax.random.key(seed), first=tokens[:, 0],
                       step=lambda value: jnp.asarray(value, jnp.int32))
    rows = mesh.batch_axis(plan.padded_batch)
    key = jax.random.wrap_key_data(fj.sharding.put(
        np.asarray(jax.random.key_data(jax.random.key(seed))), mesh.replicated()))
    lengths, no_lengths, active = (fj.sharding.put(a, mesh.sharding(rows))
                                   for a in (lengths, no_lengths, active))
    return _Inputs(fj.sharding.put(tokens, mesh.sharding(rows, None)), lengths, no_lengths,
                   active, fj.sharding.put(seen, mesh.replicated()),
                   {name: fj.sharding.put(value, mesh.replicated())
                    for name, value in params.items()},
                   key=key,
                   first=fj.sharding.put(np.zeros(plan.padded_batch, np.int32),
                                         mesh.replicated()),
                   step=lambda value: fj.sharding.put(np.int32(value), mesh.replicated()))


def _compile_steps(state, kv, inputs: _Inputs, statics: dict, plan: _Plan, warm_up: bool):
    """The compiled prefill and decode steps (the decode step None when the prefill gives
    the only token), compiled ahead of time (cached by jit after the first call) so that
    the timings measure the steps alone. Returns ``(prefill, decode, kv)``."""
    # The cache is new: the prompts attend to themselves, not to its whole capacity.
    prefill = prefill_step.compiled(state, kv, inputs.tokens, inputs.lengths, inputs.key,
                                    inputs.params, inputs.seen, **statics, empty_cache=True)
    decode = None
    if plan.max_new_tokens > 1:
        # The decode step takes the tokens the previous step sampled: shaped like `first`.
        decode = decode_step.compiled(state, kv, inputs.first, inputs.active, inputs.key,
                                      inputs.step(1), inputs.params, inputs.seen, **statics)
    if warm_up:
        # A compiled step's first run builds its CPU matmul runtimes (XLA's YNNPACK
        # fusions, a few ms per matmul: ~0.45 s for a 30-layer model's prefill, ten decode
        # steps' time). A run on no tokens (nothing written, the cache unchanged) pays it
        # here, so that the prefill after it, the time to the first token, is the work alone.
        warm, _, kv, *_ = prefill(state, kv, inputs.tokens, inputs.no_lengths, inputs.key,
                                  inputs.params, inputs.seen)
        warm.block_until_ready()
    return prefill, decode, kv


def _prefill(prefill, state, kv, inputs: _Inputs):
    """Runs the compiled prefill; returns ``(tokens, seen, kv, seconds)``: each row's first
    new token (with logprobs, ``(tokens, logprobs)``), ``seen`` with it, the cache, and the
    time until the tokens were ready."""
    start = time.perf_counter()
    tokens, seen, kv, *logprobs = prefill(state, kv, inputs.tokens, inputs.lengths,
                                          inputs.key, inputs.params, inputs.seen)
    jax.block_until_ready(tokens)
    return (tokens, *logprobs) if logprobs else tokens, seen, kv, time.perf_counter() - start


def _check_engine_only(sampling: SamplingParams) -> None:
    """ValueError for the settings that only the serving engine applies."""
    engine_only = [name for name in ("presence_penalty", "frequency_penalty", "logit_bias",
                                     "constraint") if getattr(sampling, name)]
    if engine_only:
        raise ValueError(f"generate does not apply {', '.join(engine_only)} (given in "
                         f"sampling); the serving engine does: forge_jax.serving.Engine")


def _collect_logprobs(logprobs: list, outputs: list, results: list[list[int]], k: int
                      ) -> list[list[sampling_lib.TokenLogprob]]:
    """Each prompt's :class:`TokenLogprob` per returned token, from the steps' outputs."""
    host = [dict(jax.device_get(lp), tokens=np.asarray(t)) for lp, t in zip(
        logprobs, outputs, strict=True)]
    return [[sampling_lib.host_logprobs(host[i], b, k) for i in range(len(row))]
            for b, row in enumerate(results)]


def _decode_loop(decode, state, kv, tokens, seen, inputs: _Inputs, plan: _Plan,
                 eos: frozenset[int], callbacks: settings.Callbacks
                 ) -> tuple[list, int, float]:
    """The decode steps after the prefill's ``tokens``, until ``max_new_tokens`` or every
    sequence has generated an eos. Returns ``(outputs, steps, seconds)``: each step's
    tokens (the prefill's first; with logprobs, ``(tokens, logprobs)`` pairs), the decode
    steps run and their time."""
    batch = plan.batch
    with_logprobs = isinstance(tokens, tuple)
    if with_logprobs:
        outputs, tokens = [tokens], tokens[0]
    progress, on_tokens = callbacks.progress, callbacks.on_tokens
    if not with_logprobs:
        outputs = [tokens]
    done = np.zeros((batch,), bool)
    eos_ids = np.asarray(sorted(eos), np.int32)
    read = bool(eos) or on_tokens is not None  # the host needs each step's tokens

    def arrived(i, tokens):  # the i-th new tokens reached the host
        host = np.asarray(tokens)[:batch]
        if eos:
            done[:] |= np.isin(host, eos_ids)
        if on_tokens is not None:
            on_tokens(i, host)

    if read:
        arrived(0, tokens)
    unchecked = None  # (i, the latest tokens not yet read on the host)
    steps = 0
    start = time.perf_counter()
    for step in range(1, plan.max_new_tokens):
        if done.all():
            break
        tokens, seen, kv, *logprobs = decode(state, kv, tokens, inputs.active, inputs.key,
                                             inputs.step(step), inputs.params, seen)
        outputs.append((tokens, *logprobs) if with_logprobs else tokens)
        steps += 1
        if read:
            # Stopping early and streaming need the tokens on the host. Reading the
            # previous step's while this one is queued keeps the device busy; the cost is
            # at most one step past the last eos, whose tokens are cut off by _collect.
            if unchecked is not None:
                arrived(*unchecked)
            unchecked = (step, tokens)
        if progress is not None:
            progress(step + 1, plan.max_new_tokens)
    if unchecked is not None and on_tokens is not None:
        on_tokens(unchecked[0], np.asarray(unchecked[1])[:batch])
    jax.block_until_ready(outputs)
    return outputs, steps, time.perf_counter() - start if steps else 0.0


def _collect(outputs: list, batch: int, eos: frozenset[int]) -> list[list[int]]:
    """Each prompt's new tokens from the steps' outputs, cut after its first eos."""
    generated = np.stack([np.asarray(t) for t in outputs], axis=1)[:batch]  # [batch, steps]
    results = []
    for row in generated:
        row = [int(t) for t in row]
        for i, t in enumerate(row):
            if t in eos:
                row = row[:i + 1]
                break
        results.append(row)
    return results


def generate(model: CausalLM, prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
             max_new_tokens: int | None = None, *, sampling: SamplingParams | None = None,
             cache: CacheSpec | None = None, eos_token_id: int | Sequence[int] | None = None,
             allow_beyond_max_positions: bool = False, **deprecated) -> list[list[int]]:
    """Generates continuations of a batch of prompts of different lengths.

    Runs one jitted prefill over the right-padded prompts, then jitted decode steps of
    one token per sequence, each with the KV cache donated (updated in place). The
    model is split with ``nnx.split`` outside the steps and merged inside, so the
    weights are arguments of the compiled steps, not constants. Shapes are bucketed
    (batch to a power of two, prompt length to :func:`prompt_bucket`'s, cache length to a
    power of two) so that a later call with similar shapes reuses the compiled steps.

    Args:
      model: a :class:`~forge_jax.models.protocol.CausalLM` (a ``Llama``, ``DeepseekV3``, ...).
      prompts: a list of token-id lists (each non-empty, ids in ``[0, vocab_size)``), or a
        NumPy or JAX integer array ``[batch, seq]`` of equal-length prompts.
      max_new_tokens: tokens to generate per prompt (>= 0). None: the model's
        ``generation_config.json``'s, else 256 capped at the positions left after the
        longest prompt (:func:`forge_jax.generation.settings.stopping`).
      sampling: a :class:`~forge_jax.generation.SamplingParams` (temperature, top-k,
        top-p, min-p, repetition penalty, seed), used as given; None: greedy decoding
        (``SamplingParams()``). Every setting but greedy-or-not is a traced argument of
        the compiled steps: changing its value does not recompile. A temperature below
        float32's smallest normal number (~1.18e-38) is greedy too.
      cache: a :class:`~forge_jax.kv_cache.CacheSpec`; None: ``CacheSpec()``, a paged
        cache of 16-token pages (allocated with ``forge_jax.kv_cache.BlockManager`` for
        prompt + ``max_new_tokens`` up front) in the model's compute dtype.
        ``CacheSpec(kind="contiguous")`` gives the same greedy tokens;
        ``CacheSpec(kv_dtype="int8")`` (or ``"fp8"``, e4m3) quantizes it, a scale per
        token and KV head (:mod:`forge_jax.ops.kv_quant`): about half a bfloat16 cache's
        bytes, a quarter of a float32 one's.
      eos_token_id: an id or a collection of ids; a sequence stops after generating one
        of them, and the eos token *is included* in its output (as transformers'
        ``generate`` returns it). None (the default): the model's own, as transformers
        picks them (``generation_config.json``'s, else ``config.json``'s, else none;
        :func:`forge_jax.generation.settings.stopping`). ``()``: no stopping, always
        ``max_new_tokens`` tokens.
      allow_beyond_max_positions: run prompts whose length plus ``max_new_tokens``
        exceeds ``config.max_position_embeddings`` (for a model whose RoPE scaling
        extends the range); otherwise they raise ValueError before any work.
      **deprecated: the loose keywords of earlier releases, accepted with a
        ``DeprecationWarning`` until the next: ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``seed`` (now in ``sampling``), ``page_size``,
        ``cache_dtype``, ``kv_cache_dtype`` and ``cache="paged"``/``"contiguous"`` (now in
        ``cache``).

    Returns:
      For each prompt, the list of new token ids (the prompt not included).

    Raises:
      ValueError: bad prompts or arguments, or a sequence longer than
        ``config.max_position_embeddings``.
      TypeError: a prompt array of a non-integer dtype.
      forge_jax.memory.InsufficientMemoryError: the KV cache and activations would not fit
        in the device's free memory.

    See :func:`generate_with_stats` for the same call with timings (prefill and decode
    tokens/s), a progress callback and streaming.
    """
    legacy = settings.legacy_keywords("generate", deprecated, sampling=sampling, cache=cache)
    if sampling is None and legacy.sampling:
        sampling = SamplingParams(**legacy.sampling)
    cache = settings.cache_spec("generate", cache, legacy)
    return generate_with_stats(model, prompts, max_new_tokens, sampling=sampling, cache=cache,
                               eos_token_id=eos_token_id,
                               allow_beyond_max_positions=allow_beyond_max_positions)[0]
