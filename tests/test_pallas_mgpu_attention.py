"""The Mosaic GPU flash-attention kernel (pallas_kernels/gpu/mosaic_attention.py).

:class:`TestAttentionMosaicGpu` runs the kernel compiled (``"mosaic_gpu"``) and is skipped
without a Hopper+ GPU; :class:`TestAttentionMosaicGpuInterpret` runs the same cases in the
Mosaic GPU interpreter (race detection on, shared memory and outputs poisoned with NaN:
``_mosaic.interpret_params``) on any machine. The interpreter runs every CTA's three
warpgroups, TMA copies and barriers on the CPU: about 10-30 s a case on two cores, so the
case tables are few and small, on real models' head layouts with lengths ending inside
tiles. The behaviours come from :class:`cases.attention_base.AttentionCases`.

The deviceless H100 compile (``fj.aot``: JAX's CUDA pipeline, Mosaic GPU's compile and
ptxas) of the head dims :func:`supports` accepts, with no spills in ptxas' report
(``_mosaic.ptxas_report``), and of the rejected 512, which the compiler refuses for its
shared memory.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.attention_base import (
    AttentionCase,
    AttentionCases,
    mosaic_nan_unseen_cases,
    one_kv_head,
)
from cases.shapes import GEMMA2_2B_HEADS, LLAMA3_8B_HEADS, SMOLLM2_135M_HEADS
from jax import lax

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_attention as mosaic

S = jax.ShapeDtypeStruct
pl = _compat.pallas()
BF16, F16 = jnp.bfloat16, jnp.float16

# (batch, q_len, kv_len, q_heads, kv_heads, head_dim). The interpreter takes 10-20 s per CTA
# (one kv head of one sequence) on two cores, so the real models' GQA groups and head dims
# run on one kv head each (CTAs of different kv heads share nothing but the grid): SmolLM2's
# groups of 3 at head_dim 64 (tiles of 128 keys: 150 keys end inside the second, which is
# read from key 22), Llama 3's groups of 4 at head_dim 128 (tiles of 64: 70 keys, padded
# to 72 for TMA's rows of 8) and Gemma 2's groups of 2 at head_dim 256 (two CTAs a query
# block, each computing 128 of V's columns: a NaN must reach exactly its own column).
LLAMA_GROUP = one_kv_head(LLAMA3_8B_HEADS)
GEMMA_GROUP = one_kv_head(GEMMA2_2B_HEADS)
# Attention sinks (gpt-oss: 64 query / 8 KV heads of 64, a window on alternate layers) and
# chunked attention (Llama 4: 40 / 8 heads of 128, chunks of 8192 scaled down to 16).
GPT_OSS, LLAMA4 = (64, 8, 64), (40, 8, 128)
GPT_OSS_GROUP, LLAMA4_GROUP = one_kv_head(GPT_OSS), one_kv_head(LLAMA4)
F32 = jnp.float32


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), F32)


CASES = {
    **mosaic_nan_unseen_cases(SMOLLM2_135M_HEADS, LLAMA3_8B_HEADS),
    # One CTA walking three tiles (more than its two stages: the producer waits for slots
    # to be freed) where each consumer skips tiles the other needs: warpgroup 0's queries
    # see tile 0 only, warpgroup 1's tiles 1 and 2 (the ping-pong across skipped tiles).
    "llama3-pipeline-skipped_tiles-nan_unseen": AttentionCase(
        (1, 32, 150, *LLAMA_GROUP), BF16,
        dict(kv_lengths=np.array([146]), sliding_window=50,
             q_positions=np.concatenate([np.arange(10, 26), np.arange(120, 136)])[None]),
        poison=True, seed=4),
    # Gemma 2's soft cap and window at head_dim 256; 100 keys end inside the second tile.
    "gemma2-256-window-cap-nan_unseen": AttentionCase(
        (1, 4, 104, *GEMMA_GROUP), BF16,
        dict(kv_lengths=np.array([100]), sliding_window=70, logits_soft_cap=50.0,
             q_positions=np.array([[30, 64, 98, 99]])), poison=True, seed=3),
    # gpt-oss's sinks (one per query head of the group: rows of the CTA read different
    # heads' sinks) with its window; NaN / +inf in every slot no query sees.
    "gptoss-sinks-window-nan_unseen": AttentionCase(
        (1, 6, 40, *GPT_OSS_GROUP), BF16, dict(sliding_window=12, sinks=_sinks(8, 1)),
        poison=True, seed=12),
    # Llama 4's chunks: queries at 48..52 see keys 48..52 only, NaN in keys 0..47 included
    # (the CTA skips the tiles before the chunk; the chunk starts inside a tile).
    "llama4-chunk-nan_unseen": AttentionCase(
        (1, 5, 57, *LLAMA4_GROUP), BF16, dict(attention_chunk_size=16, kv_lengths=np.array([53])),
        poison=True, seed=13),
    # Chunks not causal, explicit positions across three chunks (one CTA's rows in different
    # chunks: no tile is interior to all of them), sinks and a soft cap.
    "non_causal-chunks-positions-sinks-nan_unseen": AttentionCase(
        (1, 4, 150, *one_kv_head(SMOLLM2_135M_HEADS)), F16,
        dict(causal=False, attention_chunk_size=48, sinks=_sinks(3, 3), logits_soft_cap=5.0,
             q_positions=np.array([[-3, 50, 60, 140]]), kv_lengths=np.array([145])),
        poison=True, seed=15),
}

NONFINITE_CASES = {
    # Chunked prefill: NaN / inf in slots some queries of the sequence see, others not (two
    # kv heads: each poisoned slot is poisoned in one, and the other's outputs stay clean).
    "window": AttentionCase((1, 5, 24, 6, 2, 64), BF16,
                            dict(kv_lengths=np.array([21]), sliding_window=4), seed=6),
    "head_dim_256": AttentionCase((1, 3, 16, *GEMMA_GROUP), F16,
                                  dict(kv_lengths=np.array([14]), sliding_window=3), seed=7),
    "chunk_sinks": AttentionCase((1, 5, 24, 6, 2, 64), BF16,
                                 dict(kv_lengths=np.array([21]), attention_chunk_size=8,
                                      sinks=_sinks(6, 4)), seed=6),
}

GRADIENT_CASES = {
    "non_causal": AttentionCase((1, 3, 20, 2, 1, 64), BF16,
                                dict(causal=False, kv_lengths=np.array([17])),
                                poison=True, seed=11),
}


class TestAttentionMosaicGpu(AttentionCases):
    IMPLEMENTATION = "mosaic_gpu"
    CASES = CASES
    NONFINITE_CASES = NONFINITE_CASES
    GRADIENT_CASES = GRADIENT_CASES

    @classmethod
    def skip_reason(cls) -> str | None:
        if cls.INTERPRET:
            return None
        reason = _mosaic.available()
        if reason is None and _mosaic.mma_kind() != "wgmma":  # Blackwell: the tcgen05 kernel
            reason = "a Blackwell GPU (tests/test_pallas_mgpu_attention_sm100.py runs there)"
        return None if reason is None else (
            f"compiled Mosaic GPU kernel: {reason} (the interpret subclass runs here)")


class TestAttentionMosaicGpuInterpret(TestAttentionMosaicGpu):
    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True

    def after_test(self) -> None:
        # JAX 0.10's interpreter records a race (two warpgroups touching shared memory with
        # no barrier between them) without raising (0.12's raises); every test's kernel must
        # have none.
        assert _mosaic.races_found() is False


@pytest.mark.slow
def test_sink_values_nan_inf_and_no_keys():
    """A NaN or +inf sink makes its head's outputs NaN, a -inf sink is no sink, and a query
    that sees no key still returns zeros (sequence 1 has no keys; a sink is visible to
    every query, so its NaN heads stay NaN), as the XLA implementation computes them (the
    contract of forge_jax.ops.attention)."""
    sinks = _sinks(8, 5).at[1].set(jnp.nan).at[2].set(jnp.inf).at[3].set(-jnp.inf)
    q, k, v, mask = AttentionCase((2, 3, 40, *GPT_OSS_GROUP), BF16,
                                  dict(kv_lengths=np.array([37, 0]))).inputs()
    masking = dict(kv_lengths=jnp.array([37, 0]), sinks=sinks)
    out = np.asarray(fj.attention(q, k, v, implementation="mosaic_gpu_interpret", **masking),
                     np.float64)
    assert _mosaic.races_found() is False
    xla = np.asarray(fj.attention(q, k, v, implementation="xla", **masking), np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(xla))
    assert np.isnan(out[0, :, 1:3]).all() and not np.isnan(out[0, :, [0, *range(3, 8)]]).any()
    np.testing.assert_array_equal(np.delete(out[1], [1, 2], axis=1), 0.0)
    plain = np.asarray(fj.attention(q, k, v, implementation="xla",
                                    kv_lengths=masking["kv_lengths"]), np.float64)
    np.testing.assert_allclose(out[0, :, 3], plain[0, :, 3], rtol=2e-2, atol=2e-2)
    finite = ~np.isnan(xla)
    np.testing.assert_allclose(out[finite], xla[finite], rtol=2e-2, atol=2e-2)


def _racy(x_ref, o_ref, smem):
    # Both warpgroups write the same shared memory with no barrier: a race.
    smem[...] = jnp.full(smem.shape, lax.axis_index("wg").astype(jnp.float32))
    plgpu = _compat.pallas_mosaic_gpu()

    @pl.when(lax.axis_index("wg") == 0)
    def _():
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)


@pytest.mark.parametrize("detect", [True, False], ids=["races_on", "races_off"])
def test_interpreter_finds_a_race_when_asked(detect):
    # The check after_test relies on: with race detection on, the interpreter flags an
    # unsynchronised write; off, it does not look. Outputs and shared memory start as NaN.
    params = _mosaic.interpret_params(detect_races=detect)
    assert params.uninitialized_memory == "nan" and _mosaic.interpret_params().detect_races
    plgpu = _compat.pallas_mosaic_gpu()
    x = jnp.zeros((128,), jnp.float32)
    try:
        with _compat.force_mosaic_gpu_interpret(params):
            y = _mosaic.kernel(_racy, out_shape=S(x.shape, x.dtype),
                               scratch_shapes=[plgpu.SMEM(x.shape, x.dtype)], num_threads=2,
                               thread_name="wg")(x)
        assert np.isin(np.asarray(y), [0.0, 1.0]).all()
        found = _mosaic.races_found()
    except Exception as e:  # JAX 0.12's interpreter raises where 0.10's records the race
        assert "RACE DETECTED" in str(e)
        found = True
    assert found is detect


# --- supports() and the H100 compile --------------------------------------------------


@pytest.mark.parametrize("q_dtype,kv_dtype,head_dim,reason", [
    (jnp.float32, jnp.float32, 64, "bfloat16 or float16"),
    (BF16, F16, 64, "all three equal"),
    (BF16, BF16, 80, "multiple of 64 columns"),
    (BF16, BF16, 192, "not compiled and checked"),
    (BF16, BF16, 512, "more than 232448"),
], ids=["float32", "mixed", "head_dim_80", "head_dim_192", "head_dim_512"])
def test_supports_rejects(q_dtype, kv_dtype, head_dim, reason):
    args = dict(q=S((1, 4, 2, head_dim), q_dtype), k=S((1, 8, 2, head_dim), kv_dtype),
                v=S((1, 8, 2, head_dim), kv_dtype))
    assert reason in mosaic.supports(args)


@pytest.mark.parametrize("knobs", [dict(block_d=96), dict(block_d=512),
                                   dict(block_d=128, block_kv=128)],
                         ids=["not_multiple_of_64", "wider_than_head_dim", "split_block_kv"])
def test_bad_column_split_is_refused_before_any_work(knobs):
    q = jnp.ones((1, 4, 2, 256), BF16)
    with pytest.raises(ValueError, match="block_d a multiple of 64 dividing head_dim"):
        mosaic.flash_attention(q, q, q, interpret=True, **knobs)


def test_head_dim_256_splits_the_value_columns():
    # The launch that compiles without spills (test_h100_compile): two CTAs of 128 columns.
    q = S((1, 4, 8, 256), BF16)
    assert mosaic.supports(dict(q=q, k=q, v=q)) is None
    config = mosaic.default_config({"q": q})
    assert (config.block_d, config.block_kv, config.ping_pong) == (128, 64, False)
    assert mosaic.shared_memory_bytes(256, BF16, config) <= mosaic.SHARED_MEMORY


def test_rejected_case_is_refused_by_name():
    q = jnp.ones((1, 4, 2, 64), jnp.float32)
    with pytest.raises(fj.ImplementationError, match="bfloat16 or float16"):
        fj.attention(q, q, q, implementation="mosaic_gpu_interpret")


def test_registered_by_name_only():
    assert "mosaic_gpu_interpret" in fj.dispatch.implementations("attention")
    assert mosaic.VERIFIED == {}
    q = S((1, 4, 8, 128), BF16)
    with fj.targets.use("h100"):
        assert "mosaic_gpu" in fj.registry.implementations("attention")
        selection = fj.explain("attention", q, q, q)
        assert selection.implementation != "mosaic_gpu"  # not verified: by name only
        assert fj.explain("attention", q, q, q, implementation="mosaic_gpu"
                          ).implementation == "mosaic_gpu"
    with fj.targets.use("a100"):
        rejected = fj.explain("attention", q, q, q).rejected
        assert "compute capability >= 9.0" in rejected["mosaic_gpu"]


# id -> (q shape, k/v shape, dtype, masking): what supports() accepts compiles without
# spills (head_dim 256 with V's columns split over two CTAs), the rejected head_dim 512 is
# refused by the compiler for its shared memory.
COMPILE_CASES = {
    "llama3-prefill-window-cap-bf16": ((1, 100, 32, 128), (1, 296, 8, 128), BF16,
                                       dict(sliding_window=50, logits_soft_cap=30.0)),
    "llama3-decode-f16": ((3, 1, 32, 128), (3, 4096, 8, 128), F16, {}),
    "smollm2-non_causal-window-short_cache-f16": ((1, 7, 9, 64), (1, 21, 3, 64), F16,
                                                  dict(causal=False, sliding_window=5)),
    "gemma2-256-prefill-window-cap-bf16": ((1, 100, 8, 256), (1, 296, 4, 256), BF16,
                                           dict(sliding_window=50, logits_soft_cap=50.0)),
    "gemma2-256-decode-f16": ((3, 1, 8, 256), (3, 4096, 4, 256), F16, {}),
    "head_dim_512-rejected": ((1, 100, 32, 512), (1, 296, 8, 512), BF16, {}),
    # Sinks (gpt-oss) and chunks (Llama 4's 8192), and both with every option at 256.
    "gptoss-prefill-sinks-window-bf16": ((1, 100, 64, 64), (1, 296, 8, 64), BF16,
                                         dict(sliding_window=128, sinks=True)),
    "gptoss-decode-sinks-window-bf16": ((3, 1, 64, 64), (3, 4096, 8, 64), BF16,
                                        dict(sliding_window=128, sinks=True)),
    "llama4-prefill-chunk-bf16": ((1, 100, 40, 128), (1, 296, 8, 128), BF16,
                                  dict(attention_chunk_size=8192)),
    "llama4-decode-chunk-sinks-f16": ((3, 1, 40, 128), (3, 4096, 8, 128), F16,
                                      dict(attention_chunk_size=8192, sinks=True)),
    "gemma2-256-chunk-sinks-window-cap-bf16": ((1, 100, 8, 256), (1, 296, 4, 256), BF16,
                                               dict(attention_chunk_size=64, sinks=True,
                                                    sliding_window=50, logits_soft_cap=50.0)),
}


@pytest.mark.target("h100")
@pytest.mark.parametrize("case", COMPILE_CASES.values(), ids=COMPILE_CASES)
def test_h100_compile(case):
    q_shape, kv_shape, dtype, masking = case
    q, kv = S(q_shape, dtype), S(kv_shape, dtype)
    masking = dict(masking)
    sinks = S((q_shape[2],), F32) if masking.pop("sinks", False) else None
    extras = {} if sinks is None else dict(sinks=sinks)
    reason = mosaic.supports(dict(q=q, k=kv, v=kv, **masking, **extras))

    def fn(q, k, v, lengths, sinks):
        return mosaic.flash_attention(q, k, v, kv_lengths=lengths, sinks=sinks, **masking)

    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fn, q, kv, kv, S((q_shape[0],), jnp.int32), sinks,
                                target="h100")
    if reason is None:
        assert report.compiled, report.error
        (kernel,) = report.kernels
        assert kernel.name == mosaic.NAME and kernel.costed and kernel.roofline_seconds > 0
        spills = [int(n) for ln in lines for n in re.findall(r"(\d+) bytes spill stores", ln)]
        registers = [int(n) for ln in lines for n in re.findall(r"Used (\d+) registers", ln)]
        assert len(spills) == len(registers) == 1 and spills == [0], lines
    else:  # a rejection that is a compile limit fails the compile
        assert "shared memory" in reason
        assert not report.compiled and "exceeds available shared memory" in report.error
        need = int(re.search(r"smem_bytes=(\d+)", report.error).group(1))
        assert need > mosaic.SHARED_MEMORY
