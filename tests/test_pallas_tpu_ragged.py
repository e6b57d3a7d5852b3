"""The Pallas TPU (Mosaic) ragged paged attention kernel.

``TestRaggedTPU`` runs the kernel compiled on a TPU (``implementation="pallas"``);
``TestRaggedTPUInterpret`` runs the same tests in the TPU interpreter on CPU (race detection,
NaN-poisoned uninitialised memory). Steps come from test_ragged's ``make_step``: every slot no
query may see holds NaN (page tails, spare pages, slots a window hides from all of a
sequence's queries), ignored sequences' entries hold garbage, padding rows of ``q`` hold NaN.
Each result is compared with a float64 reference and with the op's XLA implementation.

The Mosaic lowering (``jax.export`` for TPU) runs here too: for the cases ``supports()``
accepts, and for the constraints the lowering enforces.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from reference import f64
from test_ragged import CASES, make_step, ragged_ref

import forge_jax as fj
from forge_jax import _compat, dispatch
from forge_jax.pallas_kernels.tpu import ragged_paged_attention as kernel_module

OP = "ragged_paged_attention"
MASKING = ("scale", "sliding_window", "logits_soft_cap", "implementation")
ragged = jax.jit(fj.ragged_paged_attention, static_argnames=MASKING)
HEAD_DIM = 128  # the kernel's lane width


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    _compat.reset_tpu_interpreter()


class TestRaggedTPU:
    IMPLEMENTATION = "pallas"

    @pytest.fixture(autouse=True)
    def _platform(self):
        if self.IMPLEMENTATION == "pallas" and jax.default_backend() != "tpu":
            pytest.skip("the compiled Mosaic kernel needs a TPU (the interpret subclass runs "
                        "the same tests on CPU)")

    def check(self, step, *, dtype, **masking):
        """The kernel against float64 and the XLA implementation; padding rows exactly 0."""
        out = ragged(*step.args(), implementation=self.IMPLEMENTATION, **masking)
        assert out.shape == step.q.shape and out.dtype == step.q.dtype
        ref = ragged_ref(step, scale=masking.get("scale"),
                         window=masking.get("sliding_window"),
                         cap=masking.get("logits_soft_cap"))
        assert_close(out, ref, dtype=dtype, implementation=self.IMPLEMENTATION)
        xla = ragged(*step.args(), implementation="xla", **masking)
        assert_close(out, f64(xla), dtype=dtype, implementation=self.IMPLEMENTATION,
                     allow_zero_ref=True)
        np.testing.assert_array_equal(f64(out)[step.cu_q_lens[step.num_seqs]:], 0.0)
        return out

    @pytest.mark.parametrize("mix,heads,dtype,q_dtype,page_size,masking", [
        ("decode", "gqa", jnp.float32, None, 8, {}),
        # 40 rows: several query blocks.
        ("prefill", "mqa", jnp.bfloat16, None, 16, dict(sliding_window=3, scale=0.2)),
        # bfloat16 cache, float32 queries.
        ("mixed", "gqa", jnp.bfloat16, jnp.float32, 16, dict(logits_soft_cap=2.0)),
        ("mixed", "mha", jnp.float32, None, 8, dict(sliding_window=5, logits_soft_cap=3.0)),
    ])
    def test_matches_references(self, mix, heads, dtype, q_dtype, page_size, masking):
        rng = np.random.default_rng(list(mix.encode()) + [page_size])
        window = masking.get("sliding_window")
        step = make_step(rng, **CASES[mix], page_size=page_size, heads=heads,
                         head_dim=HEAD_DIM, dtype=dtype, q_dtype=q_dtype, window=window)
        if mix == "mixed" and window is not None:  # slots no query sees hold NaN
            assert np.isnan(f64(step.k_pages)).sum() > np.isnan(f64(step.k_clean)).sum()
        self.check(step, dtype=q_dtype or dtype, **masking)

    def test_traced_num_seqs_one_compilation_serves_any_mix(self):
        traces = []

        @jax.jit
        def step_fn(*args):
            traces.append(1)
            return fj.ragged_paged_attention(*args, sliding_window=12,
                                             implementation=self.IMPLEMENTATION)

        rng = np.random.default_rng(7)
        shapes = dict(max_seqs=6, total_tokens=24, page_size=8, heads="gqa",
                      head_dim=HEAD_DIM, dtype=jnp.float32, pages_per_seq=6, num_pages=30)
        for q_lens, kv_lens in [([4, 1, 1], [4, 30, 9]), ([1, 1, 7, 1, 5, 1],
                                                          [40, 2, 7, 13, 25, 1])]:
            step = make_step(rng, q_lens, kv_lens, **shapes)
            assert_close(step_fn(*step.args()), ragged_ref(step, window=12),
                         dtype=jnp.float32, implementation=self.IMPLEMENTATION)
        step.num_seqs = 0  # nothing scheduled: every row is padding
        np.testing.assert_array_equal(f64(step_fn(*step.args())), 0.0)
        assert len(traces) == 1

    def test_non_finite_visible_value_gives_nan_only_where_seen(self):
        step = make_step(np.random.default_rng(9), q_lens=[3, 2], kv_lens=[3, 5], max_seqs=2,
                         total_tokens=5, page_size=8, heads="gqa", head_dim=HEAD_DIM,
                         dtype=jnp.float32)
        step.v_pages[0, step.block_tables[0, 0], 1, 3] = np.inf  # slot 1 of sequence 0
        nan = ~np.isfinite(f64(ragged(*step.args(), implementation=self.IMPLEMENTATION)))
        # Rows 1 and 2 see slot 1 through q heads 0..3 (kv head 0), in column 3 only.
        assert nan[1:3, :4, 3].all()
        nan[1:3, :4, 3] = False
        assert not nan.any()

    def test_out_of_range_values_under_jit_are_safe(self):
        step = make_step(np.random.default_rng(10), q_lens=[2, 3, 1], kv_lens=[9, 12, 5],
                         max_seqs=3, total_tokens=8, page_size=8, heads="gqa",
                         head_dim=HEAD_DIM, dtype=jnp.float32)
        q, k, v, tables, kv, cu, _ = step.args()
        bad = np.array(tables)
        bad[0, :2] = [-5, 1 << 30]  # read nothing: sequence 0 sees no key
        out = ragged(q, k, v, bad, kv, cu, np.int32(7), implementation=self.IMPLEMENTATION)
        assert_close(f64(out)[2:6], ragged_ref(step)[2:6], dtype=jnp.float32,
                     implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(out)[6:], 0.0)

    def test_small_blocks_many_kv_steps_and_query_blocks(self):
        """Knobs small enough that sequences span query blocks and several kv blocks (the
        double buffer alternates), a window skipping leading kv blocks."""
        step = make_step(np.random.default_rng(11), q_lens=[1, 20, 3, 1], kv_lens=[50, 33, 3, 64],
                         max_seqs=5, total_tokens=32, page_size=8, heads="gqa",
                         head_dim=HEAD_DIM, dtype=jnp.float32, window=17)
        out = kernel_module.ragged_paged_attention(
            *step.args(), scale=None, sliding_window=17, logits_soft_cap=None, block_q=8,
            kv_block=16, interpret=self.IMPLEMENTATION != "pallas")
        assert_close(out, ragged_ref(step, window=17), dtype=jnp.float32,
                     implementation=self.IMPLEMENTATION)
        np.testing.assert_array_equal(f64(out)[25:], 0.0)


class TestRaggedTPUInterpret(TestRaggedTPU):
    IMPLEMENTATION = "pallas_tpu_interpret"


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


REJECTED = {
    "head_dim": (_specs(head_dim=64), r"head_dim=64 is not a multiple of 128"),
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
