"""Deviceless compiles with the real compilers (forge_jax.aot, the ``aot`` extra): each
kernel's supports()-accepted cases compile for ``h100`` (XLA GPU, Triton, ptxas) and
``tpu-v5e`` (libtpu's Mosaic), a sample of them for ``a100`` (the Triton lowering's Ampere
path) and ``tpu-v6e``; rejections that are compile limits fail that compile; the tiny
model's prefill and paged decode steps compile for both with the kernels selected, and the
compiled decode step holds no copy of the page pool.

A few representative shapes per kernel (CI's time is short). Skipped where the extra is
absent. libtpu allows one process at a time: run this module in one process."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest
from cases import shapes
from cases.cli import assert_one_line_error
from cases.cli import run as cli_run

import forge_jax as fj
from forge_jax.generation import abstract_steps as aot_steps
from forge_jax.models import llama
from forge_jax.ops import kv_fold
from forge_jax.ops.quantized_matmul import quantized_matmul
from forge_jax.pallas_kernels.gpu import attention as gpu_attention
from forge_jax.pallas_kernels.gpu import paged_attention as gpu_paged
from forge_jax.pallas_kernels.tpu import attention as tpu_attention
from forge_jax.pallas_kernels.tpu import paged_attention as tpu_paged
from forge_jax.pallas_kernels.tpu import quantized_matmul as tpu_quantized_matmul

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _needs(target):
    return pytest.mark.target(target)


GPU, TPU = _needs("h100"), _needs("tpu-v5e")
NEEDS = {"h100": GPU, "a100": GPU, "tpu-v5e": TPU, "tpu-v6e": TPU, "tpu-v4": TPU}


def _paged(dtype, batch, heads, head_dim, *, q_len=None, pages=64, page_size=16, per_seq=16):
    q_heads, kv_heads = heads
    q = S((batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim),
          dtype)
    pool = S((kv_heads, pages, page_size, head_dim), dtype)
    return q, pool, pool, S((batch, per_seq), jnp.int32), S((batch,), jnp.int32)


def _ragged(dtype, tokens, seqs, heads, head_dim, *, pages=64, page_size=16, per_seq=16):
    q_heads, kv_heads = heads
    pool = S((kv_heads, pages, page_size, head_dim), dtype)
    return (S((tokens, q_heads, head_dim), dtype), pool, pool, S((seqs, per_seq), jnp.int32),
            S((seqs,), jnp.int32), S((seqs + 1,), jnp.int32), S((), jnp.int32))


def _w8a8(m, n, k, dtype=BF16):
    """A decode or prefill product with an int8 weight ``[n, k]`` (per-channel scales) asking
    for int8 activations (W8A8: the TPU's int8 MXU)."""
    w = fj.QuantizedArray(S((n, k), jnp.int8), S((n, 1), F32), None, "int8", (k,),
                          activations="int8")
    return (S((m, k), dtype), w)


def _qweight(fmt, n, k, group=None, asymmetric=False):
    """An abstract int8 ``[n, k]`` or packed int4 weight with float32 scales per ``group``
    (default: per output channel) and, ``asymmetric``, minimums."""
    group = group or k
    values = S((n, k // 2), jnp.uint8) if fmt == "int4" else S((n, k), jnp.int8)
    scales = S((n, k // group), F32)
    return fj.QuantizedArray(values, scales, scales if asymmetric else None, fmt, (group,))


def _quantized(args, format):
    """``args`` with the K and V pools (``args[1:3]``) as int8/fp8 pools of their shape: values
    and a float32 scale per token and KV head (forge_jax/ops/kv_quant.py)."""
    pool = args[1]
    values = jnp.int8 if format == "int8" else jnp.float8_e4m3fn
    quantized = fj.QuantizedArray(S(pool.shape, values), S(pool.shape[:3] + (1,), F32), None,
                                  format, (pool.shape[3],), pool.dtype)
    return (args[0], quantized, quantized, *args[3:])


def _folded(args):
    """``args`` with the K and V pools (``args[1:3]``) folded: 128-lane rows of 128 //
    head_dim tokens (forge_jax/ops/kv_fold.py)."""
    h, n, page_size, head_dim = args[1].shape
    fold = 128 // head_dim
    pool = kv_fold.FoldedPages(S((h, n, page_size // fold, 128), args[1].dtype), head_dim)
    return (args[0], pool, pool, *args[3:])


LLAMA = shapes.LLAMA3_8B_HEADS
SMOL = shapes.SMOLLM2_135M_HEADS
GEMMA4 = shapes.GEMMA4_HEADS


def _attention(q_len, heads, dtype):
    q_heads, kv_heads, d = heads
    return (S((1, q_len, q_heads, d), dtype), S((1, q_len, kv_heads, d), dtype),
            S((1, q_len, kv_heads, d), dtype))


# (op, its abstract arguments, its keyword arguments), each compiled with the "pallas"
# implementation, which supports() must accept on the target.
KERNEL_CASES = {
    "rms_norm smollm bf16": ("rms_norm", (S((64, shapes.SMOLLM_HIDDEN), BF16),
                                          S((shapes.SMOLLM_HIDDEN,), BF16)), dict(eps=1e-5)),
    "rms_norm residual f32": (
        "rms_norm", (S((16, shapes.LLAMA32_1B_HIDDEN), F32), S((shapes.LLAMA32_1B_HIDDEN,), F32)),
        dict(eps=1e-5, residual=S((16, shapes.LLAMA32_1B_HIDDEN), F32))),
    "rope llama bf16": ("rope", (S((1, 64, 32, 128), BF16), S((1, 64), jnp.int32)),
                        dict(theta=shapes.LLAMA31_THETA)),
    # 168 registers and 24-36 bytes spilled with 4 warps; the H100 row's 8 do not spill.
    "rope smollm prefill bf16": ("rope", (S((8, 128, SMOL[0], SMOL[2]), BF16),
                                          S((8, 128), jnp.int32)), dict(theta=shapes.SMOLLM_THETA)),
    # RoPE scalings: yarn's multiplier on cos/sin (Qwen3's 4x over 32768), longrope's
    # frequencies picked by the call's largest position (Phi-3.5's 96-pair tables).
    "rope qwen3 yarn bf16": ("rope", (S((1, 64, 16, 128), BF16), S((1, 64), jnp.int32)), dict(
        theta=1e6, scaling=fj.RopeScaling("yarn", 4.0, original_max_position_embeddings=32768))),
    "rope phi3 longrope bf16": ("rope", (S((1, 64, 32, 96), BF16), S((1, 64), jnp.int32)), dict(
        theta=1e4, scaling=fj.RopeScaling("longrope", 32.0, original_max_position_embeddings=4096,
                                          short_factor=(1.0,) * 48, long_factor=(2.0,) * 48))),
    "silu_mul smollm bf16": ("silu_mul", (S((64, shapes.SMOLLM_MLP), BF16),) * 2, {}),
    "attention llama bf16": ("attention", _attention(256, LLAMA, BF16), dict(causal=True)),
    # TPU: three heads of 64 folded into one 192-lane row (once rejected: head_dim % 128).
    "attention smollm bf16": ("attention", _attention(256, SMOL, BF16), dict(causal=True)),
    "paged decode llama bf16": ("paged_attention", _paged(BF16, 4, LLAMA[:2], LLAMA[2]), {}),
    "paged decode llama f32": ("paged_attention", _paged(F32, 4, LLAMA[:2], LLAMA[2]), {}),
}
GPU_CASES = {
    **KERNEL_CASES,
    "paged decode smollm bf16": ("paged_attention", _paged(BF16, 4, SMOL[:2], SMOL[2]), {}),
    # Before TUNED_FLOAT32: "Shared memory size limit exceeded: requested 262656".
    "attention phi2 f32": ("attention", _attention(256, (8, 8, shapes.PHI2_HEAD_DIM), F32),
                           dict(causal=True)),
    "attention llama f32": ("attention", _attention(256, LLAMA, F32), dict(causal=True)),
    # Attention sinks and chunked attention: gpt-oss's heads (64 / 8 of 64) with its window
    # of 128, Llama 4's (40 / 8 of 128) with chunks (8192 in the model, 64 here).
    "attention gptoss sinks window bf16": (
        "attention", _attention(256, (64, 8, 64), BF16),
        dict(causal=True, sliding_window=128, sinks=S((64,), F32))),
    "attention llama4 chunk bf16": ("attention", _attention(256, (40, 8, 128), BF16),
                                    dict(causal=True, attention_chunk_size=64)),
    "paged decode gptoss sinks window bf16": ("paged_attention", _paged(
        BF16, 4, (64, 8), 64), dict(sliding_window=128, sinks=S((64,), F32))),
    "paged chunk llama4 chunk bf16": ("paged_attention", _paged(
        BF16, 2, (40, 8), 128, q_len=16), dict(attention_chunk_size=64)),
}
# Gemma 4's head_dim 512 (its full layers' width, and its KV cache's): every attention
# kernel supports() accepts there, unscaled as Gemma 4 calls them, its window scaled down.
GEMMA4_CASES = {
    "attention gemma4 512 window bf16": ("attention", _attention(256, GEMMA4, BF16),
                                         dict(causal=True, scale=1.0, sliding_window=128)),
    "attention gemma4 512 f32": ("attention", _attention(256, GEMMA4, F32),
                                 dict(causal=True, scale=1.0)),
    "paged decode gemma4 512 bf16": ("paged_attention", _paged(BF16, 4, GEMMA4[:2], 512),
                                     dict(scale=1.0)),
    "paged decode gemma4 512 f32": ("paged_attention", _paged(F32, 4, GEMMA4[:2], 512),
                                    dict(scale=1.0)),
    "paged chunk gemma4 512 window bf16": ("paged_attention", _paged(
        BF16, 2, GEMMA4[:2], 512, q_len=16), dict(scale=1.0, sliding_window=128)),
    "paged chunk gemma4 512 f32": ("paged_attention", _paged(
        F32, 2, GEMMA4[:2], 512, q_len=16), dict(scale=1.0)),
}
GPU_CASES |= GEMMA4_CASES
TPU_CASES = {
    **KERNEL_CASES,
    # 9 x 64 = 576 lanes, not a multiple of 128: once rejected, it compiles (the kernel's
    # tail chunk).
    "rope smollm bf16": ("rope", (S((1, 64, SMOL[0], SMOL[2]), BF16), S((1, 64), jnp.int32)),
                         dict(theta=shapes.SMOLLM_THETA)),
    # head_dim 64: once rejected (head_dim % 128), libtpu compiles it.
    "paged decode smollm bf16": ("paged_attention", _paged(BF16, 4, SMOL[:2], SMOL[2]), {}),
    "ragged smollm bf16": ("ragged_paged_attention", _ragged(BF16, 32, 4, SMOL[:2], SMOL[2]),
                           {}),
    # Quantized KV pools (pages of 32 tokens: int8's sublane tile); compiled for v5e with
    # libtpu 0.0.42.1, JAX 0.10.2, 2026-11-25.
    "paged decode smollm int8 kv": ("paged_attention", _quantized(
        _paged(BF16, 4, SMOL[:2], SMOL[2], page_size=32), "int8"), {}),
    "ragged llama fp8 kv": ("ragged_paged_attention", _quantized(
        _ragged(BF16, 32, 4, LLAMA[:2], LLAMA[2], page_size=32), "fp8"), {}),
    # Folded pools (forge_jax.ops.kv_fold): SmolLM2's pages of 16 tokens of 64 as 8 rows of
    # 128 lanes, read in place.
    "paged decode smollm bf16 folded": ("paged_attention", _folded(
        _paged(BF16, 4, SMOL[:2], SMOL[2])), {}),
    "paged chunk smollm f32 folded": ("paged_attention", _folded(
        _paged(F32, 2, SMOL[:2], SMOL[2], q_len=4)), dict(sliding_window=9)),
    "ragged smollm bf16 folded": ("ragged_paged_attention", _folded(
        _ragged(BF16, 32, 4, SMOL[:2], SMOL[2])), {}),
    "ragged smollm f32 folded": ("ragged_paged_attention", _folded(
        _ragged(F32, 32, 4, SMOL[:2], SMOL[2])), dict(sliding_window=9)),
    # W8A8 on the int8 MXU: SmolLM2's down projection at decode, its up projection at
    # prefill (the Mosaic module's matmul is int8 x int8 -> int32:
    # tests/test_pallas_tpu_quantized_matmul.py). Compiled for v5e and v6e with libtpu
    # 0.0.42.1, JAX 0.10.2, 2026-11-25.
    "w8a8 decode smollm down": ("quantized_matmul", _w8a8(1, 576, 1536), dict(trans_b=True)),
    "w8a8 prefill smollm up": ("quantized_matmul", _w8a8(128, 1536, 576), dict(trans_b=True)),
    "paged chunk llama bf16": ("paged_attention",
                               _paged(BF16, 2, LLAMA[:2], LLAMA[2], q_len=16), {}),
    "ragged llama bf16": ("ragged_paged_attention", _ragged(BF16, 32, 4, LLAMA[:2], LLAMA[2]),
                          {}),
    # Attention sinks and chunked attention at gpt-oss's and Llama 4's heads.
    "attention gptoss sinks window bf16": GPU_CASES["attention gptoss sinks window bf16"],
    "attention llama4 chunk bf16": GPU_CASES["attention llama4 chunk bf16"],
    "ragged gptoss sinks window bf16": ("ragged_paged_attention", _ragged(
        BF16, 32, 4, (64, 8), 64), dict(sliding_window=128, sinks=S((64,), F32))),
    "ragged llama4 chunk bf16": ("ragged_paged_attention", _ragged(BF16, 32, 4, (40, 8), 128),
                                 dict(attention_chunk_size=64)),
    "paged decode gptoss sinks window bf16": GPU_CASES["paged decode gptoss sinks window bf16"],
    "paged chunk llama4 chunk bf16": GPU_CASES["paged chunk llama4 chunk bf16"],
    # A chunk that is not a power of two: the chunk start by a vector remainder.
    "ragged llama4 chunk48 f32": ("ragged_paged_attention", _ragged(F32, 32, 4, (40, 8), 128),
                                  dict(attention_chunk_size=48)),
    # Llama-3.2-1B's decode (32/8 heads of 64): pairs of heads folded into 128 lanes.
    "attention decode llama32 bf16": ("attention", (S((1, 1, 32, 64), BF16),
                                                    S((1, 1000, 8, 64), BF16),
                                                    S((1, 1000, 8, 64), BF16)),
                                      dict(causal=True)),
    **GEMMA4_CASES,
    "ragged gemma4 512 window bf16": ("ragged_paged_attention", _ragged(
        BF16, 32, 4, GEMMA4[:2], 512), dict(scale=1.0, sliding_window=128)),
    "ragged gemma4 512 f32": ("ragged_paged_attention", _ragged(F32, 32, 4, GEMMA4[:2], 512),
                              dict(scale=1.0)),
}

# Compiled for a100 only (the Triton path of quantized_matmul is Ampere's; Hopper has the
# Mosaic GPU kernel): SmolLM2's projections at decode and prefill, each dtype table's tiles.
A100_CASES = {
    "qmm int8 decode smollm bf16": ("quantized_matmul", (S((1, 1536), BF16),
                                                         _qweight("int8", 576, 1536)),
                                    dict(trans_b=True)),
    "qmm int4 g32 decode smollm bf16": ("quantized_matmul", (S((1, 576), BF16),
                                                             _qweight("int4", 1536, 576, 32)),
                                        dict(trans_b=True)),
    "qmm int4 g32 asym prefill smollm bf16": (
        "quantized_matmul", (S((128, 576), BF16), _qweight("int4", 1536, 576, 32, True)),
        dict(trans_b=True)),
    "qmm int4 g128 asym prefill smollm f32": (
        "quantized_matmul", (S((128, 1536), F32), _qweight("int4", 576, 1536, 128, True)),
        dict(trans_b=True)),
}
GPU_CASES_A100 = {**GPU_CASES, **A100_CASES}

# The other generations: a sample of the cases (each dtype, head_dim 64 and 128, prefill and
# decode shapes), compiled again for a100 (the Triton lowering's Ampere path) and tpu-v6e.
SWEEP = [("h100", n) for n in sorted(GPU_CASES)] + [("a100", n) for n in (
    "rms_norm residual f32", "rope smollm prefill bf16", "silu_mul smollm bf16",
    "attention smollm bf16", "attention llama bf16", "paged decode smollm bf16", *A100_CASES,
    "attention gemma4 512 window bf16", "attention gemma4 512 f32", "paged decode gemma4 512 f32",
    "paged chunk gemma4 512 window bf16")]
TPU_SWEEP = [("tpu-v5e", n) for n in sorted(TPU_CASES)] + [("tpu-v6e", n) for n in (
    "rms_norm residual f32", "rope smollm bf16", "silu_mul smollm bf16", "attention llama bf16",
    "attention smollm bf16", "paged decode smollm bf16", "paged decode llama f32",
    "ragged smollm bf16", "paged chunk llama bf16", "paged decode smollm bf16 folded",
    "paged chunk smollm f32 folded", "ragged smollm bf16 folded", "ragged smollm f32 folded",
    "w8a8 decode smollm down", "attention gemma4 512 window bf16", "ragged gemma4 512 window bf16")]

# Register spills ptxas reports, by (target, case): bytes spilled, at most. Each is a
# finding to fix; a case not named here must not spill.
KNOWN_SPILLS = {
    ("h100", "paged decode llama f32"): 4096,
    # The chunk's mask on 80 rows of head_dim 128 (255 registers): 240 bytes; the same call
    # without the chunk spills nothing (forge_jax.aot, JAX 0.10.2, 2026-11-28).
    ("h100", "paged chunk llama4 chunk bf16"): 240,
}


def _compile(case, target):
    op, args, kwargs = case
    with fj.targets.use(target):
        # supports() accepts the case on the target (strict: else ImplementationError).
        assert fj.dispatch.select(op, fj.dispatch.bind(op, *args, **kwargs),
                                  "pallas").implementation == "pallas"
    fn = quantized_matmul if op == "quantized_matmul" else getattr(fj, op)
    report = fj.aot.compile(fn, *args, target=target, implementation="pallas", **kwargs)
    assert report.compiled, report.error
    assert report.kernels, f"no pallas_call compiled for {op}"
    # Every pallas_call carries a cost estimate (the roofline's flops and bytes).
    assert all(k.costed and k.flops > 0 and k.bytes_accessed > 0 for k in report.kernels), \
        report.kernels
    return report


@pytest.mark.parametrize("target, name", [pytest.param(t, n, marks=NEEDS[t])
                                          for t, n in SWEEP])
def test_gpu_kernels_compile(target, name):
    report = _compile(GPU_CASES_A100[name], target)
    limit = fj.targets.get(target).gpu["shared_memory_per_block_optin"]
    for k in report.kernels:
        assert k.registers is not None and k.grid is not None, k  # ptxas and thunks read
        assert 0 < k.shared_memory <= limit or k.shared_memory == 0, k
        assert k.spilled_bytes <= KNOWN_SPILLS.get((target, name), 0), (name, k)


@pytest.mark.parametrize("target, name", [pytest.param(t, n, marks=NEEDS[t])
                                          for t, n in TPU_SWEEP])
def test_tpu_kernels_compile(target, name):
    report = _compile(TPU_CASES[name], target)
    assert report.memory["generated_code"] > 0


def _forced_paged(dtype, page_size):
    return _paged(dtype, 4, SMOL[:2], 128, page_size=page_size)


# Rejections that are compile limits: (target, op, the kernel called past supports(), its
# arguments, supports()' reason, the compiler's[, the op's keyword arguments]).
REJECTIONS = {
    "tpu float16 attention": (
        "tpu-v5e", "attention", tpu_attention.flash_attention, _attention(256, LLAMA, F16),
        "q.dtype=float16", "Invalid vector type for load"),
    "tpu float16 paged decode": (
        "tpu-v6e", "paged_attention", tpu_paged.paged_attention, _forced_paged(F16, 16),
        "q.dtype=float16", "Invalid vector type for load"),
    # W8A8: v4's Mosaic has no int8 matmul (supports() refuses it there; XLA serves it).
    "tpu v4 w8a8": (
        "tpu-v4", "quantized_matmul",
        lambda a, q: tpu_quantized_matmul.quantized_matmul(
            a, q, trans_b=True, alpha=1.0, beta=0.0, c=None, out_dtype=a.dtype),
        _w8a8(16, 1536, 576), "TPU v4 has no int8 MXU product in Mosaic",
        "Unsupported matmul RHS type on target: vector<128x128xi8>", dict(trans_b=True)),
    "gpu paged page 12": (
        "a100", "paged_attention", gpu_paged.paged_attention, _forced_paged(BF16, 12),
        "page_size=12 is not a power of two", "whose size is a power of 2"),
    "gpu attention mixed dtypes": (
        "h100", "attention", gpu_attention.flash_attention,
        (S((1, 64, 8, 64), BF16), S((1, 64, 8, 64), F32), S((1, 64, 8, 64), F32)),
        "a Triton dot needs equal operand types", "must have the same element type"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS[REJECTIONS[n][0]])
                                  for n in sorted(REJECTIONS)])
def test_rejections_that_are_compile_limits_fail_that_compile(name):
    target, op, kernel, args, reason, verdict, *kwargs = REJECTIONS[name]
    with fj.targets.use(target), pytest.raises(fj.ImplementationError, match=reason):
        fj.dispatch.select(op, fj.dispatch.bind(op, *args, **(kwargs or [{}])[0]), "pallas")
    report = fj.aot.compile(kernel, *args, target=target)
    assert not report.compiled and verdict in report.error, report.error


@GPU
def test_a_failed_compile_is_the_compilers_message():
    # Float32 flash attention with the bfloat16 tiles of the H100 row: more shared memory
    # than the device has (the float32 rows, TUNED_FLOAT32, fit).
    tiles = gpu_attention.TUNED["H100"][128]
    report = fj.aot.compile(
        lambda q, k, v: gpu_attention.flash_attention(q, k, v, **tiles),
        *_attention(256, (8, 8, 128), F32), target="h100")
    assert not report.compiled
    assert "Shared memory size limit exceeded: requested 262656, available: 232448" in \
        report.error
    assert "Traceback" not in report.error and not report.kernels


@pytest.fixture(scope="module")
def tiny_config():
    return llama.load_config(pathlib.Path(llama.__file__).parent / "tiny")


TARGETS = [pytest.param("h100", marks=GPU), pytest.param("tpu-v5e", marks=TPU)]


def _compile_step(step, target):
    fj.dispatch.clear_selections()
    report = fj.aot.compile(step.fn, *step.args, target=target, implementation="pallas",
                            **step.statics)
    assert report.compiled, (step.name, report.error)
    return report, {op: s.implementation for op, s in fj.dispatch.last_selections().items()}


@pytest.mark.parametrize("target", TARGETS)
def test_tiny_model_steps_compile_with_the_kernels(tiny_config, target):
    with fj.targets.use(target), fj.use_implementation("pallas"):
        steps = aot_steps.abstract_steps(tiny_config, batch=2, context=32, dtype=BF16)
    for step in steps:
        report, chosen = _compile_step(step, target)
        assert {"rms_norm", "silu_mul"} <= {op for op, i in chosen.items() if i == "pallas"}
        assert len(report.kernels) >= 2, report


# XLA's TPU layout for a pool whose head_dim is not whole 128-lane tiles puts the pages
# dimension minor ({1,3,2,0}: no lane padding), while the kernel reads row-major pages: with
# 64-wide pages the compiled step relayouted every layer's pool per step (found by this
# test). On TPU the cache now stores such pools folded, two tokens per 128-lane
# row (forge_jax.ops.kv_fold), which the kernel reads in place.
@pytest.mark.parametrize("target, head_dim", [
    pytest.param("h100", 128, marks=GPU), pytest.param("tpu-v5e", 128, marks=TPU),
    # (the GPU kernel reads any head_dim's pool in place; one compile for CI's time)
    pytest.param("tpu-v5e", 64, marks=TPU)])
def test_compiled_paged_decode_holds_no_copy_of_the_page_pool(tiny_config, target, head_dim):
    # The tiny model with head_dim 128 and SmolLM2's 64, which the paged kernels serve (the
    # tiny model's 32 falls back to XLA on TPU, whose gather copies a layer's pages per step).
    config = dataclasses.replace(tiny_config, head_dim=head_dim)
    with fj.targets.use(target), fj.use_implementation("pallas"):
        _, decode = aot_steps.abstract_steps(config, batch=4, context=2048, dtype=BF16)
    report, chosen = _compile_step(decode, target)
    assert chosen["paged_attention"] == "pallas"
    assert decode.args[1].folded == (target.startswith("tpu") and head_dim < 128)
    pool = aot_steps.pool_bytes(decode)
    assert pool >= 16 * 2**20
    # The cache is donated and updated in place: no temporary or copy near a pool's size.
    assert report.memory["temp"] < pool / 8, report
    assert all(c.bytes < pool / 8 for c in report.copies), report


# The prefill of a 256-token prompt into a cache with room for 257 tokens a sequence, and
# into one with room for 1280: what generate's prefill does must not grow with the cache.
# (It did: the compiled prefill attended through the paged cache's whole capacity, and
# copied an attention mask and the gathered pages per layer: 753 copies, 8.5 GiB, for the
# SmolLM2 shape at batch 8 and 1024 tokens on tpu-v5e.)
@pytest.mark.parametrize("target, head_dim", [
    pytest.param("h100", 64, marks=GPU), pytest.param("tpu-v5e", 64, marks=TPU)])
def test_compiled_prefill_holds_no_copy_that_grows_with_the_cache(tiny_config, target,
                                                                  head_dim):
    config = dataclasses.replace(tiny_config, head_dim=head_dim)
    reports, pools = [], []
    for new_tokens in (1, 1024):
        with fj.targets.use(target), fj.use_implementation("pallas"):
            prefill, _ = aot_steps.abstract_steps(config, batch=4, context=256, dtype=BF16,
                                                  new_tokens=new_tokens)
        assert prefill.statics["empty_cache"]  # the prefill generate runs
        reports.append(_compile_step(prefill, target)[0])
        pools.append(aot_steps.pool_bytes(prefill))
    assert pools[1] >= 4 * pools[0]
    # The same copies of activations at both capacities; only copies of the step's small
    # metadata (block tables, lengths: a few bytes a page) may follow the capacity.
    small, large = (sorted((k, len(g)) for k, g in fj.aot.copy_kinds(
        [c for c in r.copies if c.bytes >= 4096]).items()) for r in reports)
    assert small == large, reports[1]
    assert max((c.bytes for c in reports[1].copies), default=0) < pools[1] / 8, reports[1]
    assert reports[1].memory["temp"] - reports[0].memory["temp"] < (pools[1] - pools[0]) / 8


def test_the_report_names_each_copy_and_counts_kernels_launched_in_a_scan():
    from jax.experimental import pallas as pl

    norm = "rms_norm/convert_element_type"
    hlo = f"""HloModule jit_prefill_step
ENTRY %main.1 (p: f32[8,576]) -> f32[8,576] {{
  %copy.3 = f32[8,576]{{0,1}} copy(f32[8,576]{{1,0}} %p), metadata={{op_name=\
"jit(prefill_step)/layer_3/{norm}" source_file="x.py"}}
  %copy.4 = f32[8,576]{{0,1}} copy(f32[8,576]{{1,0}} %p), metadata={{op_name=\
"jit(prefill_step)/layer_12/{norm};jit(prefill_step)/layer_12/{norm}"}}
  ROOT %transpose.1 = bf16[4,2]{{1,0}} transpose(bf16[2,4]{{1,0}} %q), dimensions={{1,0}}
}}
"""
    found = fj.aot.copies(hlo)
    assert [(c.op, c.shape, c.bytes, c.source) for c in found] == [
        ("copy", "f32[8,576]", 8 * 576 * 4, "layer_3/rms_norm/convert_element_type"),
        ("copy", "f32[8,576]", 8 * 576 * 4, "layer_12/rms_norm/convert_element_type"),
        ("transpose", "bf16[4,2]", 16, "")]
    kinds = fj.aot.copy_kinds(found)
    assert [(k, len(g)) for k, g in kinds.items()] == [
        (("copy", "f32[8,576]", "layer_*/rms_norm/convert_element_type"), 2),
        (("transpose", "bf16[4,2]", "(no source)"), 1)]

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    kernel = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((8,), F32), interpret=True,
                            name="double")

    def layers(x):  # 3 layers unrolled, each scanning the kernel 5 times; one more outside
        for _ in range(3):
            x, _ = jax.lax.scan(lambda c, _: (kernel(c), None), x, None, length=5)
        return kernel(x)

    jaxpr = jax.make_jaxpr(layers)(jnp.ones((8,), F32))
    assert sorted(n for _, n in fj.aot.kernel_launches(jaxpr)) == [1, 5, 5, 5]
    rows = fj.aot._kernels(jaxpr, fj.targets.get("h100"))
    assert [(k.name, k.calls) for k in rows] == [("double", 16)]


@TPU
def test_cli_compile_prints_each_steps_report(capsys):
    rc, out, err = cli_run(capsys, "compile", "--target", "tpu-v5e", "--batch", "2",
                           "--context", "16", "--implementation", "pallas")
    assert rc == 0, err
    assert "target tpu-v5e: TPU v5 lite" in out
    for step in ("prefill step: tpu-v5e (TPU v5 lite): compiled", "decode step:"):
        assert step in out, out
    assert "forge_jax_tpu_rms_norm" in out and "roofline" in out


def test_cli_compile_exits_1_on_a_failed_compile(capsys, monkeypatch):
    target = fj.targets.get("h100")

    def failed(fn, *args, target, **kwargs):
        return fj.aot.Report(target, False, "RESOURCE_EXHAUSTED: out of shared memory", 0.1,
                             {}, (), ())

    monkeypatch.setattr(fj.aot, "compile", failed)
    monkeypatch.setattr(fj.targets, "missing", lambda t: None)
    rc, out, _ = cli_run(capsys, "compile", "--target", target.name)
    assert rc == 1
    assert "FAILED after 0.1 s: RESOURCE_EXHAUSTED: out of shared memory" in out


def test_cli_compile_refuses_bad_flags_in_one_line(capsys):
    assert_one_line_error(cli_run(capsys, "compile", "--target", "h100", "--batch", "0"),
                          "--batch must be >= 1", prog="forge-jax compile")
    assert_one_line_error(cli_run(capsys, "compile", "--target", "h200"), "invalid choice",
                          prog="forge-jax compile")
