"""Gated delta-rule linear attention (Gated DeltaNet, as in Qwen3-Next and Qwen3.5) and the
short causal convolution that feeds it.

The recurrence, per sequence and value head ``h`` (key head ``h // (v_heads // k_heads)``),
with a state ``S`` of ``[dk, dv]`` carried from token to token and from call to call::

    q_t = scale * l2norm(q_t),  k_t = l2norm(k_t)       # l2norm(x) = x / sqrt(|x|^2 + 1e-6)
    S   = exp(g_t) * S                                   # the gate (log decay g_t <= 0)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T           # the delta rule, learning rate beta_t
    o_t = S^T q_t

Prefill computes it in chunks of ``chunk_size`` tokens: within a chunk the delta-rule
updates fold into one unit-lower-triangular solve (the UT transform of the DeltaNet papers,
the "WY representation" of the product of Householder-like updates), and only the state
crosses chunk boundaries; decode (one token) runs the recurrence directly. Both are the
same function of the inputs; the ``"xla_recurrent"`` implementation runs the token-by-token
recurrence at every length (the check the chunked forms are tested against besides the
float64 NumPy reference).

:func:`gated_delta_gates` computes ``g`` and ``beta`` the way Qwen3-Next parameterises
them (``A_log``, ``dt_bias``); :func:`causal_conv1d` is the depthwise convolution over the
last ``kernel`` tokens applied to the q/k/v projections before the rule, with its state
(the last ``kernel - 1`` inputs) read and returned.

Variable-length batches are right-padded: ``lengths[b]`` tokens of row ``b`` are real, the
rest leave the state untouched and get zeros out, whatever they hold (NaN included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from forge_jax import _checks, dispatch, sharding

L2NORM_EPS = 1e-6  # the FLA library's and transformers' l2norm epsilon
ACTIVATIONS = (None, "silu")
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_lengths(lengths, batch: int, seq: int) -> None:
    _checks.array("lengths", lengths, ndim=1, kind="int")
    if lengths.shape[0] != batch:
        raise ValueError(f"lengths must be [batch] = ({batch},), got {lengths.shape=}")
    rule = f"must lie in [0, seq={seq}]"
    values = _checks.concrete_ints(lengths)
    if values is not None:
        bad = np.flatnonzero((values < 0) | (values > seq))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"lengths[{b}]={values[b]} {rule}")
    elif _checks.debug_checks_enabled():
        values = jnp.asarray(lengths)
        bad = (values < 0) | (values > seq)
        b = _checks.first_bad(bad)
        _checks.traced_check(~jnp.any(bad), f"lengths[{{b}}]={{n}} {rule}", b=b, n=values[b])


def valid_tokens(lengths, batch: int, seq: int) -> jax.Array:
    """``[batch, seq]`` bool: which tokens are real (all when ``lengths`` is None)."""
    if lengths is None:
        return jnp.ones((batch, seq), bool)
    return jnp.arange(seq)[None, :] < jnp.asarray(lengths)[:, None]


# ---------------------------------------------------------------------------------------
# Gates


def gated_delta_gates(a, b, A_log, dt_bias):  # noqa: N803 (the checkpoints' parameter name)
    """The gates of Qwen3-Next's Gated DeltaNet from their projections.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` (the log decay, <= 0) and
    ``beta = sigmoid(b)`` (the delta rule's learning rate, in (0, 1)), float32 math.

    Args:
      a, b: ``[..., v_heads]`` float, the ``in_proj_ba`` projections of the tokens.
      A_log, dt_bias: ``[v_heads]`` float parameters, read in float32.

    Returns:
      ``(g, beta)``, both ``a``'s shape, float32.
    """
    _checks.array("a", a, min_ndim=1)
    _checks.array("b", b, min_ndim=1)
    _checks.array("A_log", A_log, ndim=1)
    _checks.array("dt_bias", dt_bias, ndim=1)
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"a and b must have one shape, got {a.shape=}, {b.shape=}")
    heads = a.shape[-1]
    if A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"A_log and dt_bias must be [v_heads] = ({heads},) (a.shape[-1]), got "
                         f"{A_log.shape=}, {dt_bias.shape=}")
    with jax.named_scope("gated_delta_gates"):
        f32 = jnp.float32
        g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
        return g, jax.nn.sigmoid(b.astype(f32))


# ---------------------------------------------------------------------------------------
# gated_delta_rule


def _gated_delta_rule_args(q, k, v, g, beta, *, state=None, lengths=None, scale=None,
                           qk_l2norm=True, chunk_size=64):
    _checks.array("q", q, ndim=4)
    _checks.array("k", k, ndim=4)
    _checks.array("v", v, ndim=4)
    _checks.same_dtype(("q", q), ("k", k))
    _checks.same_dtype(("q", q), ("v", v))
    if tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"q and k must have one shape [batch, seq, k_heads, dk], got "
                         f"{q.shape=}, {k.shape=}")
    batch, seq, k_heads, dk = q.shape
    if tuple(v.shape[:2]) != (batch, seq):
        raise ValueError(f"v must be [batch, seq, v_heads, dv] with q's batch and seq, got "
                         f"{v.shape=}, {q.shape=}")
    v_heads, dv = v.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"v_heads must be a multiple of k_heads (grouped value heads), got "
                         f"{v.shape=}, {k.shape=}")
    for name, x in (("g", g), ("beta", beta)):
        _checks.array(name, x, ndim=3)
        if tuple(x.shape) != (batch, seq, v_heads):
            raise ValueError(f"{name} must be [batch, seq, v_heads] = {(batch, seq, v_heads)}, "
                             f"got {name}.shape={tuple(x.shape)}")
    if state is not None:
        _checks.array("state", state, ndim=4)
        if tuple(state.shape) != (batch, v_heads, dk, dv):
            raise ValueError(f"state must be [batch, v_heads, dk, dv] = "
                             f"{(batch, v_heads, dk, dv)}, got {state.shape=}")
    if lengths is not None:
        _check_lengths(lengths, batch, seq)
    scale = dk ** -0.5 if scale is None else _checks.positive_float("scale", scale)
    if not isinstance(qk_l2norm, bool):
        raise TypeError(f"qk_l2norm must be a bool, got {qk_l2norm=!r}")
    chunk_size = _checks.positive_int("chunk_size", chunk_size)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=state, lengths=lengths, scale=scale,
                qk_l2norm=qk_l2norm, chunk_size=chunk_size)


def gated_delta_rule(q, k, v, g, beta, *, state=None, lengths=None, scale=None,
                     qk_l2norm=True, chunk_size=64, implementation=None):
    """Gated delta-rule linear attention over a right-padded batch, with its state.

    Per value head ``h`` (key head ``j = h // (v_heads // k_heads)``) and token ``t``, with
    ``q̂ = scale * l2norm(q[t, j])`` and ``k̂ = l2norm(k[t, j])`` (``l2norm(x) = x /
    sqrt(x . x + 1e-6)``, skipped when ``qk_l2norm`` is False)::

        S <- exp(g[t, h]) * S
        S <- S + k̂ (beta[t, h] * (v[t, h] - S^T k̂))^T
        out[t, h] = S^T q̂

    starting from ``state`` (zeros when None), all math in float32. Tokens ``t >=
    lengths[b]`` leave the state unchanged and get zeros out, whatever they hold. Prefill
    runs in chunks of ``chunk_size`` tokens (the UT transform inside a chunk, the state
    across chunks); a single token runs the recurrence. Every ``chunk_size`` gives the same
    result up to float32 rounding, and calling the op on a sequence in pieces, passing each
    call's state to the next, equals one call on the whole.

    Args:
      q, k: ``[batch, seq, k_heads, dk]``, float32/float16/bfloat16, one dtype with ``v``.
      v: ``[batch, seq, v_heads, dv]``, ``v_heads % k_heads == 0``.
      g: ``[batch, seq, v_heads]``, the log decay (``<= 0`` for a decaying state), any float
        dtype, read in float32 (see :func:`gated_delta_gates`).
      beta: ``[batch, seq, v_heads]``, the learning rate (usually in ``(0, 1)``), any float.
      state: optional ``[batch, v_heads, dk, dv]``, any float dtype (float32 recommended:
        the state integrates every token).
      lengths: optional int ``[batch]`` in ``[0, seq]``: the real tokens of each row.
      scale: the query scale, default ``1 / sqrt(dk)``.
      qk_l2norm: L2-normalise q and k (Qwen3-Next does).
      chunk_size: tokens per chunk of the chunked form, a positive int (64 as FLA).
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``(out, new_state)``: ``out`` ``[batch, seq, v_heads, dv]`` in ``v.dtype``,
      ``new_state`` ``[batch, v_heads, dk, dv]`` in ``state.dtype`` (float32 when None).
    """
    args = _gated_delta_rule_args(q, k, v, g, beta, state=state, lengths=lengths, scale=scale,
                                  qk_l2norm=qk_l2norm, chunk_size=chunk_size)
    return dispatch.call("gated_delta_rule", args, implementation)


def _gated_delta_rule_partition(args, config):
    """How ``gated_delta_rule`` splits over a mesh: rows over the data axis, heads over the
    tensor axis when both head counts divide (a value head's key head stays on its shard)."""
    q, v = args["q"], args["v"]
    b = sharding.divisible(config, config.dp_name, q.shape[0])
    h = sharding.divisible(config, config.tp_name, q.shape[2], v.shape[2])
    qs, gs = P(b, None, h, None), P(b, None, h)
    ss = P(b, h, None, None)
    specs = {"q": qs, "k": qs, "v": qs, "g": gs, "beta": gs}
    if args["state"] is not None:
        specs["state"] = ss
    if args["lengths"] is not None:
        specs["lengths"] = P(b)
    return specs, (qs, ss)


dispatch.define("gated_delta_rule", _gated_delta_rule_args,
                partition=_gated_delta_rule_partition)


def l2norm(x):
    """``x / sqrt(x . x + 1e-6)`` over the last axis (the FLA library's and transformers')."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, state, lengths, *, scale, qk_l2norm):
    """float32 inputs with the key heads repeated to the value heads and padded tokens
    neutralised (``g = beta = 0``, zero vectors: such a token leaves the state as it was)."""
    f32 = jnp.float32
    batch, seq, k_heads, dk = q.shape
    v_heads, dv = v.shape[2:]
    valid = valid_tokens(lengths, batch, seq)  # [batch, seq]
    q, k, v = (x.astype(f32) for x in (q, k, v))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    rep = v_heads // k_heads
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    vec = valid[:, :, None, None]
    q, k, v = (jnp.where(vec, x, 0.0) for x in (q, k, v))
    g = jnp.where(valid[:, :, None], g.astype(f32), 0.0)
    beta = jnp.where(valid[:, :, None], beta.astype(f32), 0.0)
    s0 = (jnp.zeros((batch, v_heads, dk, dv), f32) if state is None else state.astype(f32))
    return q, k, v, g, beta, s0, valid


def _recurrent(q, k, v, g, beta, s0):
    """The token-by-token recurrence on prepared inputs ``[batch, seq, heads, d]``."""

    def step(s, xs):  # s: [batch, heads, dk, dv]
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=_HIGHEST)
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - kv) * b_t[..., None], precision=_HIGHEST)
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=_HIGHEST)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, out = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(out, 0, 1), s


def _chunked(q, k, v, g, beta, s0, *, chunk_size):
    """The chunked form on prepared inputs ``[batch, seq, heads, d]`` (the UT transform)."""
    batch, seq, heads, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = -seq % c
    if pad:  # padded tokens: zero vectors, g = beta = 0, so they change nothing
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (seq + pad) // c
    # [batch, seq, heads, d] -> [n, batch, heads, c, d]: chunks lead for the scan.
    def chunks(x):
        x = x.reshape(batch, n, c, heads, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # g, beta: [n, b, h, c]
    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start through each token
    causal = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i; masked before exp, so never overflows.
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # [n, b, h, c, c]
    k_beta = k * beta[..., None]
    kk = jnp.einsum("nbhik,nbhjk->nbhij", k_beta, k, precision=_HIGHEST)
    lower = jnp.where(strict, kk * decay, 0.0)
    # (I + L)^-1 applied by a unit-lower-triangular solve: u = the values each token writes
    # given the chunk's earlier tokens, w = the decayed keys that read the incoming state.
    system = lower + jnp.eye(c, dtype=lower.dtype)
    solve = functools.partial(jax.scipy.linalg.solve_triangular, lower=True,
                              unit_diagonal=True)
    u = solve(system, v * beta[..., None])
    w = solve(system, k_beta * jnp.exp(cum)[..., None])
    attn = jnp.einsum("nbhik,nbhjk->nbhij", q, k, precision=_HIGHEST) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [n, b, h, 1, 1]

    def step(s, xs):  # s: [batch, heads, dk, dv]
        u_i, w_i, q_i, k_i, attn_i, decay_i = xs
        v_new = u_i - jnp.einsum("bhck,bhkv->bhcv", w_i, s, precision=_HIGHEST)
        out = (jnp.einsum("bhck,bhkv->bhcv", q_i, s, precision=_HIGHEST)
               + jnp.einsum("bhij,bhjv->bhiv", attn_i, v_new, precision=_HIGHEST))
        s = s * decay_i + jnp.einsum("bhck,bhcv->bhkv", k_i, v_new, precision=_HIGHEST)
        return s, out

    s, out = jax.lax.scan(step, s0, (u, w, q_decayed, k_decayed, attn, chunk_decay))
    # [n, b, h, c, dv] -> [b, n * c, h, dv]
    out = jnp.moveaxis(out, 0, 1).transpose(0, 1, 3, 2, 4).reshape(batch, n * c, heads, dv)
    return out[:, :seq], s


def _finish(out, s, valid, v, state):
    out = jnp.where(valid[:, :, None, None], out, 0.0).astype(v.dtype)
    return out, s.astype(jnp.float32 if state is None else state.dtype)


@dispatch.register("gated_delta_rule", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math: chunked UT transform, or the recurrence "
                               "for one token")
def gated_delta_rule_xla(q, k, v, g, beta, *, state, lengths, scale, qk_l2norm, chunk_size):
    with jax.named_scope("gated_delta_rule"):
        qf, kf, vf, gf, bf, s0, valid = _prepare(q, k, v, g, beta, state, lengths, scale=scale,
                                                 qk_l2norm=qk_l2norm)
        if q.shape[1] == 1:
            out, s = _recurrent(qf, kf, vf, gf, bf, s0)
        else:
            out, s = _chunked(qf, kf, vf, gf, bf, s0, chunk_size=chunk_size)
        return _finish(out, s, valid, v, state)


@dispatch.register("gated_delta_rule", "xla_recurrent",
                   description="jnp, float32 math: the token-by-token recurrence (by name)")
def gated_delta_rule_xla_recurrent(q, k, v, g, beta, *, state, lengths, scale, qk_l2norm,
                                   chunk_size):
    del chunk_size
    with jax.named_scope("gated_delta_rule"):
        qf, kf, vf, gf, bf, s0, valid = _prepare(q, k, v, g, beta, state, lengths, scale=scale,
                                                 qk_l2norm=qk_l2norm)
        out, s = _recurrent(qf, kf, vf, gf, bf, s0)
        return _finish(out, s, valid, v, state)


# ---------------------------------------------------------------------------------------
# causal_conv1d


def _causal_conv1d_args(x, weight, bias=None, *, state=None, lengths=None, activation="silu"):
    _checks.array("x", x, ndim=3)
    _checks.array("weight", weight, ndim=2)
    batch, seq, channels = x.shape
    kernel = weight.shape[0]
    if weight.shape[1] != channels:
        raise ValueError(f"weight must be [kernel, channels] with x's {channels} channels, got "
                         f"{weight.shape=}, {x.shape=}")
    if bias is not None:
        _checks.array("bias", bias, ndim=1)
        if bias.shape != (channels,):
            raise ValueError(f"bias must be [channels] = ({channels},), got {bias.shape=}")
    if state is not None:
        _checks.array("state", state, ndim=3)
        if tuple(state.shape) != (batch, kernel - 1, channels):
            raise ValueError(f"state must be [batch, kernel - 1, channels] = "
                             f"{(batch, kernel - 1, channels)}, got {state.shape=}")
    if lengths is not None:
        _check_lengths(lengths, batch, seq)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation=!r}")
    return dict(x=x, weight=weight, bias=bias, state=state, lengths=lengths,
                activation=activation)


def causal_conv1d(x, weight, bias=None, *, state=None, lengths=None, activation="silu",
                  implementation=None):
    """Depthwise causal convolution over the last ``kernel`` tokens, with its state.

    With ``xx = concat(state, x)`` along the tokens (``state`` the ``kernel - 1`` inputs
    before ``x``, zeros when None)::

        out[b, t, c] = act(bias[c] + sum_{i < kernel} weight[i, c] * xx[b, t + i, c])

    float32 math, ``act`` SiLU or the identity: PyTorch's ``Conv1d(groups=channels,
    padding=kernel - 1)`` over a sequence's prefix, continued across calls. Tokens ``t >=
    lengths[b]`` get zeros out and are not read.

    Args:
      x: ``[batch, seq, channels]``, float32/float16/bfloat16.
      weight: ``[kernel, channels]`` (PyTorch's ``[channels, 1, kernel]`` transposed), any
        float dtype, read in float32.
      bias: optional ``[channels]``, any float dtype.
      state: optional ``[batch, kernel - 1, channels]``, the previous inputs, oldest first,
        any float dtype.
      lengths: optional int ``[batch]`` in ``[0, seq]``: the real tokens of each row.
      activation: ``"silu"`` or ``None``.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``(out, new_state)``: ``out`` ``[batch, seq, channels]`` in ``x.dtype``;
      ``new_state`` the last ``kernel - 1`` inputs of ``concat(state, x[:, :lengths])`` in
      ``state.dtype`` (``x.dtype`` when None).
    """
    args = _causal_conv1d_args(x, weight, bias, state=state, lengths=lengths,
                               activation=activation)
    return dispatch.call("causal_conv1d", args, implementation)


def _causal_conv1d_partition(args, config):
    """How ``causal_conv1d`` splits over a mesh: rows over the data axis, channels (each
    convolved on its own) over the tensor axis."""
    x = args["x"]
    b = sharding.divisible(config, config.dp_name, x.shape[0])
    c = sharding.divisible(config, config.tp_name, x.shape[2])
    xs = P(b, None, c)
    specs = {"x": xs, "weight": P(None, c)}
    if args["bias"] is not None:
        specs["bias"] = P(c)
    if args["state"] is not None:
        specs["state"] = xs
    if args["lengths"] is not None:
        specs["lengths"] = P(b)
    return specs, (xs, xs)


dispatch.define("causal_conv1d", _causal_conv1d_args, partition=_causal_conv1d_partition)


@dispatch.register("causal_conv1d", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="jnp, float32 math, one multiply-add per tap")
def causal_conv1d_xla(x, weight, bias, *, state, lengths, activation):
    with jax.named_scope("causal_conv1d"):
        f32 = jnp.float32
        batch, seq, channels = x.shape
        kernel = weight.shape[0]
        prev = (jnp.zeros((batch, kernel - 1, channels), f32) if state is None
                else state.astype(f32))
        xx = jnp.concatenate([prev, x.astype(f32)], axis=1)  # [batch, kernel - 1 + seq, c]
        w = weight.astype(f32)
        out = jnp.zeros((batch, seq, channels), f32) if bias is None else jnp.broadcast_to(
            bias.astype(f32), (batch, seq, channels))
        for i in range(kernel):
            out = out + w[i] * xx[:, i:i + seq]
        if activation == "silu":
            out = jax.nn.silu(out)
        valid = valid_tokens(lengths, batch, seq)
        out = jnp.where(valid[:, :, None], out, 0.0).astype(x.dtype)
        n = jnp.full((batch,), seq) if lengths is None else jnp.asarray(lengths)
        # The inputs at positions n .. n + kernel - 2 of xx: the last kernel - 1 real ones.
        idx = n[:, None] + jnp.arange(kernel - 1)[None, :]
        new_state = jnp.take_along_axis(xx, idx[:, :, None], axis=1)
        return out, new_state.astype(x.dtype if state is None else state.dtype)
