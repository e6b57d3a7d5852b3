"""Multi-head latent attention cases: real-model widths, ragged steps over a NaN-filled latent
pool, and the float64 reference in its *expanded* form (per-head keys and values from the
latent, the formula DeepSeek's modelling code computes), written from the published formula,
not from forge_jax's absorbed computation."""

from __future__ import annotations

import dataclasses

import numpy as np

from cases.base import parametrize_from
from cases.paged import RAGGED_MIXES
from cases.references import f64

# DeepSeek-V3's widths (kv_lora_rank 512, rope 64, nope 128, v 128, page 64), its 128 heads
# scaled down in count; and a small shape for quick checks.
DEEPSEEK_V3 = dict(heads=8, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)
SMALL = dict(heads=4, kv_lora_rank=32, rope_dim=16, nope_dim=24, v_dim=20)

MLA_MIXES = RAGGED_MIXES


def mla_ref(q_nope, q_pe, latent, k_pe, w_uk, w_uv, *, scale, positions, length):
    """One sequence, expanded: ``q_nope, q_pe [t, heads, *]``, ``latent [s, rank]``, ``k_pe
    [s, rope]``; query ``t`` at ``positions[t]`` sees keys ``j <= positions[t]``, ``j <
    length``. Returns float64 ``[t, heads, v_dim]`` (zeros for a query that sees nothing)."""
    q_nope, q_pe, latent, k_pe, w_uk, w_uv = map(f64, (q_nope, q_pe, latent, k_pe, w_uk, w_uv))
    s = latent.shape[0]
    k_nope = np.einsum("sc,chd->shd", latent, w_uk)
    v = np.einsum("sc,chd->shd", latent, w_uv)
    heads = q_nope.shape[1]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (s, heads, k_pe.shape[1]))], -1)
    q = np.concatenate([q_nope, q_pe], -1)
    out = np.zeros((q.shape[0], heads, v.shape[2]))
    for t, p in enumerate(positions):
        seen = (np.arange(s) <= p) & (np.arange(s) < length)
        if not seen.any():
            continue
        logits = scale * np.einsum("hd,shd->hs", q[t], k[seen])
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        out[t] = np.einsum("hs,shd->hd", w, v[seen])
    return out


@dataclasses.dataclass
class MlaStep:
    """One ragged MLA step as NumPy arrays (the op's arguments) and the dense truth."""

    q_nope: np.ndarray
    q_pe: np.ndarray
    latent_pages: np.ndarray  # NaN wherever no query may look
    w_uk: np.ndarray
    w_uv: np.ndarray
    block_tables: np.ndarray
    kv_lengths: np.ndarray
    cu_q_lens: np.ndarray
    num_seqs: int
    latents: list  # per sequence, [kv_len, rank + rope] (what its pages hold)

    def args(self):
        return (self.q_nope, self.q_pe, self.latent_pages, self.w_uk, self.w_uv,
                self.block_tables, self.kv_lengths, self.cu_q_lens, self.num_seqs)


def make_mla_step(gen, q_lens, kv_lens, *, max_seqs, total_tokens, page_size, heads,
                  kv_lora_rank, rope_dim, nope_dim, v_dim, dtype=np.float32, q_dtype=None,
                  spare_pages=3, width=None) -> MlaStep:
    """Random sequences on randomly permuted pages of a NaN-filled latent pool; ignored
    sequences' entries hold huge values of either sign, padding rows of the queries NaN.
    A sequence with no new token (q_len 0) is invisible to every query: its slots stay NaN.
    ``width``: the pool's last axis (default ``kv_lora_rank + rope_dim``); its padding lanes
    hold NaN everywhere (never to be read)."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    n = len(q_lens)
    used = [-(-int(x) // page_size) for x in kv_lens]
    pages_per_seq = max(used) + 1
    num_pages = sum(used) + spare_pages
    used_width = kv_lora_rank + rope_dim
    pool = np.full((num_pages, page_size, width or used_width), np.nan)
    tables = gen.integers(-2**30, 2**30, (max_seqs, pages_per_seq))
    kv = gen.integers(-2**30, 2**30, max_seqs)
    cu = gen.integers(-2**30, 2**30, max_seqs + 1)
    cu[0] = 0
    cu[1:n + 1] = np.cumsum(q_lens)
    kv[:n] = kv_lens
    order = iter(gen.permutation(num_pages))
    latents = []
    for i in range(n):
        tables[i, :used[i]] = [next(order) for _ in range(used[i])]
        seq = gen.standard_normal((kv_lens[i], used_width)).astype(np.dtype(dtype))
        latents.append(seq.astype(np.float64))
        if q_lens[i] == 0:
            continue
        for pos in range(kv_lens[i]):
            pool[tables[i, pos // page_size], pos % page_size, :used_width] = seq[pos]
    q_dtype = np.dtype(q_dtype or dtype)
    q_nope = gen.standard_normal((total_tokens, heads, nope_dim))
    q_pe = gen.standard_normal((total_tokens, heads, rope_dim))
    q_nope[cu[n]:] = np.nan
    q_pe[cu[n]:] = np.nan
    # Scaled so that the absorbed logits stay O(1): softmax weights far from one-hot.
    w_uk = gen.standard_normal((kv_lora_rank, heads, nope_dim)) / np.sqrt(kv_lora_rank)
    w_uv = gen.standard_normal((kv_lora_rank, heads, v_dim)) / np.sqrt(kv_lora_rank)
    return MlaStep(q_nope.astype(q_dtype), q_pe.astype(q_dtype), pool.astype(np.dtype(dtype)),
                   w_uk.astype(np.float32), w_uv.astype(np.float32), tables.astype(np.int32),
                   kv.astype(np.int32), cu.astype(np.int32), n, latents)


def mla_step_ref(step: MlaStep, *, scale) -> np.ndarray:
    """float64 ``[total_tokens, heads, v_dim]`` of a step: each sequence's rows through
    :func:`mla_ref` on its latents; padding rows zero."""
    rank = step.w_uk.shape[0]
    out = np.zeros((step.q_nope.shape[0], step.q_nope.shape[1], step.w_uv.shape[2]))
    for i in range(step.num_seqs):
        a, b = step.cu_q_lens[i], step.cu_q_lens[i + 1]
        if a == b:
            continue
        kv = step.kv_lengths[i]
        seq = step.latents[i]
        positions = kv - (b - np.arange(a, b))
        out[a:b] = mla_ref(step.q_nope[a:b], step.q_pe[a:b], seq[:, :rank], seq[:, rank:],
                           step.w_uk, step.w_uv, scale=scale, positions=positions, length=kv)
    return out


def default_scale(step: MlaStep) -> float:
    return (step.q_nope.shape[2] + step.q_pe.shape[2]) ** -0.5


class MlaPagedAttentionCases:
    """The behaviours of every kernel implementation of ``fj.mla_paged_attention``: ragged
    steps (``MLA_MIXES``) at real widths against the float64 expanded reference and the XLA
    implementation; padding rows exactly zero; NaN in every slot no query sees (and in the
    padding lanes of a wider pool) never reaching an output. Mixed into a class that also
    derives from ``cases.base.ImplementationCases`` (``IMPLEMENTATION``, ``INTERPRET``).

    Case table ``CASES``: ``{id: (mix, shape, dtype, page_size, width)}``.
    """

    CASES: dict[str, tuple]

    @parametrize_from("CASES")
    def test_matches_references(self, case):
        import jax
        import jax.numpy as jnp

        import forge_jax as fj
        from cases.checks import assert_close

        mix, shape, dtype, page_size, width = case
        step = make_mla_step(np.random.default_rng([len(mix), page_size]), **MLA_MIXES[mix],
                             page_size=page_size, dtype=dtype, width=width, **shape)
        args = step.args()
        call = jax.jit(fj.mla_paged_attention, static_argnames=("implementation",))
        out = call(*args, implementation=self.IMPLEMENTATION)
        assert out.shape == (step.q_nope.shape[0], shape["heads"], shape["v_dim"])
        assert out.dtype == jnp.dtype(dtype)
        ref = mla_step_ref(step, scale=default_scale(step))
        assert_close(out, ref, dtype=dtype, implementation=self.IMPLEMENTATION)
        xla = call(*args, implementation="xla")
        assert_close(out, f64(xla), dtype=dtype, implementation=self.IMPLEMENTATION,
                     allow_zero_ref=True)
        np.testing.assert_array_equal(f64(out)[step.cu_q_lens[step.num_seqs]:], 0.0)

