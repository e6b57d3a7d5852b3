"""The Pallas GPU paged-attention kernel (flash-decoding, pallas_kernels/gpu/paged_attention.py).

JAX's tests/pallas pattern: :class:`TestPagedAttentionPallasGpu` runs the kernel compiled on a
GPU (``"pallas"``, skipped without one); :class:`TestPagedAttentionPallasGpuInterpret` runs the
same cases in Pallas' interpreter on any machine. The behaviours (float64 reference and XLA,
NaN / +-inf in every cache slot no query may see, huge integers in unused block-table
entries, per-query NaN/inf) come from :class:`cases.paged_base.PagedAttentionCases`. The
interpreter allocates kernel outputs filled with NaN, so an output the kernel never writes
fails the finiteness checks. Lowering tests run the real Pallas -> Triton lowering for CUDA
on this machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasGpu
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
from cases.shapes import GEMMA4_HEADS, LLAMA3_8B_HEADS, PHI2_HEAD_DIM, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import paged_attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

CASES = {
    # Llama-3-8B heads, bfloat16 decode; long enough for several splits.
    "llama3_8b-bf16-decode": PagedCase(*LLAMA3_8B_HEADS, 16, None, BF16, (0, 1, 37, 150)),
    # SmolLM-style 9/3 heads, float16 chunked prefill with a window.
    "smollm-f16-prefill-window": PagedCase(*SMOLLM2_135M_HEADS, 8, 4, F16, (1, 13, 40, 3),
                                           window=6),
    # 9/3 heads at head_dim 80 (padded to 128): soft cap, explicit positions with padding.
    "9q3kv-d80-f32-cap-positions": PagedCase(9, 3, PHI2_HEAD_DIM, 16, 3, F32, (20, 5, 64),
                                             cap=20.0, explicit_positions=True),
    # A bfloat16 cache with float32 queries, window and cap together.
    "bf16_cache-f32_q-window-cap": PagedCase(32, 8, 64, 8, 2, BF16, (70, 2, 17), q_dtype=F32,
                                             window=9, cap=5.0),
    # MQA, 16 new tokens: 8 * 16 rows in two row blocks.
    "mqa-f32-16_tokens": PagedCase(8, 1, 64, 8, 16, F32, (16, 33, 90)),
}

# Sinks and chunks at gpt-oss's (64 / 8 heads of 64) and Llama 4's (40 / 8 of 128) heads;
# every slot outside a query's chunk holds NaN / inf.
CASES |= {
    "gptoss-bf16-decode-sinks-window": PagedCase(64, 8, 64, 16, None, BF16, (5, 40, 150),
                                                 window=24, sinks=True),
    "llama4-bf16-decode-chunk": PagedCase(40, 8, 128, 16, None, BF16, (0, 40, 150), chunk=32),
    "llama4-f32-prefill-chunk-sinks-cap": PagedCase(40, 8, 128, 16, 5, F32, (37, 9, 50),
                                                    chunk=16, sinks=True, cap=5.0),
    # Gemma 4's KV cache width (head_dim 512, 8 / 4 heads): decode and 5 new tokens.
    "gemma4-512-bf16-decode-window": PagedCase(*GEMMA4_HEADS, 16, None, BF16, (3, 40, 21),
                                               window=24),
    "gemma4-512-f32-prefill": PagedCase(*GEMMA4_HEADS, 8, 5, F32, (9, 30)),
}

NONFINITE_CASES = {
    "chunk-sinks-f32": PagedCase(4, 2, 64, 16, 3, F32, (30, 9, 18), chunk=8, sinks=True),
    # Three queries over two splits of four 16-slot pages, float32.
    "causal-f32": PagedCase(4, 2, 64, 16, 3, F32, (70, 21, 3)),
    # The window hides early keys from later queries; a bfloat16 cache.
    "window-bf16": PagedCase(4, 2, 64, 8, 3, BF16, (30, 9, 2), window=5),
}


class TestPagedAttentionPallasGpu(PallasGpu, PagedAttentionCases):
    """The kernel compiled for the GPU (skipped without one)."""

    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = CASES
    NONFINITE_CASES = NONFINITE_CASES


class TestPagedAttentionPallasGpuInterpret(TestPagedAttentionPallasGpu):
    """The same kernel in Pallas' interpreter, on any machine."""

    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


# --- the wrapper's knobs --------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_knobs_splits_and_small_blocks(num_splits):
    """Two pages per block: one split of 7 blocks (the online softmax alone), 3 splits of
    several blocks, and one block per split (the logsumexp merge alone)."""
    gen = rng(9)
    lengths = np.array([105, 4, 50])
    positions = default_positions(lengths, 3)
    cache = paged_cache(gen, lengths, positions=positions, window=40, page_size=8, kv_heads=2,
                        head_dim=96, dtype=F32)
    q = jnp.asarray(gen.standard_normal((3, 3, 4, 96)), F32)
    run = jax.jit(lambda *a: kernel.paged_attention(
        *a, sliding_window=40, pages_per_compute_block=2, num_splits=num_splits, num_warps=2,
        num_stages=1, interpret=True))
    out = run(q, cache.k_pages, cache.v_pages, cache.block_tables,
              jnp.asarray(lengths, jnp.int32))
    ref = attention_ref(f64(q), cache.dense_k, cache.dense_v, q_positions=positions,
                        kv_lengths=lengths, sliding_window=40)
    assert_close(out, ref, implementation="pallas_gpu_interpret")


def test_knobs_that_cannot_lower_are_refused():
    q = jnp.ones((1, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    args = (q, pool, pool, jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"pages_per_compute_block=1 \* page_size=8 >= 16"):
        kernel.paged_attention(*args, pages_per_compute_block=1, interpret=True)
    with pytest.raises(ValueError, match="pages_per_compute_block=3 must be a power of two"):
        kernel.paged_attention(*args, pages_per_compute_block=3, interpret=True)
    with pytest.raises(ValueError, match="block_rows=24"):
        kernel.paged_attention(*args, block_rows=24, interpret=True)


# --- lowering for CUDA and supports() ------------------------------------------------------

LOWERED = [  # (q_heads, kv_heads, head_dim, page_size, q_len, dtype, q_dtype)
    (32, 8, 128, 16, None, BF16, None), (32, 8, 128, 16, 16, BF16, None),
    (9, 3, 64, 8, 4, F16, None), (9, 3, 80, 32, None, F32, None), (8, 2, 96, 64, 2, BF16, F32),
    (16, 16, 256, 16, None, BF16, None), (32, 1, 128, 1, 16, F32, None),
    (4, 2, 8, 4, 1, F32, None), (8, 8, 64, 128, 5, F16, F16),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: "-".join(map(case_id, c)))
@pytest.mark.parametrize("masking", [{}, dict(sliding_window=7, logits_soft_cap=30.0)],
                         ids=["plain", "window_cap"])
def test_accepted_cases_lower_for_cuda(case, masking):
    text = lowered_paged_attention(kernel, case, masking, _compat.export_for_cuda)
    assert "forge_jax_paged_attention" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("page_size", [12, 24])
def test_page_size_not_power_of_two_is_rejected_and_fails_lowering(page_size):
    shapes = paged_attention_specs(8, 2, 64, page_size, None, BF16)
    assert "page_size" in kernel.supports(paged_attention_args(shapes))
    with pytest.raises(ValueError, match="power of 2"):
        _compat.export_for_cuda(kernel.paged_attention, *shapes)


@pytest.mark.parametrize("shapes,match", [
    (paged_attention_specs(8, 2, 64, 16, 17, BF16), "q_len=17 > 16"),
    (paged_attention_specs(8, 2, 1024, 16, None, BF16), "head_dim=1024 > 512"),
    (paged_attention_specs(8, 2, 64, 16, None, jnp.float64, BF16), "k_pages.dtype=float64"),
    (paged_attention_specs(8, 2, 64, 16, None, BF16, jnp.float64), "q.dtype=float64"),
], ids=["q_len", "head_dim", "pages_f64", "q_f64"])
def test_supports_rejects_with_reason(shapes, match):
    assert match in (kernel.supports(paged_attention_args(shapes)) or "")


def test_dispatch_names_the_rejection():
    q = jnp.ones((1, 17, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    with pytest.raises(fj.ImplementationError, match="q_len=17"):
        fj.paged_attention(q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                           jnp.ones((1,), jnp.int32), implementation="pallas_gpu_interpret")


def test_registered_but_not_auto_selected_until_verified():
    assert kernel.VERIFIED == {}
    impls = fj.dispatch.implementations("paged_attention")
    assert "pallas_gpu_interpret" in impls
    assert "pallas" in fj.dispatch.implementations("paged_attention", "gpu")
    q = jnp.ones((1, 4, 64), F32)
    pool = jnp.ones((2, 4, 8, 64), F32)
    chosen = fj.explain("paged_attention", q, pool, pool, jnp.zeros((1, 4), jnp.int32),
                        jnp.ones((1,), jnp.int32))
    assert chosen.implementation == "xla"
