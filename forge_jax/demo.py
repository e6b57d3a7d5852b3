"""``forge-jax demo``: every op once on fresh random data, checked against float64 NumPy.

Each line states the op, the implementation that ran, the largest error relative to the
tolerance the project's policy allows for that dtype and implementation
(:mod:`forge_jax.tolerances`), and a PASS/FAIL verdict; the command fails if any op does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import forge_jax as fj
from forge_jax import dispatch, tolerances


@dataclasses.dataclass(frozen=True)
class Check:
    op: str
    implementation: str
    worst: float  # max over elements of |out - ref| / (atol + rtol * |ref|); <= 1 passes
    max_abs_err: float

    @property
    def passed(self) -> bool:
        return self.worst <= 1.0

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"  {self.op:22s} {self.implementation:22s} max |err| {self.max_abs_err:.1e}"
                f"  ({self.worst:6.1%} of tolerance)  {verdict}")


def _check(op: str, out, ref) -> Check:
    out64 = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    tol = tolerances.tolerance(jnp.asarray(out).dtype, _implementation(op))
    err = np.abs(out64 - ref)
    bound = tol.atol + tol.rtol * np.abs(ref)
    worst = float(np.max(err / bound)) if np.isfinite(out64).all() else math.inf
    return Check(op, _implementation(op), worst, float(err.max()))


def _implementation(op: str) -> str:
    selection = dispatch.last_selection(op)
    return selection.implementation if selection else "?"


def _attention64(q, k, v, positions, lengths):
    """Causal GQA attention in float64 with per-sequence positions and lengths."""
    batch, q_len, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            logits = q[b, :, h] @ k[b, :, h // group].T / math.sqrt(dim)
            j = np.arange(k.shape[1])[None, :]
            seen = (j <= positions[b][:, None]) & (j < lengths[b])
            logits = np.where(seen, logits, logits.min() - 1e3)
            p = np.exp(logits - logits.max(-1, keepdims=True)) * seen
            total = p.sum(-1, keepdims=True)
            out[b, :, h] = (p / np.where(total > 0, total, 1.0)) @ v[b, :, h // group]
    return out


def _ragged64(q, k, v, kv_lengths, q_lens):
    """Ragged paged attention in float64: sequence ``i``'s ``q_lens[i]`` rows of ``q``
    (concatenated; rows past them are padding, zeros) are its last tokens of
    ``kv_lengths[i]``, over its keys ``k[i]`` ``[seq, kv_heads, head_dim]``."""
    out = np.zeros(q.shape)
    start = 0
    for i, (n, length) in enumerate(zip(q_lens, kv_lengths, strict=True)):
        rows = q[start:start + n][None]  # [1, n, heads, dim]: n queries at the end
        positions = np.arange(length - n, length)[None]
        out[start:start + n] = _attention64(rows, k[i][None, :length], v[i][None, :length],
                                            positions, np.array([length]))[0]
        start += n
    return out


def _gated_delta64(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64 (l2-normalised q and k)."""
    q, k, v, g, beta = (x.astype(np.float64) for x in (q, k, v, g, beta))
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    rep = v.shape[2] // k.shape[2]
    for t in range(q.shape[1]):
        for h in range(v.shape[2]):
            qt, kt = q[0, t, h // rep], k[0, t, h // rep]
            qt = qt / np.sqrt(qt @ qt + 1e-6) / math.sqrt(q.shape[-1])
            kt = kt / np.sqrt(kt @ kt + 1e-6)
            s[0, h] *= np.exp(g[0, t, h])
            s[0, h] += np.outer(kt, beta[0, t, h] * (v[0, t, h] - s[0, h].T @ kt))
            out[0, t, h] = s[0, h].T @ qt
    return out


def run(seed: int, print_fn: Callable[[str], None] = print) -> bool:
    """Runs every check; prints one line per op; returns whether all passed."""
    dispatch.clear_selections()
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    checks = []

    a, b = f32(4, 64, 32), f32(4, 32, 48)
    checks.append(_check("matmul", fj.matmul(a, b), a.astype(np.float64) @ b))

    # A weight [48, 64] in int4 groups of 32 with minimums, read back byte by byte (its
    # own random stream: the other checks' draws stay as they were).
    qrng = np.random.default_rng(seed + 1)
    q32 = lambda *shape: qrng.standard_normal(shape).astype(np.float32)
    wq = fj.quantize(jnp.asarray(q32(48, 64)), "int4", group_size=32, symmetric=False)
    packed = np.asarray(wq.values)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(48, 64).astype(np.float64)
    w64 = (nibbles * np.repeat(np.asarray(wq.scales, np.float64), 32, axis=1)
           + np.repeat(np.asarray(wq.minimums, np.float64), 32, axis=1))
    xq = q32(5, 64)
    checks.append(_check("quantized_matmul", fj.matmul(jnp.asarray(xq), wq, trans_b=True),
                         xq.astype(np.float64) @ w64.T))

    x, res, w = f32(6, 256), f32(6, 256), f32(256)
    y, _ = fj.rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6, residual=jnp.asarray(res))
    h = x.astype(np.float64) + res
    checks.append(_check("rms_norm", y, w * h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)))

    g, u = f32(6, 512), f32(6, 512)
    checks.append(_check("silu_mul", fj.silu_mul(jnp.asarray(g), jnp.asarray(u)),
                         g / (1.0 + np.exp(-g.astype(np.float64))) * u))

    # gelu_tanh_mul draws from its own stream too (the checks after it keep their inputs).
    grng = np.random.default_rng(seed + 2)
    g, u = (grng.standard_normal((6, 384)).astype(np.float32) for _ in range(2))
    g64 = g.astype(np.float64)
    checks.append(_check(
        "gelu_tanh_mul", fj.gelu_tanh_mul(jnp.asarray(g), jnp.asarray(u)),
        0.5 * g64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u))

    s = f32(5, 33)
    e = np.exp(s - s.max(-1, keepdims=True).astype(np.float64))
    checks.append(_check("softmax", fj.softmax(jnp.asarray(s)), e / e.sum(-1, keepdims=True)))

    batch, t, heads, kv_heads, dim = 2, 12, 8, 2, 64
    pos = np.broadcast_to(np.arange(5, 5 + t, dtype=np.int32), (batch, t))
    xr = f32(batch, t, heads, dim)
    inv = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = pos[..., None, None] * inv  # [b, t, 1, d/2]
    x1, x2 = xr[..., :dim // 2].astype(np.float64), xr[..., dim // 2:]
    ref = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                          x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    checks.append(_check("rope", fj.rope(jnp.asarray(xr), jnp.asarray(pos)), ref))

    q, k, v = f32(batch, t, heads, dim), f32(batch, t, kv_heads, dim), f32(batch, t, kv_heads, dim)
    lengths = np.array([t, t - 4], np.int32)
    positions = lengths[:, None] - t + np.arange(t)[None, :]
    out = jax.jit(lambda q, k, v, n: fj.attention(q, k, v, kv_lengths=n))(q, k, v, lengths)
    ref = _attention64(q.astype(np.float64), k, v, positions, lengths)
    checks.append(_check("attention", out, ref))  # sequence 1's first 4 queries see nothing

    # Grouped: 4 groups of 9 rows, one empty, one of a single row.
    sizes = np.array([5, 0, 1, 3], np.int32)
    xg, wg = f32(9, 32), f32(4, 32, 24)
    ref_g = np.concatenate([xg[a:b].astype(np.float64) @ wg[i] for i, (a, b) in
                          enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes), strict=True))])
    checks.append(_check("grouped_matmul", fj.grouped_matmul(
        jnp.asarray(xg), jnp.asarray(wg), jnp.asarray(sizes)), ref_g))

    logits = f32(6, 8)
    weights, _ = fj.moe_route(jnp.asarray(logits), 2, renormalize=True)
    p64 = np.exp(logits - logits.max(-1, keepdims=True).astype(np.float64))
    p64 /= p64.sum(-1, keepdims=True)
    top = -np.sort(-p64, axis=-1)[:, :2]
    checks.append(_check("moe_route", weights, top / top.sum(-1, keepdims=True)))

    # conv2d, NHWC, stride 2, "SAME" padding (here one row and column on each side).
    xc, wc = f32(2, 7, 7, 4), f32(3, 3, 4, 5)
    xp = np.pad(xc.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    ref_c = np.stack([np.stack([
        np.einsum("bpqc,pqco->bo", xp[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3], wc)
        for j in range(4)], 1) for i in range(4)], 1)
    checks.append(_check("conv2d", fj.conv2d(jnp.asarray(xc), jnp.asarray(wc), stride=2,
                                             padding="SAME"), ref_c))

    table, ids = f32(300, 16), rng.integers(0, 300, (3, 7)).astype(np.int32)
    checks.append(_check("embedding", fj.embedding(jnp.asarray(table), jnp.asarray(ids)),
                         table[ids].astype(np.float64)))

    page, num_pages = 4, 16
    pages_per_seq = -(-t // page)
    order = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
    k_pages = np.full((kv_heads, num_pages, page, dim), np.nan, np.float32)
    v_pages = k_pages.copy()
    for bi in range(batch):
        for i, p in enumerate(order[bi]):
            rows = slice(i * page, (i + 1) * page)
            k_pages[:, p] = np.transpose(k[bi, rows], (1, 0, 2))
            v_pages[:, p] = np.transpose(v[bi, rows], (1, 0, 2))
    out = fj.paged_attention(jnp.asarray(q[:, -1]), jnp.asarray(k_pages), jnp.asarray(v_pages),
                             jnp.asarray(order.astype(np.int32)), jnp.asarray(lengths))
    checks.append(_check("paged_attention", out, ref[:, -1]))

    # Ragged: sequence 0's last 3 tokens (a prefill chunk), sequence 1's last one (a decode
    # step), and a padding row; over the same pages, whose unused ones hold NaN.
    q_lens = np.array([3, 1])
    cu_q_lens = np.array([0, 3, 4], np.int32)
    q_rows = f32(int(cu_q_lens[-1]) + 1, heads, dim)
    out = fj.ragged_paged_attention(
        jnp.asarray(q_rows), jnp.asarray(k_pages), jnp.asarray(v_pages),
        jnp.asarray(order.astype(np.int32)), jnp.asarray(lengths), jnp.asarray(cu_q_lens), 2)
    checks.append(_check("ragged_paged_attention", out,
                         _ragged64(q_rows.astype(np.float64), k, v, lengths, q_lens)))

    checks.append(_check("paged_gather", fj.paged_gather(
        jnp.asarray(k_pages), jnp.asarray(order.astype(np.int32)), jnp.asarray(lengths)),
        np.where(np.arange(t)[None, :, None, None] < lengths[:, None, None, None],
                 k.astype(np.float64), 0.0)))

    # Writes and copies over pools of random values: every element is compared.
    pools = f32(2, kv_heads, num_pages, page, dim)
    slots = rng.permutation(num_pages * page)[:5].astype(np.int32)
    slots[2] = -1  # skipped, as padding is
    new_k, new_v = f32(5, kv_heads, dim), f32(5, kv_heads, dim)
    ref = pools.astype(np.float64)
    for i, slot in enumerate(slots):
        if slot >= 0:
            ref[0, :, slot // page, slot % page] = new_k[i]
            ref[1, :, slot // page, slot % page] = new_v[i]
    out = fj.paged_write(jnp.asarray(pools[0]), jnp.asarray(pools[1]), jnp.asarray(new_k),
                         jnp.asarray(new_v), jnp.asarray(slots))
    checks.append(_check("paged_write", jnp.stack(out), ref))

    src, dst = rng.permutation(num_pages)[:4], rng.permutation(num_pages)[:4]
    copies = np.stack([src, dst], axis=1).astype(np.int32)
    copies[1, 0] = -1  # skipped
    ref = pools.astype(np.float64)
    kept = copies[:, 0] >= 0
    ref[:, :, copies[kept, 1]] = pools[:, :, copies[kept, 0]]  # every source read first
    out = fj.copy_pages(jnp.asarray(pools[0]), jnp.asarray(pools[1]), jnp.asarray(copies))
    checks.append(_check("copy_pages", jnp.stack(out), ref))
    checks.extend(_mla_checks(rng, f32))

    # Gated delta rule: 2 key heads, 4 value heads, 11 tokens in chunks of 4, from a state;
    # the reference runs the recurrence token by token.
    grng = np.random.default_rng(seed + 2)
    g32 = lambda *shape: grng.standard_normal(shape).astype(np.float32)
    qg, kg, vg, s0 = g32(1, 11, 2, 8), g32(1, 11, 2, 8), g32(1, 11, 4, 8), g32(1, 4, 8, 8)
    gate = -np.abs(g32(1, 11, 4)) * 0.3
    beta = 1 / (1 + np.exp(-g32(1, 11, 4)))
    out, _ = fj.gated_delta_rule(*(jnp.asarray(x) for x in (qg, kg, vg, gate, beta)),
                                 state=jnp.asarray(s0), chunk_size=4)
    checks.append(_check("gated_delta_rule", out, _gated_delta64(qg, kg, vg, gate, beta, s0)))
    xc1, wc1 = g32(2, 9, 6), g32(4, 6)
    xx = np.concatenate([np.zeros((2, 3, 6)), xc1.astype(np.float64)], axis=1)
    pre = sum(wc1[i].astype(np.float64) * xx[:, i:i + 9] for i in range(4))
    checks.append(_check("causal_conv1d", fj.causal_conv1d(jnp.asarray(xc1), jnp.asarray(wc1))[0],
                         pre / (1 + np.exp(-pre))))

    print_fn("  op                     implementation         error vs float64 NumPy"
             "        verdict (project tolerance)")
    for check in checks:
        print_fn(str(check))
    failed = [c.op for c in checks if not c.passed]
    print_fn(f"\n{len(checks) - len(failed)}/{len(checks)} ops within tolerance"
             + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return not failed


def _mla64(q_nope, q_pe, c, k_pe, w_uk, w_uv, positions):
    """Multi-head latent attention of one sequence in float64, expanded: head ``h``'s keys
    ``[c @ w_uk[:, h], k_pe]`` and values ``c @ w_uv[:, h]``; query ``t`` sees keys
    ``j <= positions[t]``."""
    k_nope = np.einsum("sc,chd->shd", c, w_uk)
    v = np.einsum("sc,chd->shd", c, w_uv)
    scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    logits = scale * (np.einsum("thd,shd->ths", q_nope, k_nope)
                      + np.einsum("thd,sd->ths", q_pe, k_pe))
    logits = np.where(np.arange(c.shape[0]) <= positions[:, None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("ths,shd->thd", p / p.sum(-1, keepdims=True), v)


def _mla_checks(rng, f32) -> list[Check]:
    """The latent ops: a dense prefill, then the same latents written into NaN-filled pages
    and attended by a ragged step (a prefill chunk and a decode row), weight-absorbed."""
    heads, rank, rope, nope, v_dim, n, page = 4, 32, 8, 16, 12, 11, 4
    q_nope, q_pe = f32(n, heads, nope), f32(n, heads, rope)
    c, k_pe = f32(n, rank), f32(n, rope)
    w_uk, w_uv = f32(rank, heads, nope) / rank ** 0.5, f32(rank, heads, v_dim) / rank ** 0.5
    as64 = [x.astype(np.float64) for x in (q_nope, q_pe, c, k_pe, w_uk, w_uv)]
    ref = _mla64(*as64, np.arange(n))
    out = fj.mla_attention(*(jnp.asarray(x[None]) for x in (q_nope, q_pe, c, k_pe)),
                           jnp.asarray(w_uk), jnp.asarray(w_uv))[0]
    checks = [_check("mla_attention", out, ref)]
    pool = jnp.full((5, page, rank + rope), jnp.nan, jnp.float32)
    table = rng.permutation(5)[None, :3].astype(np.int32)
    slots = (table[0, np.arange(n) // page] * page + np.arange(n) % page).astype(np.int32)
    pool = fj.mla_paged_write(pool, jnp.asarray(c), jnp.asarray(k_pe), jnp.asarray(slots))
    flat = np.asarray(pool, np.float64).reshape(-1, rank + rope)[slots]
    checks.append(_check("mla_paged_write", flat, np.concatenate(as64[2:4], axis=1)))
    # Sequence 0's last 3 tokens, sequence 1 (the first 6 of the same latents) decoding.
    tables = np.concatenate([table, table], 0)
    rows = np.r_[n - 3:n, 5]
    out = fj.mla_paged_attention(
        jnp.asarray(q_nope[rows]), jnp.asarray(q_pe[rows]), pool, jnp.asarray(w_uk),
        jnp.asarray(w_uv), jnp.asarray(tables), jnp.asarray(np.array([n, 6], np.int32)),
        jnp.asarray(np.array([0, 3, 4], np.int32)), 2)
    checks.append(_check("mla_paged_attention", out, ref[rows]))
    return checks
