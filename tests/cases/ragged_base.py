"""The behaviours of every kernel implementation of ``fj.ragged_paged_attention``
(:class:`RaggedPagedAttentionCases`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from cases.base import ImplementationCases, parametrize_from
from cases.calls import jit_ragged_paged_attention
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import RAGGED_MIXES, make_step
from cases.references import f64, ragged_paged_attention_ref


class RaggedPagedAttentionCases(ImplementationCases):
    """``fj.ragged_paged_attention`` through ``IMPLEMENTATION`` against the float64 reference
    and the XLA implementation, on steps from :func:`cases.paged.make_step`: every slot no
    query may see holds NaN (page tails, spare pages, slots a window hides from all of a
    sequence's queries), ignored sequences' entries hold garbage, padding rows of ``q`` hold
    NaN.

    ``HEAD_DIM``: the head dim of every case (a kernel's lane width); ``DTYPE``: the dtype of
    the steps outside the case table (float32 unless a kernel takes narrower ones only).
    Case table ``CASES``: ``{id: (mix, heads, dtype, q_dtype, page_size, masking)}``, a mix of
    ``cases.paged.RAGGED_MIXES`` and heads of ``cases.paged.RAGGED_HEADS``.
    """

    HEAD_DIM: int
    DTYPE = jnp.float32
    CASES: dict[str, tuple]

    def ragged(self, *args, **masking):
        return jit_ragged_paged_attention(*args, implementation=self.IMPLEMENTATION, **masking)

    def check(self, step, *, dtype, **masking):
        """The implementation against float64 and XLA; padding rows exactly 0."""
        out = self.ragged(*step.args(), **masking)
        assert out.shape == step.q.shape and out.dtype == step.q.dtype
        assert_close(out, ragged_paged_attention_ref(step, **masking), dtype=dtype,
                     implementation=self.IMPLEMENTATION)
        xla = jit_ragged_paged_attention(*step.args(), implementation="xla", **masking)
        assert_close(out, f64(xla), dtype=dtype, implementation=self.IMPLEMENTATION,
                     allow_zero_ref=True)
        np.testing.assert_array_equal(f64(out)[step.cu_q_lens[step.num_seqs]:], 0.0)
        return out

    @parametrize_from("CASES", "mix,heads,dtype,q_dtype,page_size,masking")
    def test_matches_references(self, mix, heads, dtype, q_dtype, page_size, masking):
        gen = rng(*mix.encode(), page_size)
        window = masking.get("sliding_window")
        step = make_step(gen, **RAGGED_MIXES[mix], page_size=page_size, heads=heads,
                         head_dim=self.HEAD_DIM, dtype=dtype, q_dtype=q_dtype, window=window,
                         attention_chunk_size=masking.get("attention_chunk_size"))
        if mix == "mixed" and window is not None:  # slots no query sees hold NaN
            assert np.isnan(f64(step.k_pages)).sum() > np.isnan(f64(step.k_clean)).sum()
        self.check(step, dtype=q_dtype or dtype, **masking)

    def test_traced_num_seqs_one_compilation_serves_any_mix(self):
        traces = []

        @jax.jit
        def step_fn(*args):
            traces.append(1)
            return fj.ragged_paged_attention(*args, sliding_window=12,
                                             implementation=self.IMPLEMENTATION)

        gen = rng(7)
        shapes = dict(max_seqs=6, total_tokens=24, page_size=8, heads="gqa",
                      head_dim=self.HEAD_DIM, dtype=self.DTYPE, pages_per_seq=6, num_pages=30)
        for q_lens, kv_lens in [([4, 1, 1], [4, 30, 9]), ([1, 1, 7, 1, 5, 1],
                                                          [40, 2, 7, 13, 25, 1])]:
            step = make_step(gen, q_lens, kv_lens, **shapes)
            assert_close(step_fn(*step.args()),
                         ragged_paged_attention_ref(step, sliding_window=12),
                         dtype=self.DTYPE, implementation=self.IMPLEMENTATION)
        step.num_seqs = 0  # nothing scheduled: every row is padding
        np.testing.assert_array_equal(f64(step_fn(*step.args())), 0.0)
        assert len(traces) == 1

    def test_non_finite_visible_value_gives_nan_only_where_seen(self):
        step = make_step(rng(9), q_lens=[3, 2], kv_lens=[3, 5], max_seqs=2, total_tokens=5,
                         page_size=8, heads="gqa", head_dim=self.HEAD_DIM, dtype=self.DTYPE)
        step.v_pages[0, step.block_tables[0, 0], 1, 3] = np.inf  # slot 1 of sequence 0
        nan = ~np.isfinite(f64(self.ragged(*step.args())))
        # Rows 1 and 2 see slot 1 through q heads 0..3 (kv head 0), in column 3 only.
        assert nan[1:3, :4, 3].all()
        nan[1:3, :4, 3] = False
        assert not nan.any()

    def test_out_of_range_values_under_jit_are_safe(self):
        step = make_step(rng(10), q_lens=[2, 3, 1], kv_lens=[9, 12, 5], max_seqs=3,
                         total_tokens=8, page_size=8, heads="gqa", head_dim=self.HEAD_DIM,
                         dtype=self.DTYPE)
        q, k, v, tables, kv, cu, _ = step.args()
        bad = np.array(tables)
        bad[0, :2] = [-5, 1 << 30]  # read nothing: sequence 0 sees no key
        out = self.ragged(q, k, v, bad, kv, cu, np.int32(7))
        assert_close(f64(out)[2:6], ragged_paged_attention_ref(step)[2:6], dtype=self.DTYPE,
                     implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(out)[6:], 0.0)
