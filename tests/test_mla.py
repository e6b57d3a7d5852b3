"""Multi-head latent attention ops: fj.mla_attention, fj.mla_paged_attention, fj.mla_paged_write.

Both attention ops against a float64 NumPy reference of the *expanded* computation (per-head
keys and values built from the latent): the paged op computes weight-absorbed, so agreement
shows absorption equals expansion. Every latent slot no query may see holds NaN (page tails,
spare pages, sequences with no new token), ignored sequences' entries hold garbage, padding
query rows hold NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.checks import assert_close, assert_raises_as_listed
from cases.inputs import normal, rng
from cases.mla import (
    DEEPSEEK_V3,
    MLA_MIXES,
    SMALL,
    default_scale,
    make_mla_step,
    mla_ref,
    mla_step_ref,
)
from cases.references import f64

import forge_jax as fj
from forge_jax import dispatch
from forge_jax.ops import mla


@functools.partial(jax.jit, static_argnames=("scale", "implementation"))
def paged(*args, scale=None, implementation=None):
    return fj.mla_paged_attention(*args, scale=scale, implementation=implementation)


def dense_inputs(seed, batch, q_len, kv_len, shape, dtype=jnp.float32):
    gen = rng(seed)
    h, c, r, n, v = (shape[k] for k in ("heads", "kv_lora_rank", "rope_dim", "nope_dim",
                                         "v_dim"))
    return (normal(gen, (batch, q_len, h, n), dtype), normal(gen, (batch, q_len, h, r), dtype),
            normal(gen, (batch, kv_len, c), dtype), normal(gen, (batch, kv_len, r), dtype),
            normal(gen, (c, h, n), scale=c ** -0.5), normal(gen, (c, h, v), scale=c ** -0.5))


def dense_ref(q_nope, q_pe, latent, k_pe, w_uk, w_uv, *, scale, causal=True, lengths=None):
    batch, q_len = q_nope.shape[:2]
    kv_len = latent.shape[1]
    out = []
    for b in range(batch):
        length = kv_len if lengths is None else int(lengths[b])
        positions = (length - q_len + np.arange(q_len)) if causal else np.full(q_len, kv_len)
        out.append(mla_ref(q_nope[b], q_pe[b], latent[b], k_pe[b], w_uk, w_uv, scale=scale,
                           positions=positions, length=length))
    return np.stack(out)


class TestMlaAttention:
    @pytest.mark.parametrize("shape", [SMALL, DEEPSEEK_V3], ids=["small", "deepseek_v3"])
    @pytest.mark.parametrize("q_len,kv_len", [(7, 7), (3, 11), (1, 9)])
    def test_matches_expanded_float64(self, shape, q_len, kv_len):
        args = dense_inputs(0, 2, q_len, kv_len, shape)
        scale = mla.yarn_softmax_scale(shape["nope_dim"] + shape["rope_dim"], 40.0, 1.0)
        out = jax.jit(functools.partial(fj.mla_attention, scale=scale))(*args)
        assert out.shape == (2, q_len, shape["heads"], shape["v_dim"])
        assert_close(out, dense_ref(*args, scale=scale))

    def test_not_causal_and_lengths(self):
        args = dense_inputs(1, 3, 4, 10, SMALL)
        scale = default_scale_dense(args)
        assert_close(fj.mla_attention(*args, causal=False), dense_ref(*args, scale=scale,
                                                                      causal=False))
        lengths = np.array([10, 6, 4], np.int32)
        assert_close(fj.mla_attention(*args, kv_lengths=lengths),
                     dense_ref(*args, scale=scale, lengths=lengths))

    def test_nan_past_lengths_never_reaches_the_output(self):
        q_nope, q_pe, latent, k_pe, w_uk, w_uv = dense_inputs(2, 2, 3, 12, SMALL)
        lengths = np.array([7, 12], np.int32)
        clean = dense_ref(q_nope, q_pe, latent, k_pe, w_uk, w_uv,
                          scale=default_scale_dense((q_nope, q_pe)), lengths=lengths)
        latent = latent.at[0, 7:].set(jnp.nan)
        k_pe = k_pe.at[0, 7:].set(jnp.inf)
        assert_close(fj.mla_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv,
                                      kv_lengths=lengths), clean)
        # A NaN the last query sees reaches exactly that query's row.
        latent = latent.at[1, 11].set(jnp.nan)
        out = f64(fj.mla_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, kv_lengths=lengths))
        assert np.isnan(out[1, 2]).all() and np.isfinite(out[1, :2]).all()
        assert np.isfinite(out[0]).all()

    def test_bfloat16(self):
        args = dense_inputs(3, 2, 5, 8, SMALL, jnp.bfloat16)
        out = fj.mla_attention(*args)
        assert out.dtype == jnp.bfloat16
        assert_close(out, dense_ref(*args, scale=default_scale_dense(args)), dtype=jnp.bfloat16)

    def test_grad_matches_finite_differences_of_float64(self):
        args = dense_inputs(4, 1, 3, 5, dict(SMALL, kv_lora_rank=8, heads=2))
        ct = normal(rng(9), (1, 3, 2, SMALL["v_dim"]))
        grads = jax.grad(lambda *a: jnp.sum(fj.mla_attention(*a) * ct), argnums=(0, 2, 4))(*args)
        scale = default_scale_dense(args)
        base = [f64(a) for a in args]
        for index, g in zip((0, 2, 4), grads, strict=True):
            flat = base[index].reshape(-1)
            for i in rng(index).choice(flat.size, 4, replace=False):
                eps = 1e-6
                hi, lo = [b.copy() for b in base], [b.copy() for b in base]
                hi[index].reshape(-1)[i] += eps
                lo[index].reshape(-1)[i] -= eps
                fd = (np.sum(dense_ref(*hi, scale=scale) * f64(ct))
                      - np.sum(dense_ref(*lo, scale=scale) * f64(ct))) / (2 * eps)
                np.testing.assert_allclose(f64(g).reshape(-1)[i], fd, rtol=2e-3, atol=2e-4)

    def test_vmap(self):
        args = dense_inputs(5, 2, 3, 6, SMALL)
        out = jax.vmap(lambda *a: fj.mla_attention(*(x[None] for x in a[:4]), *a[4:])[0],
                       in_axes=(0, 0, 0, 0, None, None))(*args)
        assert_close(out, dense_ref(*args, scale=default_scale_dense(args)))


def default_scale_dense(args):
    return (args[0].shape[-1] + args[1].shape[-1]) ** -0.5


class TestMlaPagedAttention:
    @pytest.mark.parametrize("mix", sorted(MLA_MIXES))
    @pytest.mark.parametrize("page_size", [8, 16])
    def test_ragged_steps_match_expanded_float64(self, mix, page_size):
        step = make_mla_step(rng(len(mix), page_size), **MLA_MIXES[mix], page_size=page_size,
                             **SMALL)
        out = paged(*step.args())
        assert out.shape == (step.q_nope.shape[0], SMALL["heads"], SMALL["v_dim"])
        assert_close(out, mla_step_ref(step, scale=default_scale(step)))
        np.testing.assert_array_equal(f64(out)[step.cu_q_lens[step.num_seqs]:], 0.0)

    def test_deepseek_v3_widths_page_64(self):
        # Decode and a prefill chunk in one step, DeepSeek-V3's widths, YaRN's scale.
        step = make_mla_step(rng(64), [1, 5, 1], [70, 69, 3], max_seqs=4, total_tokens=9,
                             page_size=64, **DEEPSEEK_V3)
        scale = mla.yarn_softmax_scale(192, 40.0, 1.0)
        assert_close(paged(*step.args(), scale=scale), mla_step_ref(step, scale=scale))

    def test_padding_lanes_of_a_wider_pool_are_never_read(self):
        # DeepSeek-V3's 576 values in a 640-lane pool (the TPU cache's layout), the 64
        # padding lanes NaN everywhere.
        step = make_mla_step(rng(640), **MLA_MIXES["mixed"], page_size=16,
                             **dict(DEEPSEEK_V3, heads=2), width=640)
        assert np.isnan(step.latent_pages[..., 576:]).all()
        assert_close(paged(*step.args()), mla_step_ref(step, scale=default_scale(step)))

    def test_bfloat16_pool(self):
        step = make_mla_step(rng(3), **MLA_MIXES["mixed"], page_size=8, dtype=jnp.bfloat16,
                             **SMALL)
        out = paged(*step.args())
        assert out.dtype == jnp.bfloat16
        assert_close(out, mla_step_ref(step, scale=default_scale(step)), dtype=jnp.bfloat16)

    def test_equals_dense_mla_attention_on_the_gathered_latents(self):
        step = make_mla_step(rng(11), [4], [13], max_seqs=1, total_tokens=4, page_size=8,
                             **SMALL)
        rank = SMALL["kv_lora_rank"]
        seq = jnp.asarray(step.latents[0], jnp.float32)[None]
        dense = fj.mla_attention(step.q_nope[None], step.q_pe[None], seq[..., :rank],
                                 seq[..., rank:], step.w_uk, step.w_uv)[0]
        assert_close(paged(*step.args()), f64(dense))

    def test_traced_num_seqs_one_compilation_serves_any_mix(self):
        traces = []

        @jax.jit
        def step_fn(*args):
            traces.append(1)
            return fj.mla_paged_attention(*args)

        gen = rng(7)
        for q_lens, kv_lens in [([4, 1, 1], [4, 30, 9]), ([1, 1, 7, 1], [40, 2, 7, 13])]:
            step = make_mla_step(gen, q_lens, kv_lens, max_seqs=6, total_tokens=24,
                                 page_size=8, **SMALL, spare_pages=40 - sum(
                                     -(-k // 8) for k in kv_lens))
            step.block_tables = np.pad(step.block_tables, ((0, 0), (0, 6 - step.block_tables
                                                                     .shape[1])))
            args = list(step.args())
            args[-1] = jnp.int32(step.num_seqs)
            assert_close(step_fn(*args), mla_step_ref(step, scale=default_scale(step)))
        assert len(traces) == 1

    def test_grad_of_queries_and_weights(self):
        step = make_mla_step(rng(5), [2, 1], [5, 9], max_seqs=2, total_tokens=3, page_size=4,
                             **dict(SMALL, kv_lora_rank=8, heads=2))
        ct = normal(rng(6), (3, 2, SMALL["v_dim"]))
        scale = default_scale(step)

        def loss(q_nope, w_uv):
            args = list(step.args())
            args[0], args[4] = q_nope, w_uv
            return jnp.sum(fj.mla_paged_attention(*args) * ct)

        g_q, g_w = jax.grad(loss, argnums=(0, 1))(jnp.asarray(step.q_nope),
                                                  jnp.asarray(step.w_uv))
        assert np.isfinite(f64(g_q)).all() and np.isfinite(f64(g_w)).all()

        def ref_loss(q_nope, w_uv):
            s = dataclasses.replace(step, q_nope=q_nope, w_uv=w_uv)
            return np.sum(mla_step_ref(s, scale=scale) * f64(ct))

        for name, g, base in (("q_nope", g_q, f64(step.q_nope)), ("w_uv", g_w, f64(step.w_uv))):
            for i in rng(len(name)).choice(base.size, 4, replace=False):
                hi, lo = base.copy(), base.copy()
                hi.reshape(-1)[i] += 1e-6
                lo.reshape(-1)[i] -= 1e-6
                args = (hi, f64(step.w_uv)) if name == "q_nope" else (f64(step.q_nope), hi)
                args_lo = (lo, f64(step.w_uv)) if name == "q_nope" else (f64(step.q_nope), lo)
                fd = (ref_loss(*args) - ref_loss(*args_lo)) / 2e-6
                np.testing.assert_allclose(f64(g).reshape(-1)[i], fd, rtol=2e-3, atol=2e-4)

    def test_explain_names_the_xla_reference(self):
        step = make_mla_step(rng(1), [1], [3], max_seqs=1, total_tokens=1, page_size=4, **SMALL)
        selection = fj.explain("mla_paged_attention", *step.args(), implementation="xla")
        assert selection.implementation == "xla"
        assert dispatch.select("mla_paged_attention", dispatch.bind(
            "mla_paged_attention", *step.args())).implementation == "xla"


class TestMlaPagedWrite:
    def test_writes_then_reads_back(self):
        gen = rng(0)
        pool = jnp.full((4, 8, 10), jnp.nan, jnp.bfloat16)
        latent, k_pe = normal(gen, (5, 7)), normal(gen, (5, 3))
        slots = np.array([3, 17, -1, 31, 8], np.int32)
        out = jax.jit(fj.mla_paged_write, donate_argnums=0)(pool, latent, k_pe, slots)
        assert out.dtype == jnp.bfloat16 and out.shape == (4, 8, 10)
        flat = f64(out).reshape(32, 10)
        want = np.concatenate([f64(latent), f64(k_pe)], 1).astype(jnp.bfloat16).astype(float)
        for t, s in enumerate(slots):
            if s >= 0:
                np.testing.assert_array_equal(flat[s], want[t])
        untouched = np.setdiff1d(np.arange(32), slots[slots >= 0])
        assert np.isnan(flat[untouched]).all()

    def test_traced_slot_past_the_pool_writes_nothing(self):
        pool = jnp.ones((2, 4, 5))
        out = jax.jit(fj.mla_paged_write)(pool, jnp.zeros((1, 3)) + 2, jnp.zeros((1, 2)),
                                          jnp.array([8], jnp.int32))
        np.testing.assert_array_equal(f64(out), 1.0)


def _bad_inputs():
    step = make_mla_step(rng(0), [2, 1], [5, 9], max_seqs=2, total_tokens=4, page_size=4,
                         **SMALL)
    a = step.args()

    def call(i, value, **kw):
        args = list(a)
        args[i] = value
        return lambda: fj.mla_paged_attention(*args, **kw)

    pool, q = step.latent_pages, step.q_nope
    dense = dense_inputs(0, 1, 2, 3, SMALL)

    def dcall(i, value, **kw):
        args = list(dense)
        args[i] = value
        return lambda: fj.mla_attention(*args, **kw)

    return {
        "q_pe_dtype": (call(1, step.q_pe.astype(np.float16)), TypeError, "q_nope and q_pe"),
        "q_pe_rows": (call(1, step.q_pe[:3]), ValueError, "all but the last axis"),
        "pool_rank": (call(2, pool[None]), ValueError, r"latent_pages must have rank 3"),
        "pool_width": (call(2, pool[..., :SMALL["rope_dim"]]), ValueError, "must hold"),
        "w_uk_heads": (call(3, step.w_uk[:, :2]), ValueError, r"w_uk must be \[kv_lora_rank"),
        "w_uv_rank": (call(4, step.w_uv[:5]), ValueError, r"w_uv must be \[kv_lora_rank"),
        "kv_lengths": (call(6, step.kv_lengths[:1]), ValueError, r"kv_lengths must be"),
        "cu_q_lens": (call(7, step.cu_q_lens[:2]), ValueError, r"cu_q_lens must be"),
        "num_seqs": (call(8, 3), ValueError, r"num_seqs must be in \[0, max_seqs=2\]"),
        "too_long": (call(6, np.array([5, 400], np.int32)), ValueError, r"kv_lengths\[1\]=400"),
        "q_int": (call(0, np.zeros(q.shape, np.int32)), TypeError, r"q_nope must be float"),
        "scale": (call(0, q, scale="x"), TypeError, "scale"),
        "dense_k_pe": (dcall(3, dense[3][:, :2]), ValueError, r"k_pe must be \[batch, kv_len"),
        "dense_batch": (dcall(2, jnp.concatenate([dense[2]] * 2)), ValueError, "batch"),
        "dense_lengths": (lambda: fj.mla_attention(*dense, kv_lengths=np.array([4], np.int32)),
                          ValueError, r"kv_lengths\[0\]=4 must lie in \[0, kv_len=3\]"),
        "write_width": (lambda: fj.mla_paged_write(pool, jnp.zeros((1, 40)), jnp.zeros((1, 16)),
                                                   np.array([0], np.int32)),
                        ValueError, "must hold kv_lora_rank"),
        "write_slot": (lambda: fj.mla_paged_write(pool, jnp.zeros((1, 32)), jnp.zeros((1, 16)),
                                                  np.array([10**6], np.int32)),
                       ValueError, r"slots\[0\]=1000000 is past the pool"),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("case", BAD.values(), ids=list(BAD))
def test_bad_input_one_line_error(case):
    assert_raises_as_listed(case)


def test_sharding_splits_heads():
    from forge_jax import sharding

    step = make_mla_step(rng(2), **MLA_MIXES["mixed"], page_size=8, **SMALL)
    with sharding.use_mesh(sharding.make_mesh({"dp": 1, "tp": 4})):
        out = jax.jit(fj.mla_paged_attention)(*step.args())
    assert_close(out, mla_step_ref(step, scale=default_scale(step)))
