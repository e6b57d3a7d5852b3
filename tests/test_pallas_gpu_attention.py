"""The Pallas GPU flash-attention kernel (pallas_kernels/gpu/attention.py).

:class:`TestAttentionPallasGpu` runs the kernel compiled (``implementation="pallas"``) and is
skipped without a GPU; :class:`TestAttentionPallasGpuInterpret` runs the same cases in
Pallas' interpreter on any machine. The behaviours every attention implementation shows
(float64 reference and XLA, masking, NaN in the slots no query sees, per-query NaN/inf,
gradients) come from :class:`cases.attention_base.AttentionCases`; the cases below are the
ones this kernel serves. The lowering tests export for CUDA here (Pallas -> Triton
lowering, no device needed).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.attention_base import AttentionCase, AttentionCases
from cases.base import PallasGpu
from cases.calls import as_jnp, case_id, jcall
from cases.checks import assert_close, assert_close_nan
from cases.inputs import poison_unseen, random_qkv
from cases.references import attention_mask_ref, attention_ref, f64
from cases.shapes import GEMMA4_HEADS, LLAMA3_8B_HEADS, PHI2_HEAD_DIM, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import _common
from forge_jax.pallas_kernels.gpu import attention as flash

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype): lengths end inside blocks.
SHAPES = [
    (1, 7, 21, *LLAMA3_8B_HEADS, BF16),
    (1, 6, 45, *SMOLLM2_135M_HEADS, BF16),
    (2, 5, 37, 12, 4, PHI2_HEAD_DIM, F16),  # group 3
    (1, 9, 20, 14, 2, 96, F32),             # group 7, head dim 96
    (2, 17, 33, 4, 4, 32, F32),             # MHA
    (2, 3, 150, 8, 1, 64, BF16),            # MQA, three K blocks
    (1, 4, 20, 2, 1, 256, F32),             # largest head dim
]

MASKS = {
    "non_causal": dict(causal=False),
    "kv_lengths": dict(kv_lengths=np.array([150, 77])),
    "q_positions": dict(q_positions=np.array([[0, 3, 64, 65, 66, 70, 99, 120, 130, 140, 149],
                                              [-2, 0, 1, 2, 40, 41, 42, 43, 44, 45, 46]])),
    "window_soft_cap": dict(sliding_window=20, logits_soft_cap=2.0, scale=0.6),
    "non_causal_window_lengths": dict(causal=False, sliding_window=30,
                                      kv_lengths=np.array([100, 9])),
    "everything": dict(kv_lengths=np.array([140, 70]), sliding_window=33, logits_soft_cap=5.0,
                       q_positions=np.array([[5, 6, 7, 8, 50, 60, 70, 100, 110, 138, 139],
                                             [0, 10, 20, 30, 40, 50, 60, 69, 70, 80, -1]])),
}

CASES = {
    **{"shape-" + "_".join(map(case_id, s)): AttentionCase(s[:6], s[6], seed=1) for s in SHAPES},
    **{f"mask-{name}": AttentionCase((2, 11, 150, 6, 2, 64), F32, kw, seed=2)
       for name, kw in MASKS.items()},
    # Low precision, every masking option, NaN in the slots no query sees.
    **{f"nan_unseen-everything-{case_id(dtype)}": AttentionCase(
        (2, 11, 150, 6, 2, 80), dtype, MASKS["everything"], poison=True, seed=3)
       for dtype in (BF16, F16)},
    # The slots past the last query are unseen.
    "nan_unseen-positions": AttentionCase(
        (2, 11, 150, 6, 2, 64), F32, poison=True, seed=4,
        masking=dict(q_positions=np.array([[3, 4, 5, 9, 10, 11, 60, 61, 70, 71, 100]] * 2))),
    "nan_unseen-kv_lengths": AttentionCase((2, 11, 150, 6, 2, 64), F32, MASKS["kv_lengths"],
                                           poison=True, seed=4),
    "decode": AttentionCase((3, 1, 150, 8, 2, 128), BF16, dict(kv_lengths=np.array([150, 3, 64])),
                            poison=True, seed=5),
}

# Attention sinks (gpt-oss: 64 query / 8 KV heads of 64, a window on alternate layers) and
# chunked attention (Llama 4: 40 / 8 heads of 128, chunks of 8192 scaled down to 16), NaN /
# inf in every slot no query sees, outside the chunk included.
GPT_OSS, LLAMA4 = (64, 8, 64), (40, 8, 128)


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), jnp.float32)


CASES |= {
    "gptoss-sinks-window-nan_unseen": AttentionCase(
        (1, 6, 40, *GPT_OSS), BF16, dict(sliding_window=12, sinks=_sinks(64, 1)),
        poison=True, seed=12),
    "llama4-chunk-nan_unseen": AttentionCase(
        (1, 5, 57, *LLAMA4), BF16, dict(attention_chunk_size=16, kv_lengths=np.array([53])),
        poison=True, seed=13),
    "everything-sinks-chunk-nan_unseen": AttentionCase(
        (2, 11, 150, 6, 2, 80), F32, dict(MASKS["everything"], attention_chunk_size=32,
                                         sinks=_sinks(6, 2)), poison=True, seed=14),
    # Gemma 4's head_dim 512 (8 / 4 heads), a window, NaN where no query looks.
    "gemma4-512-window-nan_unseen": AttentionCase(
        (1, 7, 40, *GEMMA4_HEADS), BF16, dict(sliding_window=12), poison=True,
        seed=16),
    "gemma4-512-f32-decode": AttentionCase(
        (2, 1, 40, *GEMMA4_HEADS), F32, dict(kv_lengths=np.array([40, 9])),
        poison=True, seed=17),
    "non_causal-chunk-sinks": AttentionCase(
        (2, 11, 150, 6, 2, 64), F32, dict(causal=False, attention_chunk_size=16,
                                         sinks=_sinks(6, 3),
                                         q_positions=MASKS["q_positions"]["q_positions"]),
        seed=15),
}

NONFINITE_CASES = {
    "chunk_sinks": AttentionCase((2, 5, 24, 6, 2, 64), F32,
                                 dict(kv_lengths=np.array([24, 13]), attention_chunk_size=8,
                                      sinks=_sinks(6, 4)), seed=6),
    "causal": AttentionCase((2, 5, 24, 6, 2, 64), F32, dict(kv_lengths=np.array([24, 13])),
                            seed=6),
    "window": AttentionCase((2, 5, 24, 6, 2, 64), BF16,
                            dict(kv_lengths=np.array([24, 9]), sliding_window=4), seed=6),
}

GRADIENT_CASES = {
    "sinks_chunk": AttentionCase((2, 3, 30, 6, 2, 80), F32, poison=True, seed=11,
                                 masking=dict(kv_lengths=np.array([30, 12]),
                                              attention_chunk_size=8, sinks=_sinks(6, 5))),
    "lengths_positions": AttentionCase(
        (2, 3, 30, 6, 2, 80), F32, poison=True, seed=11,
        masking=dict(kv_lengths=np.array([30, 12]),
                     q_positions=np.array([[22, 25, 29], [4, 8, 11]]))),
    "window_cap": AttentionCase((2, 3, 30, 6, 2, 80), F32, seed=11,
                                masking=dict(sliding_window=5, logits_soft_cap=4.0, causal=False)),
}


class TestAttentionPallasGpu(PallasGpu, AttentionCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    CASES = CASES
    NONFINITE_CASES = NONFINITE_CASES
    GRADIENT_CASES = GRADIENT_CASES

    def test_nan_in_a_visible_query_propagates(self):
        # NaN/inf in keys and values: test_nonfinite_reaches_only_the_queries_that_see_it.
        q, k, v = random_qkv(7, 2, 5, 40, 6, 3, 64, BF16)
        q = q.at[1, 2, 4, 7].set(np.nan)  # query 2, head 4 of sequence 1
        out = self.attention(q, k, v)
        assert_close_nan(out, attention_ref(q, k, v), dtype=BF16,
                         implementation=self.IMPLEMENTATION)

    def test_nan_scale_is_refused_before_the_kernel(self):
        q, k, v = random_qkv(8, 1, 4, 16, 2, 1, 64, F32)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            fj.attention(q, k, v, implementation=self.IMPLEMENTATION, scale=float("nan"))

    def test_queries_that_see_no_key_give_zeros(self):
        kw = dict(q_positions=np.array([[-5, -1, 0, 40], [3, 4, 5, 6]]),
                  kv_lengths=np.array([41, 0]))
        q, k, v = random_qkv(9, 2, 4, 41, 4, 2, 64, F16)
        k, v = poison_unseen(k, v, attention_mask_ref(2, 4, 41, **kw))
        out = self.attention(q, k, v, **kw)
        np.testing.assert_array_equal(f64(out[0, :2]), 0.0)
        np.testing.assert_array_equal(f64(out[1]), 0.0)
        assert_close(out[0, 2:], attention_ref(q, k, v, **kw)[0, 2:],
                     implementation=self.IMPLEMENTATION)

    def test_small_blocks_skip_masked_blocks(self):
        # 16-row/16-key blocks: rows of one program straddle queries, most K/V blocks lie
        # outside the window or past kv_lengths, where the slots hold NaN.
        kw = dict(kv_lengths=np.array([100, 37]), sliding_window=9, logits_soft_cap=3.0)
        q, k, v = random_qkv(10, 2, 13, 100, 6, 2, 80, F32)
        k, v = poison_unseen(k, v, attention_mask_ref(2, 13, 100, **kw))
        fn = functools.partial(flash.flash_attention, block_q=16, block_k=16,
                               interpret=self.INTERPRET)
        out = jcall(fn, q, k, v, **as_jnp(kw))
        assert_close(out, attention_ref(q, k, v, **kw), implementation=self.IMPLEMENTATION)


class TestAttentionPallasGpuInterpret(TestAttentionPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


# --- the contract with the CUDA lowering ---------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=case_id)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_supported_cases_lower_for_cuda(dtype, head_dim):
    args = dict(q=S((2, 5, 12, head_dim), dtype), k=S((2, 37, 4, head_dim), dtype),
                v=S((2, 37, 4, head_dim), dtype))
    assert flash.supports(args) is None
    exported = _compat.export_for_cuda(
        lambda q, k, v, lengths, pos: flash.flash_attention(
            q, k, v, kv_lengths=lengths, q_positions=pos, sliding_window=7,
            logits_soft_cap=5.0),
        *args.values(), S((2,), jnp.int32), S((2, 5), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("kw", [dict(sliding_window=128), dict(attention_chunk_size=64),
                                dict(causal=False, attention_chunk_size=64)],
                         ids=["gptoss_window", "llama4_chunk", "non_causal_chunk"])
def test_sinks_and_chunks_lower_for_cuda(kw):
    heads = GPT_OSS if "sliding_window" in kw else LLAMA4
    q, kv = S((1, 48, heads[0], heads[2]), BF16), S((1, 300, heads[1], heads[2]), BF16)
    sinks = S((heads[0],), F32)
    args = dict(q=q, k=kv, v=kv, sinks=sinks, **kw)
    assert fj.dispatch.registry.registrations("attention")  # (registered on import)
    assert flash.supports(args) is None
    exported = _compat.export_for_cuda(
        lambda q, k, v, s: flash.flash_attention(q, k, v, sinks=s, **kw), q, kv, kv, sinks)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("kw", [dict(), dict(causal=False), dict(kv_lengths=True)],
                         ids=["causal", "non_causal", "kv_lengths"])
def test_decode_and_gradients_lower_for_cuda(kw):
    q, kv = S((3, 1, 14, 64), jnp.bfloat16), S((3, 70, 2, 64), jnp.bfloat16)
    lengths = jnp.array([70, 5, 33], jnp.int32) if kw.pop("kv_lengths", False) else None

    def loss(q, k, v):
        out = flash.flash_attention(q, k, v, kv_lengths=lengths, **kw)
        return jnp.sum(out.astype(jnp.float32))

    _compat.export_for_cuda(lambda q, k, v: flash.flash_attention(q, k, v, kv_lengths=lengths,
                                                                  **kw), q, kv, kv)
    _compat.export_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)


def test_float32_dots_are_ieee_not_tf32(monkeypatch, capsys):
    # pallas_call(debug=True) prints the Triton IR; a float32 tt.dot must not ask for TF32.
    debug_pl = types.SimpleNamespace(**{n: getattr(flash.pl, n) for n in dir(flash.pl)
                                        if not n.startswith("__")})
    debug_pl.pallas_call = functools.partial(flash.pl.pallas_call, debug=True)
    monkeypatch.setattr(flash, "pl", debug_pl)
    x = S((1, 4, 2, 64), jnp.float32)
    _compat.export_for_cuda(flash.flash_attention, x, x, x)
    dots = [line for line in capsys.readouterr().out.splitlines() if "tt.dot" in line]
    assert len(dots) >= 2 and all("xf32>" in d for d in dots), dots
    assert not any("tf32" in d for d in dots), dots


@pytest.mark.parametrize("q_dtype,kv_dtype,head_dim,reason", [
    (jnp.int8, jnp.int8, 64, "q.dtype=int8"),
    (np.float64, np.float64, 64, "q.dtype=float64"),
    (jnp.bfloat16, jnp.float32, 64, "equal operand types"),
    (jnp.float32, jnp.float32, 1024, "head_dim=1024"),
], ids=["int8", "float64", "mixed", "head_dim_1024"])
def test_supports_rejects(q_dtype, kv_dtype, head_dim, reason):
    args = dict(q=S((1, 4, 2, head_dim), q_dtype), k=S((1, 8, 2, head_dim), kv_dtype),
                v=S((1, 8, 2, head_dim), kv_dtype))
    assert reason in flash.supports(args)


def test_mixed_dtypes_fail_the_lowering_when_forced():
    q, kv = S((1, 4, 2, 64), jnp.bfloat16), S((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="same element type"):
        _compat.export_for_cuda(flash.flash_attention, q, kv, kv)


def test_rejected_case_is_refused_by_name():
    q, k, v = random_qkv(13, 1, 4, 8, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(fj.ImplementationError, match="equal operand types"):
        fj.attention(q, k.astype(jnp.float32), v.astype(jnp.float32),
                     implementation="pallas_gpu_interpret")


def test_blocks_must_be_powers_of_two():
    x = S((1, 4, 2, 64), jnp.bfloat16)
    for bad in (dict(block_q=24), dict(block_k=8)):
        with pytest.raises(ValueError, match="power of two"):
            _compat.export_for_cuda(functools.partial(flash.flash_attention, **bad), x, x, x)


def test_launch_table():
    default = flash.TUNED["default"]
    assert flash.default_config({"q": np.empty((1, 1, 1, 80))}) == flash.Config(**default[128])
    assert flash.default_config({"q": np.empty((1, 1, 1, 8))}) == flash.Config(**default[64])
    assert flash.default_config({"q": np.empty((1, 1, 1, 256))}, "unknown GPU") == \
        flash.Config(**default[256])
    h100 = flash.TUNED["H100"]
    assert flash.default_config({"q": np.empty((1, 1, 1, 128))}, "NVIDIA H100 80GB HBM3") == \
        flash.Config(**h100[128])
    for kind in flash.TUNED:
        for knobs in flash.TUNED[kind].values():
            launch = flash.Config(**knobs)
            assert all(b >= _common.MIN_DOT and b & (b - 1) == 0
                       for b in (launch.block_q, launch.block_k))


def test_registered():
    names = fj.dispatch.implementations("attention")
    assert "pallas_gpu_interpret" in names
    assert flash.VERIFIED == {}
