"""The Blackwell (tcgen05, tensor memory) flash-attention forward
(pallas_kernels/gpu/mosaic_attention_sm100.py), served by the "mosaic_gpu" attention record on
compute capability 10.x.

:class:`TestAttentionTcgen05Interpret` runs the behaviours of
:class:`cases.attention_base.AttentionCases` (float64 reference and XLA; NaN / +inf in every
slot no query sees; NaN / inf that some queries of a chunk see and others do not) through the
kernel in the Mosaic GPU interpreter, with race detection and NaN-poisoned uninitialised
memory (tensor memory included); only JAX 0.12's interpreter runs tensor memory, so it is
skipped on older JAX. :class:`TestAttentionTcgen05` runs them compiled on a Blackwell
(skipped without one). The gradient is the XLA reference's VJP, as for the Hopper kernel
(``tests/test_pallas_mgpu_attention.py`` checks it). The ``b200`` compile runs without a
device in a process of its own (the first Mosaic GPU compile of a process fixes ptxas'
architecture).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.attention_base import AttentionCase, AttentionCases, mosaic_nan_unseen_cases
from cases.base import MosaicGpu
from cases.calls import as_jnp, jit_attention
from cases.ptxas import compile_rows
from cases.shapes import LLAMA3_8B_HEADS, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import mosaic_attention as mosaic
from forge_jax.pallas_kernels.gpu._mosaic import (
    interpreter_has_tmem as _mosaic_interpreter_has_tmem,
)

BF16, F16 = jnp.bfloat16, jnp.float16
S = jax.ShapeDtypeStruct
# gpt-oss (64 query / 8 KV heads of 64: a group of 8) and Llama 4 (40 / 8 of 128: a group of
# 5), cut to one kv head.
GPT_OSS_GROUP, LLAMA4_GROUP = (8, 1, 64), (5, 1, 128)


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), jnp.float32)



class TestAttentionTcgen05(MosaicGpu, AttentionCases):
    """The tcgen05 kernel compiled on a Blackwell (compute capability 10.x)."""

    IMPLEMENTATION = "mosaic_gpu"
    INTERPRET = False
    MMA = "tcgen05"
    CASES = {
        # SmolLM2's 150 keys in tiles of 64: the last tile is read from key 86 (keys
        # already seen hidden); Llama 3's 70 keys padded to 72 for TMA's rows of 8.
        **mosaic_nan_unseen_cases(SMOLLM2_135M_HEADS, LLAMA3_8B_HEADS),
        # Causal, bottom-right aligned, two sequences and two kv heads, 2 x 3 query tiles of
        # 128 rows (SmolLM2's group of 3: 130 queries x 3 heads).
        "smollm2-causal-two_tiles": AttentionCase((2, 130, 200, 6, 2, 64), BF16,
                                                  dict(kv_lengths=np.array([200, 170])),
                                                  seed=3),
        # gpt-oss's sinks with its window, Llama 4's chunks (of 8192, scaled down to 16),
        # and both on SmolLM2's group with explicit positions, NaN / +inf where unseen.
        "gptoss-sinks-window-nan_unseen": AttentionCase(
            (1, 6, 40, *GPT_OSS_GROUP), BF16, dict(sliding_window=12, sinks=_sinks(8, 1)),
            poison=True, seed=12),
        "llama4-chunk-nan_unseen": AttentionCase(
            (1, 5, 57, *LLAMA4_GROUP), BF16,
            dict(attention_chunk_size=16, kv_lengths=np.array([53])), poison=True, seed=13),
        "non_causal-chunks-positions-sinks-nan_unseen": AttentionCase(
            (1, 4, 150, 3, 1, 64), F16,
            dict(causal=False, attention_chunk_size=48, sinks=_sinks(3, 3),
                 q_positions=np.array([[-3, 50, 60, 140]]), kv_lengths=np.array([145])),
            poison=True, seed=15),
    }
    NONFINITE_CASES = {
        "window": AttentionCase((1, 5, 24, 6, 2, 64), BF16,
                                dict(kv_lengths=np.array([21]), sliding_window=4), seed=6),
        "chunk_sinks": AttentionCase((1, 5, 24, 6, 2, 64), BF16,
                                     dict(kv_lengths=np.array([21]), attention_chunk_size=8,
                                          sinks=_sinks(6, 4)), seed=6),
    }
    # The VJP is the XLA reference's (checked for the Hopper kernel's record).
    test_gradients = None

    def attention(self, q, k, v, implementation=None, **masking):
        if implementation is not None:
            return jit_attention(q, k, v, implementation=implementation, **as_jnp(masking))
        return mosaic.flash_attention(q, k, v, mma="tcgen05", interpret=self.INTERPRET,
                                      **as_jnp(masking))


class TestAttentionTcgen05Interpret(TestAttentionTcgen05):
    """The same kernel in the Mosaic GPU interpreter (JAX 0.12+), on any machine."""

    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


def test_supports_on_blackwell():
    q, kv = S((1, 128, 32, 128), BF16), S((1, 128, 8, 128), BF16)
    wide = S((1, 128, 8, 256), BF16)
    with fj.targets.use("b200"):
        assert fj.explain("attention", q, kv, kv).rejected.get("mosaic_gpu", "").find(
            "could not serve") == -1
        args = dict(q=wide, k=wide, v=wide)
        assert "head_dim=256: the Blackwell kernel takes (64, 128)" in mosaic.supports(args)
        args = dict(q=q, k=S(kv.shape, F16), v=kv)
        assert "bfloat16 or float16, q, k and v alike" in mosaic.supports(args)
    with pytest.raises(ValueError, match="mma='mfma'"):
        mosaic.flash_attention(*(jnp.ones((1, 8, 2, 64), BF16),) * 3, mma="mfma")


@pytest.mark.target("b200")
@pytest.mark.parametrize("head_dim", [256, 512])
def test_wider_heads_are_refused_and_fail_the_b200_compile(head_dim):
    """Gemma 2's 256 and Gemma 4's 512 (8 / 4 heads): refused, and the b200 compile of the
    kernel forced past supports() fails on shared memory (330820 and 625732 bytes)."""
    q, kv = S((1, 256, 8, head_dim), BF16), S((1, 256, 4, head_dim), BF16)
    with fj.targets.use("b200"):
        assert f"head_dim={head_dim}: the Blackwell kernel takes" in mosaic.supports(
            dict(q=q, k=kv, v=kv))
    report = fj.aot.compile(lambda q, k, v: mosaic.flash_attention(q, k, v, mma="tcgen05"),
                            q, kv, kv, target="b200")
    assert not report.compiled and "exceeds available shared memory" in report.error
    assert int(re.search(r"smem_bytes=(\d+)", report.error).group(1)) > 232448


_B200_COMPILES = """
import json, re, jax, jax.numpy as jnp
import forge_jax as fj
from forge_jax.pallas_kernels.gpu import _mosaic
S = jax.ShapeDtypeStruct
for name, (batch, seq, q_heads, kv_heads, head_dim) in {cases}.items():
    q, kv = S((batch, seq, q_heads, head_dim), jnp.bfloat16), S(
        (batch, seq, kv_heads, head_dim), jnp.bfloat16)
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fj.attention, q, kv, kv, target="b200",
                                implementation="mosaic_gpu", sliding_window=1000)
    print(json.dumps(dict(
        name=name, compiled=report.compiled, error=report.error,
        kernels=[k.name for k in report.kernels],
        spills=[int(n) for ln in lines if "stack frame" in ln
                for n in re.findall(r"(\\d+) bytes spill stores", ln)],
        registers=[int(n) for ln in lines for n in re.findall(r"Used (\\d+) registers", ln)])))
"""
# (batch, seq, q_heads, kv_heads, head_dim): causal prefill at Llama-3-8B's and SmolLM2's heads.
B200_CASES = {"llama3_8b": (1, 4096, *LLAMA3_8B_HEADS), "smollm2": (2, 2048, *SMOLLM2_135M_HEADS)}


@pytest.mark.target("b200")
def test_prefill_compiles_for_b200_without_spills():
    rows = compile_rows(_B200_COMPILES.format(cases=B200_CASES), B200_CASES)
    for r in rows.values():
        assert r["compiled"] and r["kernels"] == [mosaic.mosaic_attention_sm100.NAME], r
        assert r["spills"] == [0] and len(r["registers"]) == 1 and r["registers"][0] < 255, r


_B200_SINKS_CHUNKS = """
import json, re, jax, jax.numpy as jnp
import forge_jax as fj
from forge_jax.pallas_kernels.gpu import _mosaic
S = jax.ShapeDtypeStruct
for name, (batch, q_len, kv_len, q_heads, kv_heads, head_dim, kw) in {cases}.items():
    q = S((batch, q_len, q_heads, head_dim), jnp.bfloat16)
    kv = S((batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
    sinks = S((q_heads,), jnp.float32) if kw.pop("sinks") else None
    fn = lambda q, k, v, s: fj.attention(q, k, v, sinks=s, implementation="mosaic_gpu", **kw)
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fn, q, kv, kv, sinks, target="b200")
    print(json.dumps(dict(
        name=name, compiled=report.compiled, error=report.error,
        kernels=[k.name for k in report.kernels],
        spills=[int(n) for ln in lines if "stack frame" in ln
                for n in re.findall(r"(\\d+) bytes spill stores", ln)],
        registers=[int(n) for ln in lines for n in re.findall(r"Used (\\d+) registers", ln)])))
"""
# (batch, q_len, kv_len, q_heads, kv_heads, head_dim, masking): gpt-oss's sinks and window,
# Llama 4's chunks (prefill, and decode with sinks too).
B200_SINK_CHUNK_CASES = {
    "gptoss-prefill-sinks-window": (1, 2048, 2048, 64, 8, 64,
                                    dict(sliding_window=128, sinks=True)),
    "llama4-prefill-chunk": (1, 2048, 2048, 40, 8, 128,
                             dict(attention_chunk_size=8192, sinks=False)),
    "llama4-decode-chunk-sinks": (3, 1, 4096, 40, 8, 128,
                                  dict(attention_chunk_size=8192, sinks=True)),
}


@pytest.mark.target("b200")
def test_sinks_and_chunks_compile_for_b200_without_spills():
    rows = compile_rows(_B200_SINKS_CHUNKS.format(cases=B200_SINK_CHUNK_CASES),
                        B200_SINK_CHUNK_CASES)
    for r in rows.values():
        assert r["compiled"] and r["kernels"] == [mosaic.mosaic_attention_sm100.NAME], r
        assert r["spills"] == [0] and len(r["registers"]) == 1 and r["registers"][0] < 255, r


def test_sink_values_nan_inf_and_no_keys():
    """A NaN or +inf sink makes its head's outputs NaN (a sink is visible to every query,
    also one that sees no key), a -inf sink is no sink, and a query that sees no key
    otherwise returns zeros, as the XLA implementation computes them."""
    if not _mosaic_interpreter_has_tmem():
        pytest.skip("the tcgen05 kernel's interpreter runs on JAX 0.12 or newer")
    sinks = _sinks(8, 5).at[1].set(jnp.nan).at[2].set(jnp.inf).at[3].set(-jnp.inf)
    q, k, v, _ = AttentionCase((2, 3, 40, *GPT_OSS_GROUP), BF16).inputs()
    lengths = jnp.array([37, 0])
    out = np.asarray(mosaic.flash_attention(q, k, v, kv_lengths=lengths, sinks=sinks,
                                            mma="tcgen05", interpret=True), np.float64)
    xla = np.asarray(fj.attention(q, k, v, implementation="xla", kv_lengths=lengths,
                                  sinks=sinks), np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(xla))
    assert np.isnan(out[:, :, 1:3]).all()
    np.testing.assert_array_equal(np.delete(out[1], [1, 2], axis=1), 0.0)
    finite = ~np.isnan(xla)
    np.testing.assert_allclose(out[finite], xla[finite], rtol=2e-2, atol=2e-2)
