"""The Pallas TPU (Mosaic) flash-attention kernel (pallas_kernels/tpu/attention.py).

JAX's tests/pallas pattern: :class:`TestAttentionPallasTpu` runs the kernel compiled on a
TPU (``implementation="pallas"``, skipped without one); :class:`TestAttentionPallasTpuInterpret`
runs the same cases in the TPU interpreter on any machine (race detection, NaN-poisoned
uninitialised memory: an output block the kernel never writes, or the garbage rows of a
partial block reaching a query, fail the finiteness checks). The behaviours come from
:class:`cases.attention_base.AttentionCases`, with the cases Mosaic's layouts accept (head
dim 128, kv lengths that end in a partial block; head dim 64, folded into whole lanes); K/V
slots no query sees hold NaN/inf.
Lowering tests run the real Pallas -> Mosaic lowering for TPU here.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.attention_base import AttentionCase, AttentionCases
from cases.base import PallasTpu
from cases.calls import case_id
from cases.checks import assert_close
from cases.inputs import poison_unseen, random_qkv, rng
from cases.references import attention_mask_ref, attention_ref

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.tpu import _common as tpu_common
from forge_jax.pallas_kernels.tpu import attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct


def _explicit_positions(seed, batch, q_len, kv_len):
    """Random positions, one query before key 0."""
    positions = rng(seed).integers(-2, kv_len, (batch, q_len)).astype(np.int32)
    positions[0, 0] = -1
    return positions


# (batch, q_len, kv_len, q_heads, kv_heads, head_dim 128). Default blocks are 128 x 128 in the
# interpreter, so kv_len 300 / 260 / 200 end in a partial block.
CASES = {
    # GQA, float32, causal with lengths, a window (skips blocks) and a soft cap.
    "gqa-f32-lengths-window-cap": AttentionCase(
        (2, 40, 300, 4, 2, 128), F32, poison=True, seed=4,
        masking=dict(kv_lengths=np.array([300, 170]), sliding_window=64, logits_soft_cap=5.0)),
    # MHA, bfloat16, not causal, explicit positions (one query before key 0).
    "mha-bf16-non_causal-positions": AttentionCase(
        (2, 24, 200, 2, 2, 128), BF16, poison=True, seed=2,
        masking=dict(causal=False, kv_lengths=np.array([200, 3]),
                     q_positions=_explicit_positions(2, 2, 24, 200))),
    # MQA bfloat16 decode, an empty sequence among them.
    "mqa-bf16-decode": AttentionCase((3, 1, 260, 8, 1, 128), BF16, poison=True, seed=8,
                                     masking=dict(kv_lengths=np.array([0, 259, 1]))),
    # SmolLM2's heads (9/3 of 64): the three kv heads folded into one 192-lane row.
    "smollm-bf16-head_dim64": AttentionCase(
        (2, 20, 300, 9, 3, 64), BF16, poison=True, seed=9,
        masking=dict(kv_lengths=np.array([300, 150]), sliding_window=100)),
    # MHA, head_dim 64: pairs of heads make one 128-lane tile (no transpose of Q).
    "mha-f32-head_dim64-cap": AttentionCase(
        (2, 24, 140, 4, 4, 64), F32, poison=True, seed=10,
        masking=dict(kv_lengths=np.array([140, 33]), logits_soft_cap=5.0)),
    # Gemma 4's head_dim 512 (8 / 4 heads: its full layers and its KV cache's width).
    "gemma4-bf16-head_dim512-window": AttentionCase(
        (1, 20, 150, 8, 4, 512), BF16, poison=True, seed=11,
        masking=dict(kv_lengths=np.array([150]), sliding_window=40)),
}

# Attention sinks (gpt-oss: 64 query / 8 KV heads of 64, pairs folded into 128 lanes, a
# window on alternate layers) and chunked attention (Llama 4: 40 / 8 heads of 128, chunks of
# 8192 scaled down to 64), NaN / inf in every slot no query sees, outside the chunk included.
GPT_OSS, LLAMA4 = (64, 8, 64), (40, 8, 128)


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), jnp.float32)


CASES |= {
    "gptoss-bf16-sinks-window": AttentionCase(
        (1, 16, 140, *GPT_OSS), BF16, poison=True, seed=12,
        masking=dict(sliding_window=40, sinks=_sinks(64, 1))),
    "llama4-bf16-chunk": AttentionCase(
        (1, 16, 300, *LLAMA4), BF16, poison=True, seed=13,
        masking=dict(attention_chunk_size=64, kv_lengths=np.array([290]))),
    "gqa-f32-everything-sinks-chunk": AttentionCase(
        (2, 40, 300, 4, 2, 128), F32, poison=True, seed=14,
        masking=dict(kv_lengths=np.array([300, 170]), sliding_window=100, logits_soft_cap=5.0,
                     attention_chunk_size=64, sinks=_sinks(4, 2))),
    "mha-f32-non_causal-chunk-sinks": AttentionCase(
        (2, 24, 200, 2, 2, 128), F32, seed=15,
        masking=dict(causal=False, attention_chunk_size=64, sinks=_sinks(2, 3),
                     q_positions=_explicit_positions(2, 2, 24, 200))),
}

NONFINITE_CASES = {
    "chunk-sinks": AttentionCase(
        (2, 5, 140, 4, 2, 128), F32, dict(kv_lengths=np.array([131, 9]), attention_chunk_size=8,
                                          sinks=_sinks(4, 4)), poison=True, seed=7),
    # Chunked prefill, causal with a window across the kv block boundary (key 128): NaN/inf
    # also in every slot no query sees; the same NaNs as XLA's.
    "window-across-blocks": AttentionCase(
        (2, 5, 140, 4, 2, 128), F32, dict(kv_lengths=np.array([131, 9]), sliding_window=4),
        poison=True, seed=7, nans_as_xla=True),
}

GRADIENT_CASES = {
    "sinks-chunk": AttentionCase(
        (2, 16, 130, 4, 2, 128), F32, poison=True, seed=5, grad_xla_factor=0.2,
        masking=dict(kv_lengths=np.array([130, 50]), attention_chunk_size=32,
                     sinks=_sinks(4, 5))),
    # Gradients equal to the XLA VJP's within 1e-5.
    "lengths-window-cap": AttentionCase(
        (2, 16, 130, 4, 2, 128), F32, poison=True, seed=5, grad_xla_factor=0.2,
        masking=dict(kv_lengths=np.array([130, 50]), sliding_window=40, logits_soft_cap=4.0)),
}


class TestAttentionPallasTpu(PallasTpu, AttentionCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = CASES
    NONFINITE_CASES = NONFINITE_CASES
    GRADIENT_CASES = GRADIENT_CASES

    def test_small_blocks_skip_masked_blocks(self):
        # 8 x 128 blocks: three query blocks (the last partial), three kv blocks (the last
        # partial); causal + window leave blocks no query of a block sees, which are skipped.
        # The window is chosen so that the first query of sequence 0 (position 270) sees
        # key 127 as its oldest: the last key of kv block 0, which must not be skipped.
        lengths, window = np.array([290, 100], np.int32), 144
        q, k, v = random_qkv(3, 2, 20, 300, 2, 1, 128, F32)
        k, v = poison_unseen(k, v, attention_mask_ref(2, 20, 300, kv_lengths=lengths,
                                                      sliding_window=window))
        out = jax.jit(lambda q, k, v, n: kernel.flash_attention(
            q, k, v, kv_lengths=n, sliding_window=window, block_q=8, block_k=128,
            interpret=self.INTERPRET))(q, k, v, jnp.asarray(lengths))
        ref = attention_ref(q, k, v, kv_lengths=lengths, sliding_window=window)
        assert_close(out, ref, implementation=self.IMPLEMENTATION)


class TestAttentionPallasTpuInterpret(TestAttentionPallasTpu):
    """The same kernel in the TPU interpreter, on any machine."""

    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


# --- lowering for TPU and supports() -------------------------------------------------------


def _shapes(q_heads, kv_heads, q_len, kv_len, head_dim, dtype, kv_dtype=None, batch=2):
    kv = S((batch, kv_len, kv_heads, head_dim), kv_dtype or dtype)
    return S((batch, q_len, q_heads, head_dim), dtype), kv, kv


def _args(shapes, **kw):
    q, k, v = shapes
    return dict(q=q, k=k, v=v, scale=None, causal=True, q_positions=None, kv_lengths=None,
                sliding_window=None, logits_soft_cap=None) | kw


LOWERED = [  # (q_heads, kv_heads, q_len, kv_len, head_dim, dtype, kv_dtype)
    (32, 8, 1, 1000, 128, BF16, None),   # Llama-3-8B decode
    (8, 2, 300, 1000, 128, BF16, None),  # partial q and kv blocks
    (8, 8, 40, 37, 128, F32, None),      # kv_len below one block
    (4, 1, 16, 512, 256, F32, None),
    (8, 2, 20, 300, 128, F32, BF16),     # mixed dtypes
    (8, 2, 20, 300, 128, BF16, F32),
    (9, 3, 300, 1000, 64, BF16, None),   # SmolLM2: three heads of 64 folded (192 lanes)
    (32, 8, 1, 1000, 64, BF16, None),    # Llama-3.2-1B decode: pairs of heads of 64
    (32, 32, 40, 37, 80, F32, None),     # Phi-2: eight heads of 80 folded (640 lanes)
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: "-".join(map(case_id, c)))
@pytest.mark.parametrize("masking", [
    {}, dict(causal=False, sliding_window=7, logits_soft_cap=30.0)], ids=["plain", "masked"])
def test_accepted_cases_lower_for_tpu(case, masking):
    shapes = _shapes(*case)
    assert kernel.supports(_args(shapes, **masking)) is None
    batch, q_len = shapes[0].shape[:2]
    exported = _compat.export_for_tpu(
        lambda q, k, v, p, n: kernel.flash_attention(q, k, v, q_positions=p, kv_lengths=n,
                                                     **masking),
        *shapes, S((batch, q_len), jnp.int32), S((batch,), jnp.int32))
    text = exported.mlir_module()
    assert "forge_jax_tpu_flash_attention" in text and "tpu_custom_call" in text


def test_small_blocks_and_gradients_lower_for_tpu():
    q, k, v = _shapes(8, 2, 300, 1000, 128, BF16)
    _compat.export_for_tpu(
        lambda q, k, v: kernel.flash_attention(q, k, v, block_q=16, block_k=256), q, k, v)
    loss = lambda q, k, v: jnp.sum(kernel.flash_attention(q, k, v, sliding_window=64))
    _compat.export_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), *_shapes(4, 2, 64, 256, 128, F32))


@pytest.mark.parametrize("kv_heads, head_dim, heads", [
    (8, 128, 1), (2, 256, 1), (3, 64, 3), (8, 64, 2), (2, 80, 2), (32, 80, 8), (4, 96, 4),
    (8, 192, 2)])
def test_heads_narrower_than_a_tile_are_folded_into_whole_lanes(kv_heads, head_dim, heads):
    assert kernel.heads_per_block(kv_heads, head_dim) == heads


def test_a_fold_wider_than_the_bound_is_rejected():
    # 200-wide heads make whole tiles only 16 at a time: all 8 kv heads, 1600 lanes.
    assert "head_dim=200 with kv_heads=8: a program would read 1600 lanes" in (
        kernel.supports(_args(_shapes(8, 8, 16, 256, 200, F32))) or "")


def test_float16_is_rejected():
    # Not a lowering failure: the Mosaic lowering takes float16, but libtpu's compiler does
    # not ("Invalid vector type for load": tests/test_aot.py compiles it for v5e).
    assert "q.dtype=float16" in kernel.supports(_args(_shapes(8, 2, 16, 256, 128, F16)))
    assert "k.dtype=float16" in kernel.supports(_args(_shapes(8, 2, 16, 256, 128, F32, F16)))


@pytest.mark.parametrize("knobs,match", [
    (dict(block_q=12), "block_q=12 must be a multiple of 8"),
    (dict(block_k=100), "block_k=100 must be a multiple of 128"),
])
def test_blocks_mosaic_cannot_tile_are_rejected(knobs, match):
    shapes = _shapes(4, 2, 64, 300, 128, F32)
    with pytest.raises(ValueError, match=match):
        kernel.flash_attention(*(jnp.ones(s.shape, s.dtype) for s in shapes), **knobs)
    # Forced past the check, the Mosaic lowering fails on the same block.
    st = dict(scale=1.0, causal=True, sliding_window=None, logits_soft_cap=None,
              block_q=knobs.get("block_q", 64), block_k=knobs.get("block_k", 300),
              interpret=False)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _compat.export_for_tpu(
            lambda q, k, v, p, n: kernel._forward(q, k, v, p, n, **st), *shapes,
            S((2, 64), jnp.int32), S((2,), jnp.int32))


def test_dispatch_names_the_rejection():
    q = jnp.ones((1, 4, 2, 64), F16)
    with pytest.raises(fj.ImplementationError, match="q.dtype=float16"):
        fj.attention(q, q, q, implementation="pallas_tpu_interpret")


def test_tuning_table():
    assert set(kernel.TUNED) >= {"TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "default"}
    assert kernel.block_sizes(4096, 8192, BF16, device_kind="TPU v6 lite") == (512, 1024)
    assert kernel.block_sizes(1, 37, F32, device_kind="unknown") == (1, 37)  # clipped
    assert kernel.block_sizes(100, 300, BF16, block_q=32) == (32, 128)
    # Wide folds (eight heads of 80: 640 lanes) take smaller blocks, whole tiles still.
    assert kernel.block_sizes(4096, 8192, F32, device_kind="TPU v5 lite", lanes=640) == \
        (128, 256)
    assert kernel.block_sizes(4096, 8192, BF16, device_kind="TPU v4", lanes=640) == (128, 256)


def test_every_tpu_kernel_has_a_table_serving_every_generation():
    ops = {impl.op for op in fj.dispatch.ops() for impl in fj.dispatch.registrations(op)
           if impl.name == "pallas_tpu_interpret"}
    assert ops == {"rms_norm", "silu_mul", "rope", "attention", "paged_attention",
                   "ragged_paged_attention", "grouped_matmul", "quantized_matmul",
                   "mla_paged_attention", "gated_delta_rule"}
    # The gated delta rule's one knob, chunk_size, is the caller's (a grid step a chunk):
    # it has no tuned table.
    tuned_ops = ops - {"gated_delta_rule"}
    for kind in (*tpu_common.GENERATIONS, "default"):
        for op in tuned_ops:
            module = importlib.import_module(f"forge_jax.pallas_kernels.tpu.{op}")
            knobs = tpu_common.tuned(module.TUNED, kind)
            assert knobs and all(isinstance(v, int) and v > 0 for v in knobs.values()), (kind, op)
    assert tpu_common.tuned(kernel.TUNED, "TPU v9 unknown") == kernel.TUNED["default"]
    rms_norm_tuned = importlib.import_module("forge_jax.pallas_kernels.tpu.rms_norm").TUNED
    assert tpu_common.tuned(rms_norm_tuned, "interpret") == rms_norm_tuned["default"]


# id -> (q_heads, kv_heads, q_len, kv_len, head_dim, dtype, masking): the TPU compile
# (libtpu's Mosaic, not only the lowering above) of folded heads on one bfloat16 query row
# (decode), where Mosaic once refused the select that zeroes the other heads' lanes ("Not
# implemented: Sublane broadcast"), and of gpt-oss's sinks and Llama 4's chunks.
TPU_COMPILES = {
    "smollm2-decode-bf16": (9, 3, 1, 1000, 64, BF16, {}),
    "smollm2-prefill-bf16": (9, 3, 300, 1000, 64, BF16, dict(sliding_window=64)),
    "phi2-decode-bf16": (32, 32, 1, 1000, 80, BF16, {}),
    "gptoss-decode-sinks-window-bf16": (64, 8, 1, 4096, 64, BF16,
                                        dict(sliding_window=128, sinks=True)),
    "gptoss-prefill-sinks-window-bf16": (64, 8, 256, 1024, 64, BF16,
                                         dict(sliding_window=128, sinks=True)),
    "llama4-prefill-chunk-bf16": (40, 8, 256, 1024, 128, BF16, dict(attention_chunk_size=8192)),
}


@pytest.mark.target("tpu-v5e")
@pytest.mark.parametrize("name", TPU_COMPILES)
def test_compiles_for_tpu_v5e(name):
    q_heads, kv_heads, q_len, kv_len, head_dim, dtype, masking = TPU_COMPILES[name]
    masking = dict(masking)
    sinks = S((q_heads,), F32) if masking.pop("sinks", False) else None
    q, k, v = _shapes(q_heads, kv_heads, q_len, kv_len, head_dim, dtype, batch=1)
    assert kernel.supports(_args((q, k, v), **masking)) is None
    report = fj.aot.compile(
        lambda q, k, v, s: kernel.flash_attention(q, k, v, sinks=s, **masking), q, k, v, sinks,
        target="tpu-v5e")
    assert report.compiled, report.error
    assert [k.name for k in report.kernels] == ["forge_jax_tpu_flash_attention"], report.kernels
