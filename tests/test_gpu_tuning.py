"""The GPU launch table (pallas_kernels/gpu/_common.TUNING): one row per device kind, every
kernel served on every kind, kinds matched as words of the device kind."""

from __future__ import annotations

import pytest

from forge_jax.pallas_kernels.gpu import (
    _common,
    attention,
    paged_attention,
    rms_norm,
    rope,
    silu_mul,
)

OPS = ("rms_norm", "silu_mul", "rope", "attention", "paged_attention", "triton_rms_norm",
       "triton_silu_mul", "triton_rope")
KINDS = {
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H100 PCIe": "H100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA L4": "L4",
    "NVIDIA L40S": "default",  # not an L4
    "Tesla T4": "default",
    "NVIDIA GH200 480GB": "default",
    None: "default",
}


@pytest.mark.parametrize("device_kind,row", KINDS.items())
def test_device_kinds_match_as_words(device_kind, row):
    assert _common.kind_row(device_kind) == row


def test_every_op_has_defaults_and_every_kind_a_row():
    assert set(OPS) <= set(_common.TUNING["default"])
    assert set(_common.TUNING) == {"default", *_common.DEVICE_KINDS}
    for kind, ops in _common.TUNING.items():
        assert set(ops) <= set(OPS), kind


@pytest.mark.parametrize("device_kind", list(KINDS))
def test_every_kernel_gets_valid_launch_parameters(device_kind):
    """Whatever the device, each kernel's parameters are powers of two (Triton's rule) and
    dots are at least 16 wide."""
    def pow2(n):
        return n >= 1 and n & (n - 1) == 0

    for dim in (64, 576, 4096, rms_norm.MAX_HIDDEN):
        p = rms_norm.launch_params(dim, device_kind)
        assert pow2(p.block_rows) and pow2(p.num_warps)
    assert pow2(silu_mul.launch_params(device_kind).block_size)
    for head_dim in (64, 80, 128, 256):
        r = rope.launch_params(head_dim, 8, device_kind)
        assert pow2(r.block_tokens) and pow2(r.block_heads)
        a = attention.launch_params(head_dim, device_kind)
        assert a.block_q >= _common.MIN_DOT and pow2(a.block_q) and pow2(a.block_k)
        assert a.block_k >= _common.MIN_DOT
        g = paged_attention.launch_params(head_dim, device_kind)
        assert pow2(g.block_k) and g.max_splits >= 1 and pow2(g.block_rows)


def test_buckets_and_fallbacks():
    assert _common.tuning("attention", "NVIDIA L4", 100) == _common.TUNING["L4"]["attention"][
        128]
    # A kind without its own entry for an op takes the default's.
    assert _common.tuning("rms_norm", "NVIDIA H100 80GB HBM3", 4096) == \
        _common.TUNING["default"]["rms_norm"][4096]
    # Past the largest bucket: the largest.
    assert _common.tuning("rope", None, 4096) == _common.TUNING["default"]["rope"][512]
    assert _common.tuning("silu_mul", "NVIDIA A100-SXM4-80GB") == \
        _common.TUNING["default"]["silu_mul"]
