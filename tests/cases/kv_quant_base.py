"""The behaviours of every implementation of ``fj.paged_attention`` and
``fj.ragged_paged_attention`` on quantized (int8, fp8) pools (:class:`QuantizedPagedCases`,
:class:`QuantizedRaggedCases`): against float64 references of what the pools' stored parts
stand for, with a NaN scale and random bytes in every slot no query may see."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from cases.base import ImplementationCases, parametrize_from
from cases.calls import jit_paged_attention, jit_ragged_paged_attention
from cases.checks import assert_close
from cases.inputs import rng
from cases.kv_quant import dense_from_pool, quantize_cache, quantized_pool
from cases.paged import RAGGED_MIXES, default_positions, make_step, paged_cache
from cases.references import attention_mask_ref, attention_ref, f64, ragged_paged_attention_ref


class QuantizedPagedCases(ImplementationCases):
    """``fj.paged_attention`` on quantized pools through ``IMPLEMENTATION``.

    Case table ``QUANT_CASES``: ``{id: (case, format)}``, a ``cases.paged_base.PagedCase``
    (its ``dtype`` is the queries'; the pools are ``format``).
    """

    QUANT_CASES: dict[str, tuple]

    @parametrize_from("QUANT_CASES", "case,format")
    def test_quantized_pages_match_float64(self, case, format):
        gen = rng(case.q_heads, case.head_dim, case.page_size, case.q_len or 0, len(format))
        lengths = np.array(case.lengths)
        batch, t = len(lengths), case.q_len or 1
        positions = default_positions(lengths, t)
        cache = paged_cache(gen, lengths, positions=positions, window=case.window,
                            page_size=case.page_size, kv_heads=case.kv_heads,
                            head_dim=case.head_dim, dtype=jnp.float32)
        quant = quantize_cache(gen, cache.k_pages, cache.v_pages, cache.block_tables, lengths,
                               format)
        shape = (batch, t, case.q_heads, case.head_dim)
        q = jnp.asarray(gen.standard_normal(shape if case.q_len else (batch, *shape[2:]))
                        .astype(np.dtype(case.dtype)))
        kw = dict(sliding_window=case.window, logits_soft_cap=case.cap)
        out = jit_paged_attention(q, quant.k_pages, quant.v_pages, cache.block_tables,
                                  jnp.asarray(lengths, jnp.int32),
                                  implementation=self.IMPLEMENTATION, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = attention_ref(f64(q).reshape(shape), quant.dense_k, quant.dense_v,
                            q_positions=positions, kv_lengths=lengths,
                            sliding_window=case.window, logits_soft_cap=case.cap)
        assert_close(out, ref.reshape(q.shape), implementation=self.IMPLEMENTATION,
                     err_msg="against float64 of the dequantized pages")
        seen = attention_mask_ref(batch, t, quant.dense_k.shape[1], q_positions=positions,
                                  kv_lengths=lengths, sliding_window=case.window).any(axis=-1)
        np.testing.assert_array_equal(f64(out).reshape(shape)[~seen], 0.0)


class QuantizedRaggedCases(ImplementationCases):
    """``fj.ragged_paged_attention`` on quantized pools through ``IMPLEMENTATION``.

    ``HEAD_DIM``; case table ``QUANT_RAGGED_CASES``: ``{id: (mix, heads, q_dtype, page_size,
    format)}``, a mix of ``cases.paged.RAGGED_MIXES``.
    """

    HEAD_DIM: int
    QUANT_RAGGED_CASES: dict[str, tuple]

    @parametrize_from("QUANT_RAGGED_CASES", "mix,heads,q_dtype,page_size,format")
    def test_quantized_pages_match_float64(self, mix, heads, q_dtype, page_size, format):
        gen = rng(*mix.encode(), page_size, len(format))
        step = make_step(gen, **RAGGED_MIXES[mix], page_size=page_size, heads=heads,
                         head_dim=self.HEAD_DIM, dtype=np.float32, q_dtype=q_dtype)
        kq, vq = (quantized_pool(gen, x, format) for x in (step.k_pages, step.v_pages))
        n = step.num_seqs
        step = dataclasses.replace(
            step, dense_k=dense_from_pool(kq, step.block_tables[:n], step.kv_lengths[:n]),
            dense_v=dense_from_pool(vq, step.block_tables[:n], step.kv_lengths[:n]))
        args = list(step.args())
        args[1:3] = kq, vq
        out = jit_ragged_paged_attention(*args, implementation=self.IMPLEMENTATION)
        assert out.shape == step.q.shape and out.dtype == step.q.dtype
        assert_close(out, ragged_paged_attention_ref(step), implementation=self.IMPLEMENTATION,
                     err_msg="against float64 of the dequantized pages")
        np.testing.assert_array_equal(f64(out)[step.cu_q_lens[n]:], 0.0)
