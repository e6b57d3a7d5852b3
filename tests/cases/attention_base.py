"""The behaviours of every implementation of ``fj.attention`` (:class:`AttentionCases`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from cases.base import ImplementationCases, parametrize_from
from cases.calls import as_jnp, jit_attention
from cases.checks import assert_close, assert_nonfinite_exactly
from cases.inputs import normal, poison_per_query, poison_unseen, random_qkv, rng
from cases.references import attention_grads_ref, attention_mask_ref, attention_ref, f64


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One call of ``fj.attention`` on random ``q, k, v`` (:func:`cases.inputs.random_qkv`).

    Attributes:
      shape: ``(batch, q_len, kv_len, q_heads, kv_heads, head_dim)``.
      dtype: of ``q``, ``k`` and ``v``.
      masking: fj.attention's keywords (positions and lengths as NumPy arrays).
      poison: NaN / +inf in every key and value slot no query of its sequence sees.
      seed: of the inputs.
      nans_as_xla: (test_nonfinite_...) the output is NaN exactly where XLA's is.
      grad_xla_factor: (test_gradients) the gradients agree with XLA's within this multiple
        of the tolerance; None: not compared (only with the float64 reference).
    """

    shape: tuple[int, int, int, int, int, int]
    dtype: Any
    masking: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    poison: bool = False
    seed: int = 0
    nans_as_xla: bool = False
    grad_xla_factor: float | None = 4.0

    def inputs(self):
        q, k, v = random_qkv(self.seed, *self.shape, self.dtype)
        mask = attention_mask_ref(*self.shape[:3], **self.masking)
        return q, k, v, mask


def one_kv_head(heads: tuple[int, int, int]) -> tuple[int, int, int]:
    """A model's ``(q_heads, kv_heads, head_dim)`` cut to one kv head: its GQA group, 1 and
    its head_dim (programs of different kv heads share nothing but the grid)."""
    return heads[0] // heads[1], 1, heads[2]


def mosaic_nan_unseen_cases(smollm2_heads, llama3_heads) -> dict[str, AttentionCase]:
    """The cases every Mosaic GPU flash kernel runs first, NaN / +inf in every slot no
    query sees: SmolLM2's group with every option, and Llama 3's with lengths and explicit
    positions where query 0 sees no key (exact zeros) and query 2 all 66 valid keys."""
    bf16, f16 = jnp.bfloat16, jnp.float16
    return {
        "smollm2-everything-nan_unseen": AttentionCase(
            (1, 5, 150, *one_kv_head(smollm2_heads)), bf16,
            dict(kv_lengths=np.array([141]), sliding_window=40, logits_soft_cap=5.0,
                 q_positions=np.array([[60, 61, 100, 139, 140]])), poison=True, seed=1),
        "llama3-kv_lengths-positions-nan_unseen": AttentionCase(
            (1, 3, 70, *one_kv_head(llama3_heads)), f16,
            dict(kv_lengths=np.array([66]), q_positions=np.array([[-1, 20, 65]])),
            poison=True, seed=2),
    }


class AttentionCases(ImplementationCases):
    """``fj.attention`` through ``IMPLEMENTATION`` against the float64 reference
    (:func:`cases.references.attention_ref`) and the XLA implementation.

    Case tables (``{id: AttentionCase}``):
      CASES: shapes (real models' heads, MHA/GQA/MQA), dtypes, every masking option, decode,
        NaN in the slots no query sees.
      NONFINITE_CASES: chunked prefill with NaN / inf in slots that some queries of a
        sequence see and others do not, and a +inf logit.
      GRADIENT_CASES: the VJP.
    """

    CASES: dict[str, AttentionCase]
    NONFINITE_CASES: dict[str, AttentionCase]
    GRADIENT_CASES: dict[str, AttentionCase]

    def attention(self, q, k, v, implementation=None, **masking):
        return jit_attention(q, k, v, implementation=implementation or self.IMPLEMENTATION,
                             **as_jnp(masking))

    @parametrize_from("CASES")
    def test_matches_reference_and_xla(self, case):
        q, k, v, mask = case.inputs()
        if case.poison:
            k, v = poison_unseen(k, v, mask)
        out = self.attention(q, k, v, **case.masking)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert_close(out, attention_ref(q, k, v, **case.masking),
                     implementation=self.IMPLEMENTATION, err_msg="against float64")
        xla = self.attention(q, k, v, implementation="xla", **case.masking)
        assert_close(out, f64(xla), implementation=self.IMPLEMENTATION, factor=2.0,
                     err_msg="against XLA")
        # A query that sees no key gives exact zeros.
        np.testing.assert_array_equal(f64(out)[~mask.any(-1)], 0.0)

    @parametrize_from("NONFINITE_CASES")
    def test_nonfinite_reaches_only_the_queries_that_see_it(self, case):
        # Chunked prefill: the slots some queries of a sequence see and others do not hold
        # NaN/inf; each query's output is its float64 result on clean data, or NaN /
        # non-finite exactly where it sees a NaN / inf (or has a +inf logit).
        q, k, v, mask = case.inputs()
        ref = attention_ref(q, k, v, **case.masking)
        if case.poison:
            k, v = poison_unseen(k, v, mask)
        q, k, v, must_nan, must_inf = poison_per_query(q, k, v, mask, seed=case.seed)
        out = self.attention(q, k, v, **case.masking)
        assert_nonfinite_exactly(out, ref, must_nan, must_inf, dtype=case.dtype,
                                 implementation=self.IMPLEMENTATION)
        if case.nans_as_xla:
            xla = f64(self.attention(q, k, v, implementation="xla", **case.masking))
            np.testing.assert_array_equal(np.isnan(f64(out)), np.isnan(xla))

    @parametrize_from("GRADIENT_CASES")
    def test_gradients(self, case):
        q, k, v, mask = case.inputs()
        g = normal(rng(case.seed, 1), q.shape, jnp.float32)
        want64 = attention_grads_ref(q, k, v, g, **case.masking)
        if case.poison:
            k, v = poison_unseen(k, v, mask)

        masking = as_jnp({n: x for n, x in case.masking.items() if n != "sinks"})
        sinks = case.masking.get("sinks")  # with sinks, their gradient too
        names = "qkv" if sinks is None else ("q", "k", "v", "sinks")

        def grads(implementation):
            def loss(q, k, v, sinks):
                out = fj.attention(q, k, v, implementation=implementation, sinks=sinks,
                                   **masking)
                return jnp.sum(out.astype(jnp.float32) * g)
            return jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(q, k, v, sinks)

        got = grads(self.IMPLEMENTATION)
        for name, a, want in zip(names, got, want64, strict=True):
            assert_close(a, want, implementation=self.IMPLEMENTATION, factor=4.0,
                         err_msg=f"d{name} against float64")
        if case.grad_xla_factor is not None:
            for name, a, x in zip(names, got, grads("xla"), strict=True):
                assert_close(a, f64(x), implementation=self.IMPLEMENTATION,
                             factor=case.grad_xla_factor, err_msg=f"d{name} against XLA")
