"""The Pallas TPU (Mosaic) paged-attention kernel (pallas_kernels/tpu/paged_attention.py).

JAX's tests/pallas pattern: :class:`TestPagedAttentionPallasTpu` runs the kernel compiled on a
TPU (``"pallas"``, skipped without one); :class:`TestPagedAttentionPallasTpuInterpret` runs the
same cases in the TPU interpreter on any machine (race detection, NaN-poisoned uninitialised
memory, so an output the kernel never writes fails the finiteness checks). The behaviours
come from :class:`cases.paged_base.PagedAttentionCases`, with the cases Mosaic's layouts
accept (head_dim 128, pages of 16 slots). Lowering tests run the real Pallas -> Mosaic
lowering for TPU on this machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasTpu
from cases.calls import case_id
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import (
    default_positions,
    lowered_paged_attention,
    paged_attention_args,
    paged_attention_specs,
    paged_cache,
)
from cases.paged_base import PagedAttentionCases, PagedCase
from cases.references import attention_ref, f64
from cases.shapes import GEMMA4_HEADS, LLAMA3_8B_HEADS, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax import _compat
from forge_jax.ops import kv_fold
from forge_jax.pallas_kernels.tpu import paged_attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

CASES = {
    # Llama-3-8B heads, bfloat16 decode; lengths 0 and 1, one ending inside a page.
    "llama3_8b-bf16-decode": PagedCase(*LLAMA3_8B_HEADS, 16, None, BF16, (0, 1, 37, 64)),
    # SmolLM2's 9/3 heads of 64 (once rejected as head_dim % 128; libtpu compiles it).
    "smollm2-bf16-decode": PagedCase(*SMOLLM2_135M_HEADS, 16, None, BF16, (5, 40, 64)),
    # 8/2 heads, float32 decode with a window and a soft cap.
    "8q2kv-f32-decode-window-cap": PagedCase(8, 2, 128, 16, None, F32, (50, 3, 17), window=20,
                                             cap=5.0),
    # A bfloat16 cache with float32 queries, three new tokens, a window.
    "bf16_cache-f32_q-prefill-window": PagedCase(8, 2, 128, 16, 3, BF16, (33, 2, 20),
                                                 q_dtype=F32, window=9),
}

# Sinks and chunks at gpt-oss's (64 / 8 heads of 64) and Llama 4's (40 / 8 of 128) heads;
# every slot outside a query's chunk holds NaN / inf.
CASES |= {
    "gptoss-bf16-decode-sinks-window": PagedCase(64, 8, 64, 16, None, BF16, (5, 40, 64),
                                                 window=24, sinks=True),
    "llama4-bf16-decode-chunk": PagedCase(40, 8, 128, 16, None, BF16, (5, 40, 64), chunk=16),
    "llama4-f32-prefill-chunk-sinks-cap": PagedCase(40, 8, 128, 16, 5, F32, (37, 9, 50),
                                                    chunk=16, sinks=True, cap=5.0),
    # Gemma 4's KV cache width (head_dim 512, 8 / 4 heads): decode and 5 new tokens.
    "gemma4-512-bf16-decode-window": PagedCase(*GEMMA4_HEADS, 16, None, BF16, (3, 40, 21),
                                               window=24),
    "gemma4-512-f32-prefill": PagedCase(*GEMMA4_HEADS, 16, 5, F32, (9, 30)),
}

NONFINITE_CASES = {
    "chunk-sinks-f32": PagedCase(4, 2, 128, 16, 3, F32, (30, 9, 18), chunk=8, sinks=True),
    # Three new tokens with a window.
    "window-f32": PagedCase(4, 2, 128, 16, 3, F32, (30, 9, 2), window=5),
}


class TestPagedAttentionPallasTpu(PallasTpu, PagedAttentionCases):
    """The kernel compiled for the TPU (skipped without one)."""

    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = CASES
    NONFINITE_CASES = NONFINITE_CASES


class TestPagedAttentionPallasTpuInterpret(TestPagedAttentionPallasTpu):
    """The same kernel in the TPU interpreter, on any machine."""

    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


def test_small_blocks_double_buffer_over_many_blocks():
    """One page per compute block: the double-buffered copies alternate over up to seven
    blocks, the first ones skipped by the window; explicit positions, one seeing nothing."""
    gen = rng(9)
    lengths = np.array([100, 4, 50])
    positions = default_positions(lengths, 1) - np.array([[0], [0], [60]])
    cache = paged_cache(gen, lengths, positions=positions, window=40, page_size=16,
                        kv_heads=2, head_dim=128, dtype=F32)
    q = jnp.asarray(gen.standard_normal((3, 8, 128)), F32)
    run = jax.jit(lambda *a, p: kernel.paged_attention(
        *a, q_positions=p, sliding_window=40, pages_per_compute_block=1, interpret=True))
    out = run(q, cache.k_pages, cache.v_pages, cache.block_tables,
              jnp.asarray(lengths, jnp.int32), p=jnp.asarray(positions[:, 0]))
    ref = attention_ref(f64(q)[:, None], cache.dense_k, cache.dense_v, q_positions=positions,
                        kv_lengths=lengths, sliding_window=40)[:, 0]
    assert_close(out, ref, implementation="pallas_tpu_interpret")
    np.testing.assert_array_equal(f64(out)[2], 0.0)  # position -10 sees nothing


# --- lowering for TPU and supports() -------------------------------------------------------

S = jax.ShapeDtypeStruct


LOWERED = [  # (q_heads, kv_heads, head_dim, page_size, q_len, dtype, q_dtype)
    (32, 8, 128, 16, None, BF16, None), (8, 2, 128, 16, 16, BF16, None),
    (8, 2, 128, 8, None, F32, None), (8, 2, 256, 32, 3, F32, BF16),
    (8, 1, 128, 16, None, BF16, F32), (16, 16, 128, 64, 2, F32, None),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: "-".join(map(case_id, c)))
@pytest.mark.parametrize("masking", [{}, dict(sliding_window=7, logits_soft_cap=30.0)],
                         ids=["plain", "window_cap"])
def test_accepted_cases_lower_for_tpu(case, masking):
    text = lowered_paged_attention(kernel, case, masking, _compat.export_for_tpu)
    assert "forge_jax_tpu_paged_attention" in text and "tpu_custom_call" in text


@pytest.mark.parametrize("shapes,match", [
    (paged_attention_specs(8, 2, 128, 16, 17, BF16), "q_len=17 > 16"),
    (paged_attention_specs(8, 2, 128, 8, None, BF16), "page_size=8 is not a multiple of 16"),
    (paged_attention_specs(8, 2, 128, 12, None, F32), "page_size=12 is not a multiple of 8"),
    (paged_attention_specs(8, 2, 128, 16, None, F16, F32), "k_pages.dtype=float16"),
    (paged_attention_specs(8, 2, 128, 16, None, F32, F16), "q.dtype=float16"),
], ids=["q_len", "page_bf16", "page_f32", "pages_f16", "q_f16"])
def test_supports_rejects_with_reason(shapes, match):
    # The page_size rejections follow Mosaic's (8, 128) layout rules, enforced by
    # libtpu's compiler; the CPU-side lowering of export_for_tpu accepts those shapes, so
    # these rejections cannot be shown failing here (see the kernel's module docstring).
    assert match in (kernel.supports(paged_attention_args(shapes)) or "")


def test_dispatch_names_the_rejection():
    q = jnp.ones((1, 4, 128), F32)
    pool = jnp.ones((2, 4, 12, 128), F32)
    with pytest.raises(fj.ImplementationError, match="page_size=12"):
        fj.paged_attention(q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                           jnp.ones((1,), jnp.int32), implementation="pallas_tpu_interpret")


def test_tuning_table():
    assert set(kernel.TUNED) >= {"TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "default"}
    assert kernel.default_pages_per_compute_block(16, 64, "TPU v6 lite") == 32
    assert kernel.default_pages_per_compute_block(16, 4, None) == 4  # at most the table width
    assert kernel.default_pages_per_compute_block(1024, 4, "unknown") == 1


# --- folded pools (forge_jax/ops/kv_fold.py): 128-lane rows of 128 // head_dim tokens ------

FOLDED = [  # (q_heads, kv_heads, head_dim, page_size, q_len, dtype, window, pages per block)
    (9, 3, 64, 16, None, BF16, None, None),  # SmolLM2's decode
    (8, 2, 64, 16, None, F32, 20, 1),  # double-buffered blocks of one page, a window
    (8, 2, 64, 16, 3, F32, 9, None),  # three new tokens: hidden slots inside the copied range
    (4, 1, 32, 32, 2, F32, None, 2),  # four tokens per row
]


@pytest.mark.parametrize("case", FOLDED, ids=lambda c: "-".join(map(case_id, c)))
def test_folded_pools_are_read_in_place(case):
    """The kernel on folded pools (``fold=``) against float64, NaN and inf in every slot no
    query sees (before a window, past a length, the tail of a page, unowned pages)."""
    q_heads, kv_heads, head_dim, page_size, q_len, dtype, window, per_block = case
    gen = rng(11)
    lengths = np.array([37, 3, 64])
    positions = default_positions(lengths, q_len or 1)
    cache = paged_cache(gen, lengths, positions=positions, window=window, page_size=page_size,
                        kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    q = jnp.asarray(gen.standard_normal((3, q_len or 1, q_heads, head_dim)), dtype)
    k, v = kv_fold.fold(cache.k_pages), kv_fold.fold(cache.v_pages)
    assert kernel.supports(dict(q=q, k_pages=k.data, fold=k.fold)) is None
    ref = attention_ref(f64(q), cache.dense_k, cache.dense_v, q_positions=positions,
                        kv_lengths=lengths, sliding_window=window)
    tables, n = cache.block_tables, jnp.asarray(lengths, jnp.int32)
    q = q if q_len else q[:, 0]
    if per_block is None:  # through the op: dispatch hands the kernel the folded pools
        out = fj.paged_attention(q, k, v, tables, n, sliding_window=window,
                                 implementation="pallas_tpu_interpret")
    else:
        out = jax.jit(lambda q, k, v, t, n: kernel.paged_attention(
            q, k, v, t, n, fold=k.shape[3] // head_dim, sliding_window=window,
            pages_per_compute_block=per_block, interpret=True))(q, k.data, v.data, tables, n)
    assert_close(out if q_len else out[:, None], ref, implementation="pallas_tpu_interpret")


def test_folded_pages_of_fewer_than_8_rows_are_rejected():
    q = S((2, 8, 64), BF16)
    assert "folded is 4 rows of 2 tokens" in kernel.supports(
        dict(q=q, k_pages=S((2, 8, 4, 128), BF16), fold=2))
    assert kernel.supports(dict(q=q, k_pages=S((2, 8, 8, 128), BF16), fold=2)) is None


def test_folded_pools_lower_for_tpu():
    q, pool = S((3, 2, 8, 64), BF16), S((2, 16, 8, 128), BF16)
    exported = _compat.export_for_tpu(
        lambda q, k, v, t, n: kernel.paged_attention(q, k, v, t, n, fold=2, sliding_window=7),
        q, pool, pool, S((3, 4), jnp.int32), S((3,), jnp.int32))
    assert "forge_jax_tpu_paged_attention" in exported.mlir_module()
