"""The GPU kernels' launch tables (each kernel module's TUNED): rows for known device kinds,
every kernel served on every kind, kinds matched as words of the device kind."""

from __future__ import annotations

import numpy as np
import pytest

from forge_jax.pallas_kernels.gpu import (
    _common,
    attention,
    jax_triton_elementwise,
    mosaic_quantized_matmul,
    paged_attention,
    rms_norm,
    rope,
    silu_mul,
)

TABLES = {"rms_norm": rms_norm.TUNED, "silu_mul": silu_mul.TUNED, "rope": rope.TUNED,
          "attention": attention.TUNED, "paged_attention": paged_attention.TUNED,
          "triton_rms_norm": jax_triton_elementwise.RMS_NORM_TUNED,
          "triton_silu_mul": jax_triton_elementwise.SILU_MUL_TUNED,
          "triton_rope": jax_triton_elementwise.ROPE_TUNED,
          # The one table with a Blackwell row (its SM count): the Triton kernels have none.
          "mosaic_quantized_matmul": mosaic_quantized_matmul.TUNED}
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
    assert set().union(*TABLES.values()) == {"default", *_common.DEVICE_KINDS}
    for op, table in TABLES.items():
        assert "default" in table and set(table) <= {"default", *_common.DEVICE_KINDS}, op


@pytest.mark.parametrize("device_kind", list(KINDS))
def test_every_kernel_gets_valid_launch_parameters(device_kind):
    """Whatever the device, each kernel's parameters are powers of two (Triton's rule) and
    dots are at least 16 wide."""
    def pow2(n):
        return n >= 1 and n & (n - 1) == 0

    for dim in (64, 576, 4096, rms_norm.MAX_HIDDEN):
        p = rms_norm.default_config({"x": np.empty((1, dim))}, device_kind)
        assert pow2(p.block_rows) and pow2(p.num_warps)
    assert pow2(silu_mul.default_config({}, device_kind).block_size)
    for head_dim in (64, 80, 128, 256):
        r = rope.default_config({"x": np.empty((1, 1, 8, head_dim))}, device_kind)
        assert pow2(r.block_tokens) and pow2(r.block_heads)
        a = attention.default_config({"q": np.empty((1, 1, 1, head_dim))}, device_kind)
        assert a.block_q >= _common.MIN_DOT and pow2(a.block_q) and pow2(a.block_k)
        assert a.block_k >= _common.MIN_DOT
        g = paged_attention.default_config({"q": np.empty((1, 1, head_dim))}, device_kind)
        assert pow2(g.block_k) and g.max_splits >= 1 and pow2(g.block_rows)


def test_buckets_and_fallbacks():
    assert _common.tuned(attention.TUNED, "NVIDIA L4", 100) == attention.TUNED["L4"][128]
    # A kind without its own entry for an op takes the default's.
    assert _common.tuned(rms_norm.TUNED, "NVIDIA H100 80GB HBM3", 4096) == \
        rms_norm.TUNED["default"][4096]
    # Past the largest bucket: the largest.
    assert _common.tuned(rope.TUNED, None, 4096) == rope.TUNED["default"][512]
    assert _common.tuned(silu_mul.TUNED, "NVIDIA A100-SXM4-80GB") == silu_mul.TUNED["default"]
