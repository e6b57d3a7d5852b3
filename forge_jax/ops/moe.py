"""Mixture-of-experts routing: the top-k router (an op), the permutation of tokens to
expert-sorted order and its inverse, and :func:`moe`, the expert layer composed of them
and :func:`forge_jax.grouped_matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from forge_jax import _checks, dispatch
from forge_jax.ops.activation import safe_softmax_f32, silu_mul
from forge_jax.ops.grouped_matmul import grouped_matmul

ROUTINGS = ("softmax_topk", "topk_softmax")


def _moe_route_args(router_logits, top_k, *, routing="softmax_topk", renormalize=False):
    _checks.array("router_logits", router_logits, min_ndim=1)
    experts = router_logits.shape[-1]
    top_k = _checks.positive_int("top_k", top_k)
    if top_k > experts:
        raise ValueError(f"top_k must be <= the expert count router_logits.shape[-1]="
                         f"{experts}, got {top_k=}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing=!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {renormalize=!r}")
    return dict(router_logits=router_logits, top_k=top_k, routing=routing,
                renormalize=renormalize)


def moe_route(router_logits, top_k, *, routing="softmax_topk", renormalize=False,
              implementation=None):
    """Top-k expert routing: which ``top_k`` experts each token goes to, with what weight.

    * ``routing="softmax_topk"``: ``p = softmax(logits)`` over all experts, then the
      ``top_k`` largest ``p``; with ``renormalize`` they are divided by their sum
      (Qwen2-MoE / Qwen3-MoE with ``norm_topk_prob``, and Mixtral, whose renormalised
      weights equal ``"topk_softmax"``'s).
    * ``routing="topk_softmax"``: the ``top_k`` largest logits, then a softmax over those
      (Mixtral's formulation; ``renormalize`` changes nothing, they already sum to 1).

    Ties go to the lower expert index (``jax.lax.top_k``). Math in float32.

    Args:
      router_logits: ``[..., experts]`` float.
      top_k: experts per token, ``1 <= top_k <= experts``.
      routing, renormalize: see above.
      implementation: ``None`` (auto) or a registered implementation name.

    Returns:
      ``(weights, expert_ids)``: float32 and int32 ``[..., top_k]``, the experts in
      decreasing weight.
    """
    args = _moe_route_args(router_logits, top_k, routing=routing, renormalize=renormalize)
    return dispatch.call("moe_route", args, implementation)


dispatch.define("moe_route", _moe_route_args)


@dispatch.register("moe_route", "xla", priority={"cpu": 0, "gpu": 0, "tpu": 0},
                   description="softmax and jax.lax.top_k, float32 math")
def moe_route_xla(router_logits, *, top_k, routing, renormalize):
    with jax.named_scope("moe_route"):
        logits = router_logits.astype(jnp.float32)
        if routing == "topk_softmax":
            top, ids = jax.lax.top_k(logits, top_k)
            return safe_softmax_f32(top, -1, None), ids.astype(jnp.int32)
        weights, ids = jax.lax.top_k(safe_softmax_f32(logits, -1, None), top_k)
        if renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids.astype(jnp.int32)


def moe_permute(x, expert_ids, num_experts: int):
    """Copies of the tokens in expert-sorted order, for :func:`forge_jax.grouped_matmul`.

    Entry ``j`` of the flattened ``expert_ids [tokens, top_k]`` sends token ``j // top_k``
    to expert ``expert_ids.flat[j]``; the entries are sorted by expert, stably (a token's
    order is kept within an expert).

    Args:
      x: ``[tokens, d]``.
      expert_ids: int ``[tokens, top_k]`` in ``[0, num_experts)``: concrete ids outside it
        raise ValueError; a traced one sorts past every group (its row is one of
        :func:`forge_jax.grouped_matmul`'s zero rows past ``sum(group_sizes)``).
      num_experts: the expert count (static).

    Returns:
      ``(x_sorted, group_sizes, order)``: ``x_sorted [tokens * top_k, d]`` (``x``'s
      dtype), int32 ``group_sizes [num_experts]`` and ``order [tokens * top_k]``, the
      flat entry each sorted row came from (for :func:`moe_unpermute`).
    """
    _checks.array("x", x, ndim=2)
    _checks.array("expert_ids", expert_ids, ndim=2, kind="int")
    num_experts = _checks.positive_int("num_experts", num_experts)
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be [tokens, top_k] with tokens = x.shape[0]: "
                         f"{expert_ids.shape=}, {x.shape=}")
    ids = _checks.concrete_ints(expert_ids)
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        bad = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= num_experts))[0])
        raise ValueError(f"expert_ids must lie in [0, {num_experts}), got expert_ids{list(bad)}"
                         f"={ids[bad]}")
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return x[order // top_k], group_sizes, order


def moe_unpermute(y_sorted, order, weights):
    """The inverse of :func:`moe_permute`, combined: ``out[t] = sum_j weights[t, j] *
    y[t, j]``, where ``y[t, j]`` is the sorted row that came from flat entry
    ``t * top_k + j``. Sums in float32.

    Args:
      y_sorted: ``[tokens * top_k, d]``, the experts' outputs in sorted order.
      order: int32 ``[tokens * top_k]`` from :func:`moe_permute`.
      weights: float ``[tokens, top_k]`` (e.g. :func:`moe_route`'s).

    Returns:
      ``[tokens, d]`` in ``y_sorted``'s dtype.
    """
    _checks.array("y_sorted", y_sorted, ndim=2)
    _checks.array("order", order, ndim=1, kind="int")
    _checks.array("weights", weights, ndim=2)
    tokens, top_k = weights.shape
    if order.shape[0] != tokens * top_k or y_sorted.shape[0] != tokens * top_k:
        raise ValueError(f"y_sorted and order must have tokens * top_k = {tokens * top_k} "
                         f"rows for {weights.shape=}, got {y_sorted.shape=}, {order.shape=}")
    # The inverse permutation as a gather (a scatter of ints, then a gather of rows).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse].reshape(tokens, top_k, -1).astype(jnp.float32)
    out = jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(y_sorted.dtype)


def moe(x, router_logits, w_gate, w_up, w_down, top_k, *, routing="softmax_topk",
        renormalize=False, trans_w=False, implementation=None):
    """A mixture-of-experts SwiGLU layer: each token through its ``top_k`` experts.

    ``out[t] = sum_j weight[t, j] * (silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]``
    with ``e = expert[t, j]`` from :func:`moe_route`, computed as :func:`moe_permute`, three
    :func:`forge_jax.grouped_matmul` calls (no dense ``[tokens, experts, ...]`` product),
    :func:`forge_jax.silu_mul` and :func:`moe_unpermute`. Shared experts, where a family
    has them, are the model's to add.

    Args:
      x: ``[tokens, d]`` float.
      router_logits: ``[tokens, experts]`` (any float dtype; routing is float32).
      w_gate, w_up: ``[experts, d, f]``, ``x``'s dtype; w_down: ``[experts, f, d]``;
        or :class:`forge_jax.QuantizedArray` s of those shapes, stacked with scales per
        expert (dequantized one expert at a time inside the grouped products).
      top_k, routing, renormalize: as :func:`moe_route`.
      trans_w: the weights in the ``[experts, out, in]`` layout (``w_gate``, ``w_up``
        ``[experts, f, d]``, ``w_down`` ``[experts, d, f]``): Hugging Face's per-expert
        tensors stacked, the layout quantized experts are stored in
        (:func:`forge_jax.grouped_matmul`'s ``trans_w``).
      implementation: the grouped products' implementation (``None``: auto).

    Returns:
      ``[tokens, d]`` in ``x.dtype``.
    """
    _checks.array("x", x, ndim=2)
    _checks.array("router_logits", router_logits, ndim=2)
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _checks.array(name, w, ndim=3)
    experts = router_logits.shape[1]
    tokens, d = x.shape
    f = w_gate.shape[1 if trans_w else 2]
    want = {"w_gate": (experts, d, f), "w_up": (experts, d, f), "w_down": (experts, f, d)}
    if trans_w:
        want = {name: (e, b, a) for name, (e, a, b) in want.items()}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(w.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]} for {x.shape=}, "
                             f"{router_logits.shape=}, w_gate.shape={tuple(w_gate.shape)} "
                             f"({trans_w=}); got {name}.shape="
                             f"{tuple(w.shape)}")
    if router_logits.shape[0] != tokens:
        raise ValueError(f"router_logits must be [tokens, experts] with tokens = x.shape[0]:"
                         f" {router_logits.shape=}, {x.shape=}")
    with jax.named_scope("moe"):
        weights, ids = moe_route(router_logits, top_k, routing=routing,
                                 renormalize=renormalize)
        xs, group_sizes, order = moe_permute(x, ids, experts)
        gmm = lambda a, w: grouped_matmul(a, w, group_sizes, trans_w=trans_w,
                                          implementation=implementation)
        hidden = silu_mul(gmm(xs, w_gate), gmm(xs, w_up))
        ys = gmm(hidden, w_down)
        return moe_unpermute(ys, order, weights)
