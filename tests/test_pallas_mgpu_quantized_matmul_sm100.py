"""The Blackwell (tcgen05, tensor memory) quantized matmul
(pallas_kernels/gpu/mosaic_quantized_matmul_sm100.py), served by the "mosaic_gpu"
quantized_matmul record on compute capability 10.x: in the Mosaic GPU interpreter (JAX 0.12
or newer: 0.10's has no tensor memory) against float64 from the dequantized weights and
against XLA, at SmolLM2-135M's K (576, 1536) on 128 of a projection's output channels
(one program's M, to keep the interpreter affordable), decode rows (1-8, padded to 16) and
a prefill of two row tiles; what ``supports`` on a b200 accepts and refuses; and the
deviceless b200 compile of Llama-3-8B's MLP shapes without register spills, in a process of
its own (the first Mosaic GPU compile of a process fixes ptxas' architecture)."""

from __future__ import annotations

import textwrap

import jax
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
from forge_jax.pallas_kernels.gpu import _mosaic
from forge_jax.pallas_kernels.gpu import mosaic_quantized_matmul as mq
from forge_jax.pallas_kernels.gpu import mosaic_quantized_matmul_sm100 as sm100

INTERPRET = "mosaic_gpu_interpret"
NEEDS_TMEM_INTERPRETER = pytest.mark.skipif(
    not _mosaic.interpreter_has_tmem(),
    reason=f"JAX {jax.__version__}'s Mosaic GPU interpreter has no tensor memory (TMEM) or "
           "tcgen05 MMA: JAX 0.12 or newer runs these")

# name -> (leading shape of a, N, K, format, activation dtype, out_dtype).
CASES = {
    "decode 1 row int8 bf16 (smollm2 K)": ((1,), 128, SMOLLM_HIDDEN, "int8", jnp.bfloat16,
                                           None),
    "decode 5 rows fp8 f16 (smollm2 down_proj K)": ((1, 5), 128, SMOLLM_MLP, "fp8",
                                                    jnp.float16, jnp.float32),
    "prefill 136 rows int8 f16 (smollm2 K)": ((136,), 128, SMOLLM_HIDDEN, "int8",
                                              jnp.float16, jnp.float32),
}


def _inputs(lead, n, k, fmt, dtype, seed):
    q = fj.quantize(normal(rng(seed, n, k), (n, k), jnp.float32), fmt)
    return normal(rng(seed + 1, k), (*lead, k), dtype), q


@NEEDS_TMEM_INTERPRETER
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_and_xla_in_the_interpreter(name):
    lead, n, k, fmt, dtype, out_dtype = CASES[name]
    a, q = _inputs(lead, n, k, fmt, dtype, seed=len(name))
    c = normal(rng(3), (n,), jnp.float32)
    kw = dict(alpha=0.5, beta=2.0, c=c) if out_dtype is not None else dict(
        alpha=1.0, beta=0.0, c=None)
    got = mq.quantized_matmul(a, q, trans_b=True, out_dtype=out_dtype or dtype,
                              interpret=True, mma="tcgen05", **kw)
    assert _mosaic.races_found() is not True
    want = np.asarray(a.astype(jnp.float32), np.float64) @ qref.dequantize(q).T
    if out_dtype is not None:
        want = 0.5 * want + 2.0 * np.asarray(c, np.float64)
    assert got.dtype == (out_dtype or dtype) and got.shape == (*lead, n)
    assert_close(got, want, implementation=INTERPRET, err_msg=name)
    xla = fj.matmul(a, q, trans_b=True, out_dtype=out_dtype, implementation="xla",
                    **({} if out_dtype is None else kw))
    # XLA rounds q * scale to the activations' dtype before the product (the kernel
    # multiplies exact values and scales the float32 sum): the kernel is at least as close
    # to float64 as XLA is.
    got64 = np.asarray(got.astype(jnp.float32), np.float64)
    xla64 = np.asarray(xla.astype(jnp.float32), np.float64)
    assert np.abs(got64 - want).max() <= np.abs(xla64 - want).max() * 1.01 + 1e-6, name


@NEEDS_TMEM_INTERPRETER
def test_every_output_slot_is_written():
    # Tensor memory included: the interpreter fills it with NaN too.
    a, q = _inputs((3,), 128, 256, "int8", jnp.bfloat16, seed=11)
    assert_split_k_partials_written(sm100.quantized_matmul_transposed, a, q, rows=16,
                                    implementation=INTERPRET)


@pytest.mark.parametrize("fmt,kw,n,k,reason", [
    ("int4", {"group_size": 32}, 128, 512, "on Blackwell (tcgen05)"),
    ("fp8", {"block": (128, 128)}, 128, 512, "on Blackwell (tcgen05)"),
    ("int8", {}, 192, 128, "N=192 is not a multiple of 128"),
    ("int8", {}, 128, 96, "K=96 is not a multiple of 64"),
])
def test_supports_on_blackwell_rejects_with_the_reason(fmt, kw, n, k, reason):
    q = fj.quantize(jnp.ones((n, k), jnp.float32), fmt, **kw)
    args = fj.dispatch.bind("quantized_matmul", jnp.ones((2, k), jnp.bfloat16), q, trans_b=True)
    with fj.targets.use("b200"):
        assert reason in mq.supports(args)
    with pytest.raises(ValueError, match=reason.split(" ")[0]):
        mq.quantized_matmul(jnp.ones((2, k), jnp.bfloat16), q, trans_b=True, alpha=1.0,
                            beta=0.0, c=None, out_dtype=jnp.bfloat16, mma="tcgen05")


def test_supports_on_blackwell_accepts_per_channel_int8_and_fp8():
    for fmt in ("int8", "fp8"):
        q = fj.quantize(jnp.ones((256, 576), jnp.float32), fmt)
        args = fj.dispatch.bind("quantized_matmul", jnp.ones((3, 576), jnp.bfloat16), q,
                                trans_b=True)
        with fj.targets.use("b200"):
            assert mq.supports(args) is None, fmt
        with fj.targets.use("h100"):
            assert mq.supports(args) is None, fmt


# --- the deviceless b200 compile ------------------------------------------------------------

# name -> (rows of a, N, K, format): Llama-3-8B's gate/up (4096 -> 14336) and down (14336 ->
# 4096) projections at decode and a 128-row prefill tile.
COMPILE_CASES = {
    "llama3 up decode 1 row int8": (1, LLAMA3_8B_MLP, 4096, "int8"),
    "llama3 down decode 8 rows fp8": (8, 4096, LLAMA3_8B_MLP, "fp8"),
    "llama3 up prefill 128 rows int8": (128, LLAMA3_8B_MLP, 4096, "int8"),
}

_COMPILE = QUANTIZED_MATMUL_PRELUDE + textwrap.dedent("""
    out = {}
    for name, (m, n, k, fmt) in json.loads(sys.argv[1]).items():
        out[name] = compile_case("b200", m, n, k, fmt, "bfloat16")
    print("RESULT" + json.dumps(out))
""")


compiled = compiled_fixture(_COMPILE, COMPILE_CASES, "b200")


@pytest.mark.target("b200")
@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_accepted_cases_compile_for_b200_without_spills(compiled, name):
    m, n, kk, _ = COMPILE_CASES[name]
    rows = -(-m // sm100.tile_m(m)) * sm100.tile_m(m)  # padded to 16 (a tile)
    assert_one_kernel_without_spills(compiled[name], "forge_jax_mosaic_quantized_matmul_sm100",
                                     flops=2 * rows * n * kk, min_bytes=n * kk,
                                     smem_limit=sm100.SMEM_BYTES)
