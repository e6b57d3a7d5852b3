"""The statistics of one generation call: :class:`GenerationStats` (timings and sizes)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GenerationStats:
    """Timings and sizes of one :func:`generate_with_stats` call.

    Attributes:
      batch: the number of prompts.
      padded_batch, prompt_bucket, cache_len: the bucketed shapes the steps ran with
        (batch padded to a power of two, prompts to
        :func:`~forge_jax.generation.loop.prompt_bucket`'s length, cache length per
        sequence).
      cache: "paged" or "contiguous".
      max_new_tokens: the tokens asked for per prompt (0: nothing ran; 1: the prefill
        gives the only token, so there are no decode steps).
      prompt_tokens: prompt tokens summed over the batch (padding excluded).
      new_tokens: tokens returned, summed over the batch.
      decode_tokens: tokens returned that decode steps produced (the first new token of
        each prompt comes from the prefill).
      decode_steps: decode steps run. With eos ids, one more than needed when
        every sequence stops early (eos is checked one step behind, so the host never
        stalls the device).
      compile_seconds: tracing and compiling both steps (about 0 when cached), and the
        prefill's warm-up run with ``warm_up=True``.
      prefill_seconds: the prefill step, compilation excluded.
      decode_seconds: all decode steps, compilation excluded.
      weight_bytes: the model's parameters as stored (quantized weights with their scales),
        measured from the arrays.
      cache_bytes: the KV cache's keys and values (a quantized cache's scales included),
        measured from the arrays.
      kv_cache_dtype: ``"int8"`` or ``"fp8"`` for a quantized KV cache, else None.
      logprobs: with :attr:`SamplingParams.logprobs` set, each prompt's new tokens as
        :class:`~forge_jax.generation.sampling.TokenLogprob` (their log-probabilities and
        the most likely alternatives), aligned with the returned tokens; else None.
      draft_tokens, accepted_tokens: with speculative decoding, the tokens drafted and
        the drafts the model kept (:attr:`acceptance_rate`, :attr:`tokens_per_step`).
    """

    batch: int
    padded_batch: int
    prompt_bucket: int
    cache_len: int
    cache: str
    max_new_tokens: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    compile_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    weight_bytes: int = 0
    cache_bytes: int = 0
    kv_cache_dtype: str | None = None
    logprobs: list | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens processed per second by the prefill."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second by the decode steps (all sequences together)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept over drafts proposed (speculative decoding; 0 without)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per sequence per decode step, averaged: 1 without speculative decoding,
        up to ``num_tokens + 1`` with it."""
        if not self.decode_steps:
            return 0.0
        return self.decode_tokens / self.decode_steps / max(1, self.batch)

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0
