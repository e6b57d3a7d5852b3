"""PagedLatentCache: the latent page pool of multi-head latent attention behind the KV-cache
contract, with the BlockManager's prefix sharing (fork, copy-on-write) over it.

Attention through the cache is compared with the float64 expanded reference on the latents
the test wrote; every slot no query may see holds NaN (the pools start NaN-filled).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close
from cases.inputs import rng
from cases.mla import SMALL, mla_ref
from cases.references import f64

from forge_jax.kv_cache import BlockManager, KVCache, PagedLatentCache
from forge_jax.kv_cache.latent import bytes_per_token, pool_width

H, RANK, ROPE, NOPE, V = (SMALL[k] for k in ("heads", "kv_lora_rank", "rope_dim", "nope_dim",
                                              "v_dim"))
PAGE = 4


def weights(seed):
    gen = rng(seed)
    return (jnp.asarray(gen.standard_normal((RANK, H, NOPE)) / RANK ** 0.5, jnp.float32),
            jnp.asarray(gen.standard_normal((RANK, H, V)) / RANK ** 0.5, jnp.float32))


def nan_cache(num_layers, num_pages, tables, dtype=jnp.float32, width=None):
    cache = PagedLatentCache.create(num_layers=num_layers, num_pages=num_pages,
                                    page_size=PAGE, kv_lora_rank=RANK, rope_dim=ROPE,
                                    dtype=dtype, block_tables=tables, width=width)
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.ndim == 3 else x, cache)


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("layer",))
def step(cache, latent, k_pe, q, positions, valid, kv_lengths, up_proj, *, layer=0):
    cache = cache.write(layer, latent, k_pe, positions, valid)
    out = cache.attend(layer, q, q_positions=positions, kv_lengths=kv_lengths, up_proj=up_proj)
    return cache.with_lengths(kv_lengths), out


def ref_rows(q, positions, latents, kv_lengths, w):
    """float64 [batch, t, heads, v_dim] from each row's latents [len, rank + rope]."""
    out = np.zeros(q.shape[:3] + (V,))
    for b in range(q.shape[0]):
        seq = latents[b]
        out[b] = mla_ref(q[b, :, :, :NOPE], q[b, :, :, NOPE:], seq[:, :RANK], seq[:, RANK:],
                         *map(f64, w), scale=(NOPE + ROPE) ** -0.5, positions=positions[b],
                         length=int(kv_lengths[b]))
    return out


def test_is_a_kv_cache_and_a_pytree():
    cache = PagedLatentCache.create(num_layers=2, num_pages=6, page_size=PAGE, kv_lora_rank=RANK,
                                    rope_dim=ROPE, block_tables=np.zeros((2, 3), np.int32))
    assert isinstance(cache, KVCache)
    assert cache.nbytes == 2 * 6 * PAGE * (RANK + ROPE) * 4
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 4  # two pools, block tables, lengths


@pytest.mark.parametrize("width", [None, RANK + ROPE + 16])
def test_prefill_then_decode_with_padding_matches_expanded_float64(width):
    gen = rng(1)
    w = weights(2)
    lengths = np.array([7, 4])  # prompts; row 1 right-padded
    tables = np.array([[5, 1, 3], [0, 4, 2]], np.int32)
    cache = nan_cache(2, 6, tables, width=width)
    latents = gen.standard_normal((2, 10, RANK + ROPE)).astype(np.float32)
    t = 7
    positions = np.tile(np.arange(t), (2, 1)).astype(np.int32)
    valid = positions < lengths[:, None]
    q = gen.standard_normal((2, t, H, NOPE + ROPE)).astype(np.float32)
    x = jnp.asarray(latents[:, :t, None], jnp.float32)
    cache, out = step(cache, x[..., :RANK], x[..., RANK:], jnp.asarray(q, jnp.float32),
                      positions, valid, lengths.astype(np.int32), w, layer=1)
    ref = ref_rows(q, positions, latents, lengths, w)
    out, ref = f64(out), ref
    # Padding queries (row 1 from position 4) see up to kv_lengths; compare the valid ones.
    assert_close(out[valid], ref[valid], dtype=jnp.float32)
    for _ in range(3):  # decode: one token per row
        q1 = gen.standard_normal((2, 1, H, NOPE + ROPE)).astype(np.float32)
        pos = lengths[:, None].astype(np.int32)
        x = jnp.asarray(np.stack([latents[b, lengths[b]] for b in range(2)])[:, None, None],
                        jnp.float32)
        lengths = lengths + 1
        cache, out = step(cache, x[..., :RANK], x[..., RANK:], jnp.asarray(q1, jnp.float32),
                          pos, np.ones((2, 1), bool), lengths.astype(np.int32), w, layer=1)
        assert_close(out, ref_rows(q1, pos, latents, lengths, w))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    assert np.isnan(f64(cache.pages[0])).all()  # layer 0 untouched


def test_query_at_a_negative_position_returns_zeros():
    w = weights(3)
    cache = nan_cache(1, 4, np.array([[-1, -1]], np.int32))
    q = jnp.asarray(rng(4).standard_normal((1, 2, H, NOPE + ROPE)), jnp.float32)
    out = cache.attend(0, q, q_positions=np.array([[-1, -5]], np.int32),
                       kv_lengths=np.array([0], np.int32), up_proj=w)
    np.testing.assert_array_equal(f64(out), 0.0)


def test_block_manager_prefix_sharing_with_copy_on_write():
    """Two sequences forked from one prompt share its pages; each then appends its own
    tokens (the shared, partly filled last page copied on write) and sees the shared
    prefix and its own suffix only."""
    gen = rng(5)
    w = weights(6)
    manager = BlockManager(num_pages=8, page_size=PAGE)
    prompt = 6  # one full page and a partial one
    manager.allocate("a", prompt)
    cache = nan_cache(1, 8, manager.block_tables(["a"], 4))
    shared = gen.standard_normal((prompt, RANK + ROPE)).astype(np.float32)
    x = jnp.asarray(shared[None, :, None], jnp.float32)
    positions = np.arange(prompt, dtype=np.int32)[None]
    cache = cache.write(0, x[..., :RANK], x[..., RANK:], positions, np.ones((1, prompt), bool))
    manager.fork("a", "b")
    assert (manager.block_table("a") == manager.block_table("b")).all()
    suffix = {s: gen.standard_normal((3, RANK + ROPE)).astype(np.float32) for s in "ab"}
    for i in range(3):
        for s in "ab":
            manager.append(s)
        cache = cache.copy_pages(manager.take_pending_copies())
        cache = cache.with_block_tables(manager.block_tables(["a", "b"], 4))
        x = jnp.asarray(np.stack([suffix[s][i] for s in "ab"])[:, None, None], jnp.float32)
        pos = np.full((2, 1), prompt + i, np.int32)
        cache = cache.write(0, x[..., :RANK], x[..., RANK:], pos, np.ones((2, 1), bool))
    # The first page is still shared; the partly filled one was copied for one of them.
    ta, tb = manager.block_table("a"), manager.block_table("b")
    assert ta[0] == tb[0] and ta[1] != tb[1]
    n = prompt + 3
    q = gen.standard_normal((2, 1, H, NOPE + ROPE)).astype(np.float32)
    out = cache.attend(0, jnp.asarray(q, jnp.float32), q_positions=np.full((2, 1), n - 1,
                                                                              np.int32),
                       kv_lengths=np.full((2,), n, np.int32), up_proj=w)
    latents = [np.concatenate([shared, suffix[s]]) for s in "ab"]
    assert_close(out, ref_rows(q, np.full((2, 1), n - 1), latents, [n, n], w))


def test_bfloat16_pool():
    w = weights(7)
    gen = rng(8)
    cache = nan_cache(1, 3, np.array([[2, 0]], np.int32), jnp.bfloat16)
    latents = gen.standard_normal((1, 5, RANK + ROPE)).astype(jnp.bfloat16).astype(float)
    x = jnp.asarray(latents[:, :, None], jnp.bfloat16)
    q = gen.standard_normal((1, 5, H, NOPE + ROPE)).astype(jnp.bfloat16)
    positions = np.arange(5, dtype=np.int32)[None]
    cache = cache.write(0, x[..., :RANK], x[..., RANK:], positions, np.ones((1, 5), bool))
    out = cache.attend(0, jnp.asarray(q), q_positions=positions,
                       kv_lengths=np.array([5], np.int32), up_proj=w)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_rows(q.astype(float), positions, latents, [5], w), dtype=jnp.bfloat16)


@pytest.mark.parametrize("bad,match", [
    (dict(up_proj=None), "needs up_proj"),
    (dict(sliding_window=4), "no sliding_window"),
    (dict(q=np.zeros((1, 1, H, ROPE), np.float32)), r"q must be \[batch, t, heads"),
])
def test_attend_bad_input(bad, match):
    cache = PagedLatentCache.create(num_layers=1, num_pages=2, page_size=PAGE, kv_lora_rank=RANK,
                                    rope_dim=ROPE, block_tables=np.zeros((1, 2), np.int32))
    kwargs = dict(q=np.zeros((1, 1, H, NOPE + ROPE), np.float32), q_positions=np.zeros(
        (1, 1), np.int32), kv_lengths=np.ones((1,), np.int32), up_proj=weights(0))
    kwargs.update(bad)
    with pytest.raises(ValueError, match=match):
        cache.attend(0, **kwargs)


def test_write_bad_shapes():
    cache = PagedLatentCache.create(num_layers=1, num_pages=2, page_size=PAGE, kv_lora_rank=RANK,
                                    rope_dim=ROPE, block_tables=np.zeros((1, 2), np.int32))
    ok = np.zeros((1, 1), np.int32), np.ones((1, 1), bool)
    with pytest.raises(ValueError, match=r"k \(the latent\) must be"):
        cache.write(0, np.zeros((1, 1, 2, RANK), np.float32), np.zeros((1, 1, 1, ROPE),
                                                                      np.float32), *ok)
    with pytest.raises(ValueError, match=r"v \(the RoPE key\) must be"):
        cache.write(0, np.zeros((1, 1, 1, RANK), np.float32), np.zeros((1, 1, 1, 3),
                                                                      np.float32), *ok)


def test_bytes_per_token_deepseek_v3():
    # DeepSeek-V3: 61 layers, 128 heads, kv_lora_rank 512 + rope 64, qk 192, v 128; bfloat16.
    got = bytes_per_token(num_layers=61, kv_lora_rank=512, rope_dim=64, heads=128,
                          qk_head_dim=192, v_dim=128)
    assert got == {"latent": 61 * 576 * 2, "expanded": 61 * 128 * 320 * 2}
    assert got["expanded"] / got["latent"] == pytest.approx(71.1, abs=0.05)


def test_pool_width_whole_lane_tiles_on_tpu_only():
    assert pool_width(512, 64, platform="tpu") == 640
    assert pool_width(512, 64, platform="gpu") == pool_width(512, 64, platform="cpu") == 576
    assert pool_width(384, 128, platform="tpu") == 512
    with pytest.raises(ValueError, match="width must hold"):
        PagedLatentCache.create(num_layers=1, num_pages=2, page_size=PAGE, kv_lora_rank=RANK,
                                rope_dim=ROPE, block_tables=np.zeros((1, 2), np.int32),
                                width=RANK)
