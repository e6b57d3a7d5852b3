"""The Blackwell (tcgen05, tensor memory) paged decode kernel
(pallas_kernels/gpu/mosaic_paged_attention_sm100.py), served by the "mosaic_gpu" paged record
on compute capability 10.x.

:class:`TestPagedDecodeTcgen05Interpret` runs the decode cases of
:class:`cases.paged_base.PagedAttentionCases` (float64 reference and XLA; NaN / inf in every
slot no query sees, huge integers in unused table entries) through the kernel in the Mosaic
GPU interpreter, with race detection and NaN-poisoned uninitialised memory (outputs and
tensor memory included). Only JAX 0.12's interpreter runs tensor memory and tcgen05 MMAs:
on older JAX it is skipped. :class:`TestPagedDecodeTcgen05` runs them compiled on a Blackwell
(skipped without one). The ``b200`` compile runs without a device in a process of its own:
the first Mosaic GPU compile of a process fixes the architecture ptxas is run for
(BENCHMARKS.md), and other test files in this worker compile for ``h100``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import MosaicGpu
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import paged_attention_args, paged_attention_specs
from cases.paged_base import PagedAttentionCases, PagedCase, nan_pools_under
from cases.ptxas import compile_rows
from cases.references import f64
from cases.shapes import LLAMA3_8B_HEADS, SMOLLM2_135M_HEADS

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention as kernel
from forge_jax.pallas_kernels.gpu import mosaic_paged_attention_sm100 as sm100

BF16, F16 = jnp.bfloat16, jnp.float16
NEEDS_TMEM_INTERPRETER = pytest.mark.skipif(
    not _mosaic.interpreter_has_tmem(),
    reason=f"JAX {jax.__version__}'s Mosaic GPU interpreter has no tensor memory (TMEM) or "
           "tcgen05 MMA: JAX 0.12 or newer runs these")


class TestPagedDecodeTcgen05(MosaicGpu, PagedAttentionCases):
    """The tcgen05 decode kernel compiled on a Blackwell (compute capability 10.x)."""

    IMPLEMENTATION = "mosaic_gpu"
    INTERPRET = False
    MMA = "tcgen05"
    CASES = {
        # Llama-3-8B heads, bfloat16: 21 pages, two splits of three 64-key blocks (the
        # interpreter's ring is two blocks deep: the copies wrap around it), and a sequence
        # of 3 keys ending inside its first page.
        "llama3_8b-bf16": PagedCase(*LLAMA3_8B_HEADS, 16, None, BF16, (330, 3)),
        # SmolLM2 9/3 heads, float16: window (leading blocks skipped), soft cap, an empty
        # sequence.
        "smollm2-f16-window-cap": PagedCase(*SMOLLM2_135M_HEADS, 8, None, F16, (13, 0, 150),
                                            window=70, cap=20.0),
        # gpt-oss's heads (64 / 8 of 64) with sinks, joined in the merge of the splits.
        "gptoss-bf16-sinks-window": PagedCase(64, 8, 64, 16, None, BF16, (150, 0, 40),
                                              window=24, sinks=True),
        # Llama 4's chunks (40 / 8 heads of 128; 8192 scaled down to 64): a decode query's
        # chunk starts its key range (the kernel is the one without chunks).
        "llama4-bf16-decode-chunk": PagedCase(40, 8, 128, 16, None, BF16, (150, 0, 40),
                                              chunk=64),
    }
    # Several positions (chunked prefill) stay on Hopper: the kernel refuses them.
    test_nonfinite_reaches_only_the_queries_that_see_it = None

    def paged_attention(self, q, k_pages, v_pages, tables, lengths, **kw):
        return kernel.paged_attention(q, k_pages, v_pages, jnp.asarray(tables),
                                      jnp.asarray(lengths, jnp.int32), mma="tcgen05",
                                      interpret=self.INTERPRET, **kw)


class TestPagedDecodeTcgen05Interpret(TestPagedDecodeTcgen05):
    """The same kernel in the Mosaic GPU interpreter (JAX 0.12+), on any machine."""

    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


@NEEDS_TMEM_INTERPRETER
def test_out_of_range_entries_read_nothing_and_lengths_clamp():
    """The index contract on the tcgen05 path: a used entry outside the pool (negative,
    num_pages, 2**30) reads nothing and a length past the table is clamped; the pool is NaN
    wherever no valid entry points. Against XLA's implementation of the contract."""
    gen = rng(26)
    num_pages, page, max_pages = 10, 16, 4  # under jit: lengths past the table clamp
    tables = np.array([[1, 99, 4, -7], [-1, 2, 2**30, -1], [5, num_pages, 3, 0]], np.int32)
    lengths = np.array([40, 20, 1000], np.int32)
    k, v = nan_pools_under(tables, lengths, num_pages=num_pages, page=page,
                           max_pages=max_pages, gen=gen)
    q = jnp.asarray(gen.standard_normal((3, 8, 64)), BF16)
    out = kernel.paged_attention(q, k, v, jnp.asarray(tables), jnp.asarray(lengths),
                                 mma="tcgen05", interpret=True)
    assert _mosaic.races_found() is not True
    xla = jax.jit(fj.paged_attention, static_argnames="implementation")(
        q, k, v, tables, lengths, implementation="xla")
    assert_close(out, f64(xla), dtype=BF16, implementation="mosaic_gpu_interpret")


# --- supports() on a 10.x device, and the b200 compile ---------------------------------------

def test_the_paged_record_serves_blackwell_decode_and_states_what_it_refuses():
    decode = paged_attention_args(paged_attention_specs(*LLAMA3_8B_HEADS, 16, None, BF16))
    chunk = paged_attention_args(paged_attention_specs(*LLAMA3_8B_HEADS, 16, 4, BF16))
    big_pages = paged_attention_args(paged_attention_specs(8, 2, 64, 256, None, BF16))
    with fj.targets.use("b200"):
        assert _mosaic.mma_kind() == "tcgen05" and _mosaic.mosaic_reason("gpu") is None
        assert kernel.supports(decode) is None
        assert "q_len=4: on Blackwell (tcgen05)" in kernel.supports(chunk)
        assert "page_size=256" in kernel.supports(big_pages)  # the Hopper ring's limit
    # Past it, its own: 256 float32 logits a thread spilled ~1 KB (b200 compile, forced).
    assert "b200 compile spills registers past 128" in sm100.reason(
        q_len=1, group=4, quantized=False, head_dim=64, page_size=256)
    with fj.targets.use("h100"):  # the Hopper kernel takes all three
        assert _mosaic.mma_kind() == "wgmma"
        assert kernel.supports(decode) is None and kernel.supports(chunk) is None
    with pytest.raises(ValueError, match="q_len=4: on Blackwell"):
        kernel.paged_attention(*[jnp.zeros(s.shape, s.dtype) for s in paged_attention_specs(
            8, 2, 64, 16, 4, BF16)], mma="tcgen05", interpret=True)
    with pytest.raises(ValueError, match="mma='mfma'"):
        kernel.paged_attention(*[jnp.zeros(s.shape, s.dtype) for s in paged_attention_specs(
            8, 2, 64, 16, None, BF16)], mma="mfma", interpret=True)


# Compiled for b200 in a subprocess (see the module docstring); each line of its output is one
# case's report as JSON.
_B200_COMPILES = """
import json, re, jax, jax.numpy as jnp
import forge_jax as fj
from forge_jax.pallas_kernels.gpu import _mosaic, mosaic_paged_attention as paged
S = jax.ShapeDtypeStruct
for name, (batch, q_heads, kv_heads, head_dim, page, context) in {cases}.items():
    pool = S((kv_heads, batch * context // page, page, head_dim), jnp.bfloat16)
    args = (S((batch, q_heads, head_dim), jnp.bfloat16), pool, pool,
            S((batch, context // page), jnp.int32), S((batch,), jnp.int32))
    with fj.targets.use("b200"):
        supported = paged.supports(fj.dispatch.bind("paged_attention", *args))
    with _mosaic.ptxas_report() as lines:
        report = fj.aot.compile(fj.paged_attention, *args, target="b200",
                                implementation="mosaic_gpu", sliding_window=4000,
                                logits_soft_cap=30.0)
    (row,) = [k for k in report.kernels if k.name.startswith("forge_jax_mosaic_paged")]
    print(json.dumps(dict(
        name=name, supported=supported, compiled=report.compiled, kernel=row.name,
        error=report.error, bytes=row.bytes_accessed, roofline_us=row.roofline_seconds * 1e6,
        spills=[int(n) for ln in lines if "stack frame" in ln
                for n in re.findall(r"(\\d+) bytes spill stores", ln)],
        registers=[int(n) for ln in lines for n in re.findall(r"Used (\\d+) registers", ln)])))
"""
# (batch, q_heads, kv_heads, head_dim, page_size, context): a Llama-3-8B decode shape,
# SmolLM2's heads, head_dim 256 with pages of 64.
B200_CASES = {
    "llama3_8b": (32, *LLAMA3_8B_HEADS, 16, 4096),
    "smollm2": (32, *SMOLLM2_135M_HEADS, 16, 2048),
    "head_dim_256": (8, 32, 8, 256, 64, 4096),
}


@pytest.mark.target("b200")
def test_decode_compiles_for_b200_without_spills_with_its_cost():
    rows = compile_rows(_B200_COMPILES.format(cases=B200_CASES), B200_CASES)
    for name, (batch, _, kv_heads, head_dim, _, context) in B200_CASES.items():
        r = rows[name]
        assert r["supported"] is None and r["compiled"], r
        assert r["kernel"] == "forge_jax_mosaic_paged_attention_sm100", r
        # One kernel, no spill, fewer than the 255 registers a thread may hold.
        assert r["spills"] == [0] and len(r["registers"]) == 1 and r["registers"][0] < 255, r
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        assert kv_bytes <= r["bytes"] < 1.05 * kv_bytes, r
        assert r["roofline_us"] == pytest.approx(
            r["bytes"] / fj.targets.get("b200").memory_bandwidth * 1e6), r
