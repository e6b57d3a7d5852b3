"""The Gated DeltaNet layer (``forge_jax.models.gated_deltanet``) against transformers'
``Qwen3NextGatedDeltaNet`` and ``Qwen3_5GatedDeltaNet`` with the same random weights: a
prompt longer than the conv kernel and several chunks, at once and in pieces through the
recurrent-state pool."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from flax import nnx

from forge_jax.kv_cache import RecurrentStatePool
from forge_jax.models import gated_deltanet as gdn

torch = pytest.importorskip("torch")

SIZES = dict(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             rms_norm_eps=1e-6, hidden_act="silu")


def hf_layer(family):
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextGatedDeltaNet as Layer,
        )
        config = Qwen3NextConfig(**SIZES, num_hidden_layers=1, layer_types=["linear_attention"])
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Layer
        config = Qwen3_5TextConfig(**SIZES, num_hidden_layers=1,
                                   layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = Layer(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5))
        layer.A_log.copy_(torch.log(torch.rand_like(layer.A_log) * 0.9 + 0.1))
    return layer


# groups=2: the [q | k | v] rows and conv channels stored by key-head group, as for a
# tensor axis of 2 (forge_jax.models.qwen3_next_sharding), here on one device (slow: the
# mesh tests of tests/test_qwen3_next_sharding.py run that layout by default).
@pytest.mark.parametrize("family, groups", [
    ("qwen3_next", 1), ("qwen3_5_text", 1),
    pytest.param("qwen3_next", 2, marks=pytest.mark.slow)])
def test_layer_matches_transformers_at_once_and_in_pieces(family, groups):
    layer = hf_layer(family)
    x = np.random.default_rng(1).standard_normal((2, 21, 48)).astype(np.float32)
    with torch.no_grad():
        ref = layer(torch.from_numpy(x)).double().numpy()
    config = gdn.GatedDeltaNetConfig.from_hf(SIZES, chunk_size=8)
    ours = gdn.GatedDeltaNet(config, rngs=nnx.Rngs(0), groups=groups)
    if groups > 1:  # not the plain order: key head 0's k right after its q
        assert gdn.stored_channels(ours)[16:32].tolist() == list(range(32, 48))
    gdn.load_hf(ours, {k: v.detach().numpy() for k, v in layer.state_dict().items()}, "")
    y, _ = ours(jnp.asarray(x))
    assert_close(y, ref, factor=10)
    # In pieces (13 tokens, then decode steps), the states in a pool between calls.
    pool = RecurrentStatePool.create(num_layers=1, num_slots=2, conv_kernel=4,
                                     conv_dim=config.conv_dim, v_heads=4, k_head_dim=16,
                                     v_head_dim=8)
    outs = []
    for start, stop in ((0, 13), *((i, i + 1) for i in range(13, 21))):
        y, pool = ours(jnp.asarray(x[:, start:stop]), cache=pool)
        outs.append(np.asarray(y))
    assert_close(np.concatenate(outs, axis=1), ref, factor=10)


def test_config_rejects_ungrouped_heads():
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads=3"):
        gdn.GatedDeltaNetConfig.from_hf({**SIZES, "linear_num_key_heads": 3})
    config = gdn.GatedDeltaNetConfig.from_hf(SIZES)
    with pytest.raises(ValueError, match="linear_num_key_heads=2 does not split into groups=4"):
        gdn.GatedDeltaNet(config, rngs=nnx.Rngs(0), groups=4)
