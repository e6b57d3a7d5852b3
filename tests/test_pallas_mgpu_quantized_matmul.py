"""The Mosaic GPU quantized matmul (pallas_kernels/gpu/mosaic_quantized_matmul.py): in the
Mosaic GPU interpreter against float64 from the dequantized weights, on decode rows (1-8,
padded to WGMMA's 8) and prefill rows (tiles of 128) at SmolLM2-135M's K (576, 1536) and
N (192: its k/v projections; 64: one warpgroup's rows of a wider projection, to keep the
interpreter affordable); what ``supports`` rejects; and the deviceless H100 compile of
real-model cases (SmolLM2 576 -> 1536, Llama-3 8B 4096 -> 14336 and 14336 -> 4096, prefill
rows) without register spills, the rejections that are compile limits shown to fail there."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from cases import quant as qref
from cases.checks import assert_close, assert_split_k_partials_written
from cases.inputs import normal, rng
from cases.ptxas import (
    QUANTIZED_MATMUL_PRELUDE,
    assert_one_kernel_without_spills,
    compiled_fixture,
)
from cases.shapes import LLAMA3_8B_MLP, SMOLLM_HIDDEN, SMOLLM_MLP

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import mosaic_quantized_matmul as mq

INTERPRET = "mosaic_gpu_interpret"
SMOLLM_KV = 192  # SmolLM2-135M's k_proj / v_proj: 3 heads x 64
LLAMA3_HIDDEN = 4096

# name -> (leading shape of a, N, K, format (block), activation dtype, out_dtype).
CASES = {
    "decode 1 row int8 bf16 (smollm2 k_proj)": ((1,), SMOLLM_KV, SMOLLM_HIDDEN, "int8",
                                                jnp.bfloat16, None),
    "decode 5 rows fp8 f16 (smollm2 v_proj)": ((1, 5), SMOLLM_KV, SMOLLM_HIDDEN, "fp8",
                                               jnp.float16, jnp.float32),
    "decode 8 rows fp8 bf16 (smollm2 down_proj K)": ((8,), 64, SMOLLM_MLP, "fp8",
                                                     jnp.bfloat16, jnp.float32),
    "prefill 300 rows int8 f16 (smollm2 K)": ((300,), 64, SMOLLM_HIDDEN, "int8", jnp.float16,
                                              jnp.float32),
    "decode 3 rows fp8 blocks bf16 (smollm2 K)": ((3,), 128, SMOLLM_MLP, "fp8-blocks",
                                                  jnp.bfloat16, jnp.float32),
    "decode 2 rows int4 g32 bf16 (smollm2 k_proj)": ((2,), SMOLLM_KV, 512, "int4-g32",
                                                     jnp.bfloat16, jnp.float32),
    "prefill 136 rows int4 g64 min f16 (smollm2 K)": ((136,), 64, SMOLLM_MLP, "int4-g64-min",
                                                      jnp.float16, jnp.float32),
}
BLOCKS = {"fp8-blocks": ("fp8", {"block": (128, 128)}),
          "int4-g32": ("int4", {"group_size": 32}),
          "int4-g64-min": ("int4", {"group_size": 64, "symmetric": False})}


def _inputs(lead, n, k, fmt, dtype, seed):
    w = normal(rng(seed, n, k), (n, k), jnp.float32)
    fmt, kw = BLOCKS.get(fmt, (fmt, {}))
    q = fj.quantize(w, fmt, **kw)
    a = normal(rng(seed + 1, k), (*lead, k), dtype)
    return a, q


def _reference(a, q):
    if q.full_block() == (1, q.shape[1]):  # per channel: the scale applied after the sum
        w = qref.dequantize(q)
    else:  # a scale varying along K: the kernel rounds the dequantized tile, as XLA does
        w = qref.dequantize_rounded(q, a.dtype)
    return np.asarray(a.astype(jnp.float32), np.float64) @ w.T


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_in_the_interpreter(name):
    lead, n, k, fmt, dtype, out_dtype = CASES[name]
    a, q = _inputs(lead, n, k, fmt, dtype, seed=len(name))
    c = normal(rng(3), (n,), jnp.float32)
    # alpha, beta and a bias where the output is float32 (the XLA epilogue), plain else.
    kw = dict(alpha=0.5, beta=2.0, c=c) if out_dtype is not None else {}
    got = fj.matmul(a, q, trans_b=True, out_dtype=out_dtype, implementation=INTERPRET, **kw)
    assert fj.dispatch.last_selection("quantized_matmul").implementation == INTERPRET
    want = _reference(a, q)
    if kw:
        want = 0.5 * want + 2.0 * np.asarray(c, np.float64)
    assert got.dtype == (out_dtype or dtype) and got.shape == (*lead, n)
    assert_close(got, want, implementation=INTERPRET, err_msg=name)


def test_every_output_slot_is_written():
    a, q = _inputs((3,), 128, 256, "int8", jnp.bfloat16, seed=11)
    assert_split_k_partials_written(mq.quantized_matmul_transposed, a, q, rows=8,
                                    implementation=INTERPRET)


def _args(a, q, **kw):
    return fj.dispatch.bind("quantized_matmul", a, q, trans_b=True, **kw)


@pytest.mark.parametrize("a_dtype,fmt,kw,n,k,trans_b,reason", [
    (jnp.float32, "int8", {}, 64, 128, True, "a.dtype=float32"),
    (jnp.bfloat16, "int4", {"group_size": 128}, 64, 512, True, "groups of 32 or 64"),
    (jnp.bfloat16, "int4", {"group_size": 32}, 64, 192, True, "K=192 is not a multiple of 128"),
    (jnp.bfloat16, "int8", {"group_size": 32}, 64, 128, True, "one scale per output"),
    (jnp.bfloat16, "fp8", {"block": (128, 128)}, 128, 256, True, "512 <= K <= 32768"),
    (jnp.bfloat16, "int8", {}, 128, 64, False, "trans_b=False"),
    (jnp.bfloat16, "int8", {}, 96, 128, True, "N=96 is not a multiple of 64"),
    (jnp.bfloat16, "int8", {}, 64, 96, True, "K=96 is not a multiple of 64"),
    (jnp.bfloat16, "int8", {"activations": "int8"}, 64, 128, True, "(W8A8)"),
    (jnp.bfloat16, "mxfp4", {}, 64, 128, True, "not FP4 E2M1 codes"),
])
def test_supports_rejects_with_the_reason(a_dtype, fmt, kw, n, k, trans_b, reason):
    q = fj.quantize(jnp.ones((n, k), jnp.float32), fmt, **kw)
    a = jnp.ones((2, q.shape[1] if trans_b else q.shape[0]), a_dtype)
    args = fj.dispatch.bind("quantized_matmul", a, q, trans_b=trans_b)
    assert reason in mq.supports(args)


def test_minimums_are_rejected():
    q = fj.quantize(jnp.ones((64, 128), jnp.float32), "int8")
    q = fj.quant.from_parts(q.values, q.scales, q.scales, format="int8", block=q.block)
    assert "for int4 only" in mq.supports(_args(jnp.ones((1, 128), jnp.bfloat16), q))


def test_runs_on_hopper_by_name_only_until_verified():
    a, q = _inputs((1,), 64, 128, "int8", jnp.bfloat16, seed=1)
    args = _args(a, q)
    with fj.targets.use("h100"):
        assert fj.dispatch.select("quantized_matmul", args, "mosaic_gpu").implementation == \
            "mosaic_gpu"
        assert fj.dispatch.select("quantized_matmul", args).implementation == "xla"
    with fj.targets.use("a100"), pytest.raises(Exception, match="compute capability >= 9.0"):
        fj.dispatch.select("quantized_matmul", args, "mosaic_gpu")


def test_launch_choices():
    assert [mq.tile_m_for(m) for m in (1, 8, 9, 256, 257, 4096)] == [8, 8, 16, 256, 128, 128]
    # Decode: K split until the blocks fill the SMs, two steps a split at least.
    assert mq.split_for(24, 9, 132) == 3 and mq.split_for(224, 32, 132) == 1
    assert mq.split_for(1, 1, 132) == 1
    # The pipeline fits the shared memory with the epilogue's tile.
    for tile_m in (8, 128, 256):
        steps = mq.pipeline_steps(tile_m, 128, 1, 2, 4)
        stage = 64 * 128 + tile_m * 128 * 2
        assert steps >= 1 and steps * stage + 64 * tile_m * 4 <= mq.SMEM_BYTES


# --- the deviceless H100 compile -----------------------------------------------------------

# (rows, N, K, format, dtype): real-model projections, decode and prefill.
COMPILE_CASES = {
    "smollm2 576->1536 decode int8 bf16": (1, SMOLLM_MLP, SMOLLM_HIDDEN, "int8", "bfloat16"),
    "llama3 4096->14336 decode int8 bf16": (8, LLAMA3_8B_MLP, LLAMA3_HIDDEN, "int8",
                                            "bfloat16"),
    "llama3 14336->4096 decode fp8 f16": (4, LLAMA3_HIDDEN, LLAMA3_8B_MLP, "fp8", "float16"),
    "llama3 4096->4096 prefill 256 fp8 bf16": (256, LLAMA3_HIDDEN, LLAMA3_HIDDEN, "fp8",
                                               "bfloat16"),
    "llama3 4096->14336 prefill 2048 int8 f16": (2048, LLAMA3_8B_MLP, LLAMA3_HIDDEN, "int8",
                                                 "float16"),
    "llama3 4096->14336 decode fp8 blocks bf16": (1, LLAMA3_8B_MLP, LLAMA3_HIDDEN, "fp8-blocks",
                                                  "bfloat16"),
    "llama3 4096->4096 prefill 256 fp8 blocks bf16": (256, LLAMA3_HIDDEN, LLAMA3_HIDDEN,
                                                      "fp8-blocks", "bfloat16"),
    "llama3 4096->14336 decode int4 g32 bf16": (1, LLAMA3_8B_MLP, LLAMA3_HIDDEN, "int4-g32",
                                                "bfloat16"),
    "llama3 4096->4096 prefill 256 int4 g64 min bf16": (256, LLAMA3_HIDDEN, LLAMA3_HIDDEN,
                                                        "int4-g64-min", "bfloat16"),
    "smollm2 1536->576 decode 8 int4 g64 min f16": (8, SMOLLM_HIDDEN, SMOLLM_MLP,
                                                    "int4-g64-min", "float16"),
}
# The Mosaic GPU plugin writes the PTX and ptxas report (registers, spills) only where
# MOSAIC_GPU_DUMP_TO is set before the process's first Mosaic GPU compile: a child process.
_COMPILE = QUANTIZED_MATMUL_PRELUDE + textwrap.dedent("""
    out = {}
    for name, (m, n, k, fmt, dtype) in json.loads(sys.argv[1]).items():
        kw = {"fp8-blocks": {"block": (128, 128)}, "int4-g32": {"group_size": 32},
              "int4-g64-min": {"group_size": 64, "symmetric": False}}.get(fmt, {})
        out[name] = compile_case("h100", m, n, k, fmt.split("-")[0], dtype, **kw)
    S2 = lambda *s: S(s[:-1], s[-1])
    limits = {  # the kernel alone, past what supports() and the wrapper allow
        "float32 activations": ((8, 512, jnp.float32), dict(max_concurrent_steps=2)),
        "pipeline past shared memory": ((256, 512, jnp.bfloat16),
                                        dict(max_concurrent_steps=3)),
    }
    for name, ((m, k, dtype), kw) in limits.items():
        r = fj.aot.compile(mq.quantized_matmul_transposed, S2(m, k, dtype),
                           S2(128, k, jnp.int8), S2(128, jnp.float32), target="h100",
                           tile_k=128, split_k=1, **kw)
        out[name] = dict(compiled=r.compiled, error=r.error)
    print("RESULT" + json.dumps(out))
""")


compiled = compiled_fixture(_COMPILE, COMPILE_CASES, "h100")


@pytest.mark.target("h100")
@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_accepted_cases_compile_for_h100_without_spills(compiled, name):
    m, n, kk, fmt, _ = COMPILE_CASES[name]
    largest = mq.INT4_MAX_TILE_M if fmt.startswith("int4") else mq.MAX_TILE_M
    rows = mq.round_up(m, mq.tile_m_for(m, largest))  # WGMMA's rows: padded to 8 (a tile)
    stored = n * kk // (2 if fmt.startswith("int4") else 1)  # the weight's values
    assert_one_kernel_without_spills(compiled[name], "forge_jax_mosaic_quantized_matmul",
                                     flops=2 * rows * n * kk, min_bytes=stored,
                                     smem_limit=mq.SMEM_BYTES)


@pytest.mark.target("h100")
def test_rejections_that_are_compile_limits_fail_there(compiled):
    assert not compiled["float32 activations"]["compiled"]
    assert "A in registers" in compiled["float32 activations"]["error"]
    assert not compiled["pipeline past shared memory"]["compiled"]
    assert "shared memory" in compiled["pipeline past shared memory"]["error"]
    # ... and the wrapper's depth for that tile compiles (the cases above: 256 rows).
    assert mq.pipeline_steps(256, 128, 1, 2, 3) == 2

