"""The Mosaic GPU ragged paged attention kernel
(pallas_kernels/gpu/mosaic_ragged_paged_attention.py).

:class:`TestRaggedPagedAttentionMosaicGpu` runs the kernel compiled on a Hopper-or-newer GPU
(``"mosaic_gpu"``, skipped without one); :class:`TestRaggedPagedAttentionMosaicGpuInterpret`
runs the same tests in the Mosaic GPU interpreter on CPU (race detection asserted after each
test, NaN-poisoned uninitialised memory and outputs). The behaviours come from
:class:`cases.ragged_base.RaggedPagedAttentionCases`: steps from ``cases.paged.make_step``
(NaN in every slot no query may see, garbage in ignored sequences' entries, NaN in the padding
rows of ``q``), each result compared with a float64 reference and the op's XLA implementation.

The kernel is the paged kernel (tests/test_pallas_mgpu_paged.py) over the step's query
blocks; these tests check the blocks' bookkeeping on mixed steps, SmolLM2's 9/3 heads at
head_dim 64 and Llama-3's 32/8 at head_dim 128, kept small for the interpreter on two cores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import MosaicGpu
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import make_step
from cases.ptxas import NEEDS_H100, compile_h100
from cases.ragged_base import RaggedPagedAttentionCases
from cases.references import f64, ragged_paged_attention_ref

import forge_jax as fj
from forge_jax import _compat
from forge_jax.pallas_kernels.gpu import mosaic_ragged_paged_attention as kernel

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), jnp.float32)


class TestRaggedPagedAttentionMosaicGpu(MosaicGpu, RaggedPagedAttentionCases):
    IMPLEMENTATION = "mosaic_gpu"
    INTERPRET = False
    HEAD_DIM = 64
    DTYPE = BF16  # WGMMA takes float32 only as TF32
    CASES = {
        # Decode, chunked prefill and a sequence with no new token, SmolLM2's heads.
        "mixed-smollm2-bf16-window-cap": ("mixed", "smollm2", BF16, None, 8,
                                          dict(sliding_window=5, logits_soft_cap=3.0)),
        # Sinks and chunks at gpt-oss's (64 / 8) and Llama 4's (40 / 8) heads (head_dim 64
        # here), joined in the merge and masked per row; NaN outside every chunk.
        "mixed-gptoss-bf16-sinks-window": ("mixed", "gptoss", BF16, None, 16, dict(
            sliding_window=8, sinks=_sinks(64, 1))),
        "chunked_prefill-llama4-bf16-chunk": ("chunked_prefill", "llama4", BF16, None, 16,
                                              dict(attention_chunk_size=8)),
        "mixed-smollm2-f16-chunk12-sinks-cap": ("mixed", "smollm2", F16, None, 8, dict(
            attention_chunk_size=12, logits_soft_cap=3.0, sinks=_sinks(9, 2))),
    }


class TestRaggedPagedAttentionMosaicGpuInterpret(TestRaggedPagedAttentionMosaicGpu):
    IMPLEMENTATION = "mosaic_gpu_interpret"
    INTERPRET = True


def test_llama3_heads_mixed_step_in_the_interpreter():
    """Llama-3-8B's 32/8 heads at head_dim 128, float16: a decode token, a prefill chunk of
    20 rows (two query blocks of 16 tokens x 4 heads), a decode token at a page's last slot."""
    step = make_step(rng(26), q_lens=[1, 20, 1], kv_lens=[40, 29, 64], max_seqs=4,
                     total_tokens=24, page_size=16, heads="llama3", head_dim=128, dtype=F16)
    out = fj.ragged_paged_attention(*step.args(), implementation="mosaic_gpu_interpret")
    assert _compat.mosaic_gpu_races_found() is False
    assert_close(out, ragged_paged_attention_ref(step), dtype=F16,
                 implementation="mosaic_gpu_interpret")
    np.testing.assert_array_equal(f64(out)[22:], 0.0)


def _specs(*, tokens=32, heads=(9, 3), head_dim=64, page_size=16, dtype=BF16, q_dtype=None,
           max_seqs=4):
    pages = S((heads[1], 64, page_size, head_dim), dtype)
    return dict(q=S((tokens, heads[0], head_dim), q_dtype or dtype), k_pages=pages,
                v_pages=pages, block_tables=S((max_seqs, 16), jnp.int32),
                kv_lengths=S((max_seqs,), jnp.int32), cu_q_lens=S((max_seqs + 1,), jnp.int32),
                num_seqs=S((), jnp.int32))


# The launch compiles the several-positions path (it once spilled 48 bytes at head_dim 128);
# the paged kernel's tests compile the other dtype of each head config.
@NEEDS_H100
@pytest.mark.parametrize("heads,head_dim,dtype", [((32, 8), 128, BF16), ((9, 3), 64, F16)],
                         ids=["llama3-bf16", "smollm2-f16"])
def test_step_compiles_for_h100_without_spills(heads, head_dim, dtype):
    specs = _specs(heads=heads, head_dim=head_dim, dtype=dtype)
    assert kernel.supports(specs) is None
    report, spills, registers = compile_h100(
        fj.ragged_paged_attention, *specs.values(), implementation="mosaic_gpu",
        sliding_window=9, logits_soft_cap=30.0)
    assert report.compiled, report.error
    assert spills == [0] and len(registers) == 1, (spills, registers)


@pytest.mark.parametrize("specs,match", [
    (_specs(dtype=F32), "q.dtype=float32: the Mosaic"),
    (_specs(q_dtype=F16), "q.dtype=float16 differs"),
    (_specs(page_size=12), "page_size=12"),
    (_specs(head_dim=96), "head_dim=96"),
    (_specs(heads=(130, 2)), "q_heads // kv_heads = 65 > 64"),
    # The several-positions path spills registers past 128 (the paged kernel's tests show it).
    (_specs(heads=(16, 8), head_dim=256, tokens=8), "head_dim=256 with several query"),
    # Gemma 4's 512: one stage of its blocks overflows shared memory (the paged kernel's
    # lowering shows it).
    (_specs(heads=(8, 4), head_dim=512, tokens=8), "head_dim=512 is not a multiple of 64 up "
                                                   "to 256"),
], ids=["float32", "mixed_dtypes", "page_size", "head_dim", "group", "head_dim_256",
        "head_dim_512"])
def test_rejections_name_the_reason_and_dispatch_refuses(specs, match):
    """The paged kernel's limits (its tests show the lowering fail on the compile limits), and
    a GQA group wider than one tile."""
    assert match in (kernel.supports(specs) or "")
    args = [jnp.zeros(s.shape, s.dtype) for s in specs.values()]
    with pytest.raises(fj.ImplementationError, match=match.split(":")[0].split(" ")[0]):
        fj.ragged_paged_attention(*args, implementation="mosaic_gpu_interpret")


def test_registered_needs_hopper_and_is_not_auto_selected_until_verified():
    assert kernel.VERIFIED == {}
    assert "mosaic_gpu" in fj.dispatch.implementations("ragged_paged_attention", "gpu")
    assert "mosaic_gpu_interpret" in fj.dispatch.implementations("ragged_paged_attention")


@NEEDS_H100
@pytest.mark.parametrize("heads,head_dim,extra", [
    ((64, 8), 64, dict(sliding_window=128, sinks=S((64,), F32))),
    ((40, 8), 128, dict(attention_chunk_size=8192)),
], ids=["gptoss-sinks-window", "llama4-chunk"])
def test_sinks_and_chunks_compile_for_h100_without_spills(heads, head_dim, extra):
    specs = _specs(heads=heads, head_dim=head_dim)
    assert kernel.supports(dict(specs, **extra)) is None
    report, spills, registers = compile_h100(fj.ragged_paged_attention, *specs.values(),
                                             implementation="mosaic_gpu", **extra)
    assert report.compiled, report.error
    assert spills == [0] and len(registers) == 1 and registers[0] < 255, (spills, registers)
