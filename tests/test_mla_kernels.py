"""The multi-head latent attention kernels: Pallas TPU (Mosaic,
pallas_kernels/tpu/mla_paged_attention.py) and Pallas GPU (Triton lowering,
pallas_kernels/gpu/mla_paged_attention.py).

Each kernel's compiled class runs on its hardware; its ``*Interpret`` class runs the same
tests in the interpreter here (marked slow). The behaviours come from
:class:`cases.mla.MlaPagedAttentionCases`: DeepSeek-V3's widths (latent 512 + RoPE 64,
pages of 64; heads fewer), NaN in every slot no query may see, checked against float64 and
the XLA implementation. The deviceless compiles (marked ``target``) compile each case
``supports()`` accepts for an H100 and a TPU v5e/v6e, and show the rejections to be the
compilers'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from cases.base import ImplementationCases, PallasGpu, PallasTpu
from cases.mla import DEEPSEEK_V3, MlaPagedAttentionCases

import forge_jax as fj
from forge_jax.pallas_kernels.gpu import mla_paged_attention as gpu_kernel
from forge_jax.pallas_kernels.tpu import mla_paged_attention as tpu_kernel

OP = "mla_paged_attention"
V3 = dict(DEEPSEEK_V3, heads=4)
V3_16 = dict(DEEPSEEK_V3, heads=16)
NARROW = dict(heads=8, kv_lora_rank=128, rope_dim=64, nope_dim=32, v_dim=48)

TPU_CASES = {
    "decode-v3-f32-page64": ("decode", V3, jnp.float32, 64, None),
    "mixed-v3-bf16-page64-640": ("mixed", V3, jnp.bfloat16, 64, 640),
    "chunked-narrow-f32-page16": ("chunked_prefill", NARROW, jnp.float32, 16, None),
}
GPU_CASES = {
    "decode-v3-bf16-page64": ("decode", V3, jnp.bfloat16, 64, None),
    "mixed-v3-f32-page64": ("mixed", V3, jnp.float32, 64, None),
    "prefill-narrow-f16-page16": ("prefill", NARROW, jnp.float16, 16, None),
}


class TestMlaPagedAttentionPallasTpu(PallasTpu, MlaPagedAttentionCases, ImplementationCases):
    IMPLEMENTATION = "pallas"
    CASES = TPU_CASES


class TestMlaPagedAttentionPallasTpuInterpret(TestMlaPagedAttentionPallasTpu):
    IMPLEMENTATION = "pallas_tpu_interpret"
    INTERPRET = True


class TestMlaPagedAttentionPallasGpu(PallasGpu, MlaPagedAttentionCases, ImplementationCases):
    IMPLEMENTATION = "pallas"
    CASES = GPU_CASES


class TestMlaPagedAttentionPallasGpuInterpret(TestMlaPagedAttentionPallasGpu):
    IMPLEMENTATION = "pallas_gpu_interpret"
    INTERPRET = True


S = jax.ShapeDtypeStruct


def specs(dtype, *, shape=V3_16, tokens=16, seqs=8, page=64, pages=128, per_seq=16,
          width=None):
    """Abstract arguments of a serving step: 16 query rows of 8 sequences."""
    h, c, r = shape["heads"], shape["kv_lora_rank"], shape["rope_dim"]
    return (S((tokens, h, shape["nope_dim"]), dtype), S((tokens, h, r), dtype),
            S((pages, page, width or c + r), dtype), S((c, h, shape["nope_dim"]), dtype),
            S((c, h, shape["v_dim"]), dtype), S((seqs, per_seq), jnp.int32),
            S((seqs,), jnp.int32), S((seqs + 1,), jnp.int32), S((), jnp.int32))


def bound(args):
    return fj.dispatch.bind(OP, *args)


def test_supports_rejections_and_explain():
    tpu_f16 = bound(specs(jnp.float16))
    assert "float16" in tpu_kernel.supports(tpu_f16)
    assert tpu_kernel.supports(dict(tpu_f16, latent_pages=S((8, 64, 576), jnp.bfloat16))) \
        is None
    narrow = bound(specs(jnp.bfloat16, shape=dict(NARROW, kv_lora_rank=96)))
    assert "kv_lora_rank=96 is not a power of two" in gpu_kernel.supports(narrow)
    with fj.targets.use("tpu-v5e"):
        selection = fj.explain(OP, *specs(jnp.float16))
    assert selection.implementation == "xla"
    assert "float16" in selection.rejected["pallas"]


TARGET_CASES = {
    "v3 bf16": (specs(jnp.bfloat16), {}),
    "v3 f32": (specs(jnp.float32), {}),
    "v3 bf16 page16 yarn scale": (specs(jnp.bfloat16, page=16, per_seq=64),
                                  dict(scale=0.1147)),
}
TPU_TARGET_CASES = {**TARGET_CASES, "v3 bf16 640 lanes": (specs(jnp.bfloat16, width=640), {})}
GPU_TARGET_CASES = {**TARGET_CASES,
                    "narrow f16 page24": (specs(jnp.float16, shape=NARROW, page=24), {})}


def _compile(args, kwargs, target):
    with fj.targets.use(target):
        assert fj.dispatch.select(OP, fj.dispatch.bind(OP, *args, **kwargs),
                                  "pallas").implementation == "pallas"
    report = fj.aot.compile(fj.mla_paged_attention, *args, target=target,
                            implementation="pallas", **kwargs)
    assert report.compiled, report.error
    assert report.kernels and all(k.costed and k.flops > 0 for k in report.kernels), report
    return report


@pytest.mark.target("h100")
@pytest.mark.parametrize("name", sorted(GPU_TARGET_CASES))
def test_gpu_kernel_compiles_for_h100(name):
    report = _compile(*GPU_TARGET_CASES[name], "h100")
    for k in report.kernels:
        assert k.spilled_bytes == 0, k


@pytest.mark.target("tpu-v5e")
@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e"])
@pytest.mark.parametrize("name", sorted(TPU_TARGET_CASES))
def test_tpu_kernel_compiles(name, target):
    report = _compile(*TPU_TARGET_CASES[name], target)
    if name == "v3 bf16 640 lanes":  # the cache's TPU layout: no copy of the pool
        assert all(c.bytes < 128 * 64 * 576 * 2 for c in report.copies), report


@pytest.mark.target("h100")
def test_gpu_rejection_is_the_compilers():
    args = specs(jnp.bfloat16, shape=dict(NARROW, kv_lora_rank=96))
    report = fj.aot.compile(gpu_kernel.mla_paged_attention, *args, target="h100")
    assert not report.compiled and "size is a power of 2" in report.error


@pytest.mark.target("tpu-v5e")
def test_tpu_rejection_is_the_compilers():
    report = fj.aot.compile(tpu_kernel.mla_paged_attention, *specs(jnp.float16),
                            target="tpu-v5e")
    assert not report.compiled and "Invalid vector type for load" in report.error
