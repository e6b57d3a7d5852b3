"""The Pallas TPU (Mosaic) ragged paged attention kernel
(pallas_kernels/tpu/ragged_paged_attention.py).

:class:`TestRaggedPagedAttentionPallasTpu` runs the kernel compiled on a TPU
(``implementation="pallas"``); :class:`TestRaggedPagedAttentionPallasTpuInterpret` runs the
same tests in the TPU interpreter on CPU (race detection, NaN-poisoned uninitialised memory).
The behaviours come from :class:`cases.ragged_base.RaggedPagedAttentionCases`: steps from
``cases.paged.make_step`` (NaN in every slot no query may see, garbage in ignored sequences'
entries, NaN in the padding rows of ``q``), each result compared with a float64 reference
and with the op's XLA implementation.

The Mosaic lowering (``jax.export`` for TPU) runs here too: for the cases ``supports()``
accepts, and for the constraints the lowering enforces.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.base import PallasTpu
from cases.checks import assert_close
from cases.inputs import rng
from cases.paged import make_step
from cases.ragged_base import RaggedPagedAttentionCases
from cases.references import f64, ragged_paged_attention_ref

import forge_jax as fj
from forge_jax import _compat, dispatch
from forge_jax.ops import kv_fold
from forge_jax.pallas_kernels.tpu import ragged_paged_attention as kernel_module

OP = "ragged_paged_attention"
HEAD_DIM = 128  # the kernel's lane width


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    _compat.reset_tpu_interpreter()


def _sinks(q_heads, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, q_heads), jnp.float32)


class TestRaggedPagedAttentionPallasTpu(PallasTpu, RaggedPagedAttentionCases):
    IMPLEMENTATION = "pallas"
    INTERPRET = False
    HEAD_DIM = HEAD_DIM
    CASES = {
        "decode-gqa-f32": ("decode", "gqa", jnp.float32, None, 8, {}),
        # 40 rows: several query blocks.
        "prefill-mqa-bf16-window": ("prefill", "mqa", jnp.bfloat16, None, 16,
                                    dict(sliding_window=3, scale=0.2)),
        # bfloat16 cache, float32 queries.
        "mixed-gqa-bf16_cache-f32_q-cap": ("mixed", "gqa", jnp.bfloat16, jnp.float32, 16,
                                           dict(logits_soft_cap=2.0)),
        "mixed-mha-f32-window-cap": ("mixed", "mha", jnp.float32, None, 8,
                                     dict(sliding_window=5, logits_soft_cap=3.0)),
        # Sinks and chunks at gpt-oss's (64 / 8) and Llama 4's (40 / 8) heads; chunks of a
        # power of two (a mask) and not (a vector remainder); NaN outside every chunk.
        "mixed-gptoss-bf16-sinks-window": ("mixed", "gptoss", jnp.bfloat16, None, 16, dict(
            sliding_window=8, sinks=_sinks(64, 1))),
        "chunked_prefill-llama4-bf16-chunk": ("chunked_prefill", "llama4", jnp.bfloat16, None,
                                              16, dict(attention_chunk_size=8)),
        "mixed-gqa-f32-chunk12-sinks-cap": ("mixed", "gqa", jnp.float32, None, 8, dict(
            attention_chunk_size=12, logits_soft_cap=3.0, sinks=_sinks(8, 2))),
    }

    def test_small_blocks_many_kv_steps_and_query_blocks(self):
        """Knobs small enough that sequences span query blocks and several kv blocks (the
        double buffer alternates), a window skipping leading kv blocks."""
        step = make_step(rng(11), q_lens=[1, 20, 3, 1], kv_lens=[50, 33, 3, 64],
                         max_seqs=5, total_tokens=32, page_size=8, heads="gqa",
                         head_dim=HEAD_DIM, dtype=jnp.float32, window=17)
        out = kernel_module.ragged_paged_attention(
            *step.args(), scale=None, sliding_window=17, logits_soft_cap=None, block_q=8,
            kv_block=16, interpret=self.INTERPRET)
        assert_close(out, ragged_paged_attention_ref(step, sliding_window=17),
                     dtype=jnp.float32, implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(out)[25:], 0.0)


class TestRaggedPagedAttentionPallasTpuInterpret(TestRaggedPagedAttentionPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


@pytest.mark.parametrize("head_dim", [64, 80])
def test_head_dims_off_the_lanes(head_dim):
    """head_dim 64 (SmolLM2, Llama-3.2-1B) and 80: once rejected as head_dim % 128, they
    compile for v5e/v6e (tests/test_aot.py); the interpreter against float64."""
    step = make_step(rng(12), q_lens=[1, 9, 1], kv_lens=[40, 20, 64], max_seqs=4,
                     total_tokens=16, page_size=16, heads="gqa", head_dim=head_dim,
                     dtype=jnp.bfloat16)
    specs = dict(zip(("q", "k_pages", "v_pages", "block_tables", "kv_lengths", "cu_q_lens",
                      "num_seqs"), step.args(), strict=True))
    assert kernel_module.supports(specs) is None
    out = fj.ragged_paged_attention(*step.args(), implementation="pallas_tpu_interpret")
    assert_close(out, ragged_paged_attention_ref(step), dtype=jnp.bfloat16,
                 implementation="pallas_tpu_interpret")


# --- Mosaic lowering (runs on any machine) -----------------------------------------------


def _specs(*, tokens=21, q_heads=8, kv_heads=2, head_dim=HEAD_DIM, num_pages=20, page_size=8,
           max_seqs=7, pages_per_seq=6, dtype=jnp.float32, q_dtype=None):
    s = jax.ShapeDtypeStruct
    pages = s((kv_heads, num_pages, page_size, head_dim), dtype)
    return dict(q=s((tokens, q_heads, head_dim), q_dtype or dtype), k_pages=pages,
                v_pages=pages, block_tables=s((max_seqs, pages_per_seq), jnp.int32),
                kv_lengths=s((max_seqs,), jnp.int32), cu_q_lens=s((max_seqs + 1,), jnp.int32),
                num_seqs=s((), jnp.int32))


def _export(specs, **knobs):
    masking = {k: knobs.pop(k, None) for k in ("scale", "sliding_window", "logits_soft_cap")}
    return _compat.export_for_tpu(
        lambda *a: kernel_module.ragged_paged_attention(*a, **masking, **knobs),
        *specs.values())


@pytest.mark.parametrize("specs,masking", [
    (_specs(), {}),
    (_specs(dtype=jnp.bfloat16, page_size=16, q_heads=4, kv_heads=1),
     dict(sliding_window=5, logits_soft_cap=3.0)),
    (_specs(dtype=jnp.bfloat16, q_dtype=jnp.float32, page_size=32, q_heads=4, kv_heads=4,
            tokens=300, head_dim=256), dict(scale=0.1)),
], ids=["f32-gqa", "bf16-mqa-window-cap", "bf16-cache-f32-q-mha-d256"])
def test_accepted_cases_lower_for_tpu(specs, masking):
    assert kernel_module.supports(specs) is None
    exported = _export(specs, **masking)
    assert exported.platforms == ("tpu",)
    assert "forge_jax_tpu_ragged_paged_attention" in exported.mlir_module()


@pytest.mark.parametrize("chunk", [64, 48], ids=["chunk64", "chunk48"])
def test_sinks_and_chunks_lower_for_tpu(chunk):
    specs = _specs(dtype=jnp.bfloat16, page_size=16, q_heads=40, kv_heads=8)
    sinks = jax.ShapeDtypeStruct((40,), jnp.float32)
    assert kernel_module.supports(specs | dict(sinks=sinks, attention_chunk_size=chunk)) is None
    exported = _compat.export_for_tpu(
        lambda *a: kernel_module.ragged_paged_attention(*a[:-1], sinks=a[-1],
                                                        attention_chunk_size=chunk),
        *specs.values(), sinks)
    assert "forge_jax_tpu_ragged_paged_attention" in exported.mlir_module()


REJECTED = {
    "page_size_f32": (_specs(page_size=4), r"page_size=4 is not a multiple of 8"),
    "page_size_bf16": (_specs(page_size=8, dtype=jnp.bfloat16), r"page_size=8.* of 16"),
    "float16": (_specs(dtype=jnp.float16), r"float16"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_rejections_name_the_reason_and_dispatch_refuses(case):
    specs, reason = REJECTED[case]
    assert kernel_module.supports(specs) is not None
    assert re.search(reason, kernel_module.supports(specs))
    args = {k: np.zeros(v.shape, v.dtype) for k, v in specs.items()}
    with pytest.raises(dispatch.ImplementationError, match=reason):
        fj.ragged_paged_attention(*args.values(), implementation="pallas_tpu_interpret")


@pytest.mark.parametrize("case", REJECTED)
def test_rejections_are_beyond_what_the_cpu_lowering_checks(case):
    """These constraints belong to Mosaic's layout passes, which run in libtpu when a TPU
    compiles the kernel, not in the lowering available here: forced, the lowering passes.
    Should a JAX release start to refuse them here, this fails and the case becomes a
    lowering-failure test like the one below."""
    _export(REJECTED[case][0])


def test_query_block_off_the_sublane_tiling_fails_lowering():
    """block_q is a knob, not an op argument: the defaults table and the wrapper keep it a
    multiple of 8 (16 for bfloat16); forced off that tiling, the Mosaic lowering refuses it."""
    with pytest.raises(ValueError, match=r"divisible by 8 and 128"):
        _export(_specs(), block_q=12)


def test_registered_as_pallas_on_tpu_and_interpret_by_name():
    names = {(impl.name, impl.platforms) for impl in dispatch.registrations(OP)}
    assert ("pallas", frozenset({"tpu"})) in names
    assert ("pallas_tpu_interpret", None) in names
    assert "pallas_tpu_interpret" not in [
        name for name, impl in dispatch.implementations(OP, "cpu").items() if impl.priority]


# --- folded pools (forge_jax/ops/kv_fold.py): 128-lane rows of 128 // head_dim tokens ------

@pytest.mark.parametrize("heads, head_dim, page_size, dtype, window", [
    ("smollm2", 64, 16, jnp.float32, None),  # SmolLM2's heads, two tokens per row
    ("gqa", 64, 16, jnp.bfloat16, 5),  # a window: hidden slots inside the copied pages
    ("mqa", 32, 32, jnp.float32, None),  # four tokens per row
], ids=["smollm2-f32", "gqa-bf16-window", "mqa-d32-f32"])
def test_folded_pools_are_read_in_place(heads, head_dim, page_size, dtype, window):
    """The kernel on folded pools against float64, NaN in every slot no query may see and
    in the padding rows of q (a decode row, a prefill chunk, a row seeing one key)."""
    step = make_step(rng(21), [1, 7, 1, 3], [30, 7, 1, 40], max_seqs=5, total_tokens=16,
                     page_size=page_size, heads=heads, head_dim=head_dim, dtype=dtype,
                     window=window)
    q, k, v, tables, kv_lengths, cu, num_seqs = step.args()
    k, v = kv_fold.fold(k), kv_fold.fold(v)
    assert kernel_module.supports(dict(q=q, k_pages=k.data, fold=k.fold)) is None
    out = fj.ragged_paged_attention(q, k, v, tables, kv_lengths, cu, num_seqs,
                                    sliding_window=window,
                                    implementation="pallas_tpu_interpret")
    rows = int(step.cu_q_lens[step.num_seqs])
    assert_close(out[:rows], ragged_paged_attention_ref(step, sliding_window=window)[:rows],
                 implementation="pallas_tpu_interpret")


def test_folded_pages_of_fewer_than_8_rows_are_rejected():
    q = jax.ShapeDtypeStruct((8, 4, 64), jnp.bfloat16)
    assert "folded is 4 rows of 2 tokens" in kernel_module.supports(
        dict(q=q, k_pages=jax.ShapeDtypeStruct((2, 8, 4, 128), jnp.bfloat16), fold=2))
