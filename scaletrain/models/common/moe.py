"""Sparse mixture-of-experts feed-forward: top-k router, dropless dispatch, SwiGLU experts.

Why one module for Mixtral and Qwen3-MoE: both route each token to its top-k of E
SwiGLU experts by a softmax router and differ only in whether the chosen
probabilities are renormalised (Mixtral always, Qwen3-MoE with ``norm_topk_prob``)
and in their tensor names, which the experts take as arguments so that our
parameter names mirror the ones transformers writes to disk.

Dispatch is *dropless*: every (token, expert) assignment is computed, none is
dropped for lack of capacity. The assignments are sorted by expert and the experts
run as grouped matmuls (``jax.lax.ragged_dot``: a grouped GEMM on GPU/TPU; XLA:CPU
lowers it to a masked dense dot over the groups, correct but E times the work).

Under a mesh the dispatch runs per device inside ``shard_map`` on the device's own
tokens (a global sort would gather the whole batch). Tokens are split over every
mesh axis that does not already split them (``ep``, ``tp``) when the batch divides,
so no device computes another's tokens. With ``ep > 1`` the experts are split over
``ep`` and the assignments travel to their expert's device and back by two
``all_to_all``: XLA:CPU has no ``ragged_all_to_all``, so each device sends a fixed
``[ep, n*k, hidden]`` buffer (the worst case of all its n*k assignments going to one
device, which is what keeps it dropless with static shapes). When the batch cannot
be split over ``ep`` (generation, batch 1) each device runs its own experts on all
tokens and the outputs are summed over ``ep`` (``psum``).

The router statistics (assignments and probability mass per expert, ``logsumexp^2``
of the router logits, over non-padding tokens) give transformers'
``load_balancing_loss_func`` and the router z-loss of ST-MoE (Zoph et al., 2022).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from scaletrain.models.common.dense import Dense, _init
from scaletrain.models.common.placement import active_placement
from scaletrain.parallel.partition import active_axis_size, active_sharding_axes, axis_names

Array = jax.Array
#: ``grouped(rows, group_sizes, kernels, precision)``: the experts over rows sorted by expert, ``group_sizes[e]``
#: rows each, rows past their sum zero (:func:`grouped_swiglu`; GPT-OSS's biased, clamped SwiGLU)
GroupedExperts = Callable[[Array, Array, tuple[Array, ...], Any], Array]


class RouterStats(NamedTuple):
    """Sums over the valid (non-padding) tokens of one MoE layer, or stacked over layers."""

    counts: Array  # [..., E] assignments per expert (each token counts once for each of its k experts)
    prob_sums: Array  # [..., E] sum of the router's softmax probabilities
    z_sums: Array  # [...] sum of logsumexp(router logits)^2
    rows: Array  # [...] valid tokens


def route(logits: Array, top_k: int, normalize: bool) -> tuple[Array, Array, Array]:
    """``(weights [..., k] float32, experts [..., k] int32, probs [..., E] float32)`` as transformers routes.

    Softmax in float32 over all experts, the top k of those probabilities, renormalised
    to sum to one when ``normalize`` (Mixtral always, Qwen3-MoE with ``norm_topk_prob``).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def router_stats(logits: Array, probs: Array, experts: Array, valid: Array) -> RouterStats:
    """One layer's :class:`RouterStats` for ``logits``/``probs`` [B, T, E], ``experts`` [B, T, k], ``valid`` [B, T]."""
    num_experts = probs.shape[-1]
    v = valid.astype(jnp.float32)
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(-2)  # [B, T, E]
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return RouterStats(
        counts=jnp.einsum("bte,bt->e", chosen, v),
        prob_sums=jnp.einsum("bte,bt->e", probs, v),
        z_sums=jnp.sum(jnp.square(log_z) * v),
        rows=jnp.sum(v),
    )


def load_balancing_loss(stats: RouterStats) -> Array:
    """transformers' ``load_balancing_loss_func`` from layer-stacked stats ([L, E] counts).

    ``E * sum_e f_e * P_e`` where ``f_e`` is expert e's share of assignments and
    ``P_e`` its mean router probability, both pooled over every layer's tokens (as
    transformers concatenates the layers' router logits), so a perfectly balanced
    router scores ``top_k``.
    """
    rows = jnp.maximum(jnp.sum(stats.rows), 1.0)
    per_expert = jnp.sum(stats.counts.reshape(-1, stats.counts.shape[-1]), axis=0) / rows
    prob = jnp.sum(stats.prob_sums.reshape(-1, stats.prob_sums.shape[-1]), axis=0) / rows
    return stats.counts.shape[-1] * jnp.sum(per_expert * prob)


def router_z_loss(stats: RouterStats) -> Array:
    """Mean over every layer's valid tokens of ``logsumexp(router logits)^2`` (ST-MoE's z-loss)."""
    return jnp.sum(stats.z_sums) / jnp.maximum(jnp.sum(stats.rows), 1.0)


class SwiGLUExperts(nnx.Module):
    """E SwiGLU feed-forwards as stacked ``[E, in, out]`` kernels, run by grouped matmuls.

    ``names`` are the (gate, up, down) attribute names: transformers' on-disk names
    of the per-expert linears (Mixtral ``w1, w3, w2``; Qwen3-MoE ``gate_proj,
    up_proj, down_proj``), so :mod:`scaletrain.models.hf` maps ``experts.<name>`` to
    ``experts.<e>.<name>.weight`` without a per-family table.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, names: tuple[str, str, str], *,
                 config: Any, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        init = _init(config)
        self.names = names
        gate, up, down = names
        setattr(self, gate, nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), param_dtype),
                                      logical_axes=("expert", "embed", "mlp")))
        setattr(self, up, nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), param_dtype),
                                    logical_axes=("expert", "embed", "mlp")))
        setattr(self, down, nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden), param_dtype),
                                      logical_axes=("expert", "mlp", "embed")))
        self.dtype = dtype
        self.precision = precision

    def kernels(self) -> tuple[Array, Array, Array]:
        """``(gate, up, down)`` kernels in the compute dtype."""
        return tuple(getattr(self, n)[...].astype(self.dtype) for n in self.names)  # type: ignore[return-value]


def grouped_swiglu(rows: Array, group_sizes: Array, kernels: tuple[Array, Array, Array], precision: Any) -> Array:
    """``down(silu(gate(x)) * up(x))`` for rows sorted by expert, ``group_sizes[e]`` rows each.

    Rows past ``sum(group_sizes)`` come out as zeros (``ragged_dot`` leaves them unassigned).
    """
    gate, up, down = kernels
    h = lax.ragged_dot(rows, gate, group_sizes, precision=precision)
    u = lax.ragged_dot(rows, up, group_sizes, precision=precision)
    return lax.ragged_dot(jax.nn.silu(h) * u, down, group_sizes, precision=precision)


def _inverse(perm: Array) -> Array:
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _combine(y: Array, weights: Array) -> Array:
    """Weighted sum over each token's k expert outputs: ``y`` [n*k, H], ``weights`` [n, k]."""
    n, k = weights.shape
    return jnp.sum(y.reshape(n, k, -1) * weights[..., None].astype(y.dtype), axis=1)


def dispatch_local(x: Array, experts: Array, weights: Array, kernels: tuple[Array, ...],
                   precision: Any, grouped: GroupedExperts = grouped_swiglu) -> Array:
    """Expert outputs for tokens ``x`` [n, H] routed to ``experts``/``weights`` [n, k], all experts here."""
    n, k = experts.shape
    num_experts = kernels[0].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    y = grouped(x[order // k], sizes, kernels, precision)
    return _combine(y[_inverse(order)], weights)


def dispatch_all_to_all(x: Array, experts: Array, weights: Array, kernels: tuple[Array, ...],
                        precision: Any, axis: tuple[str, ...], ep: int,
                        grouped: GroupedExperts = grouped_swiglu) -> Array:
    """:func:`dispatch_local` with the experts split over ``axis`` (``ep`` devices, ``E/ep`` each).

    Each device sorts its own assignments by expert (so by destination), sends
    destination r its block in row ``r`` of a ``[ep, n*k, H]`` buffer together with
    the per-expert counts, runs its local experts on what it received (regrouped by
    local expert across sources) and sends the results back the same way.
    """
    n, k = experts.shape
    local = kernels[0].shape[0]
    cap = n * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = jnp.bincount(flat, length=local * ep).astype(jnp.int32)
    dest_counts = counts.reshape(ep, local).sum(axis=1)
    dest_start = jnp.cumsum(dest_counts) - dest_counts
    slot = jnp.arange(cap, dtype=jnp.int32)
    src = jnp.minimum(dest_start[:, None] + slot[None], cap - 1)  # [ep, cap]
    filled = slot[None] < dest_counts[:, None]
    send = jnp.where(filled[..., None], x[(order // k)[src]], 0).reshape(ep * cap, -1)
    received = lax.all_to_all(send, axis, 0, 0, tiled=True)  # block s: from source s
    recv_counts = lax.all_to_all(counts.reshape(ep, local), axis, 0, 0, tiled=True)  # [source, local expert]
    # local expert of received row (s, j): how many of source s's cumulative counts j has passed;
    # `local` (past every group) marks an empty slot
    bounds = jnp.cumsum(recv_counts, axis=1)
    row_expert = jnp.sum(slot[None, :, None] >= bounds[:, None, :], axis=-1).reshape(-1)
    regroup = jnp.argsort(row_expert, stable=True)
    y = grouped(received[regroup], recv_counts.sum(axis=0), kernels, precision)
    returned = lax.all_to_all(y[_inverse(regroup)], axis, 0, 0, tiled=True)  # block r: from expert device r
    dest = sorted_experts // local
    y_sorted = returned[dest * cap + (jnp.arange(cap, dtype=jnp.int32) - dest_start[dest])]
    return _combine(y_sorted[_inverse(order)], weights)


def dispatch_replicated(x: Array, experts: Array, weights: Array, kernels: tuple[Array, ...],
                        precision: Any, axis: tuple[str, ...], ep: int,
                        grouped: GroupedExperts = grouped_swiglu) -> Array:
    """Every ``ep`` device holds the same tokens: each runs its own experts, outputs summed over ``axis``."""
    n, k = experts.shape
    local = kernels[0].shape[0]
    first = lax.axis_index(axis) * local
    flat = experts.reshape(-1)
    # this device's experts first (keys 0..local-1), the rest after them: ragged_dot zeroes those
    key = jnp.mod(flat - first, local * ep)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=local * ep)[:local].astype(jnp.int32)
    y = grouped(x[order // k], sizes, kernels, precision)
    return lax.psum(_combine(y[_inverse(order)], weights), axis)


def dispatch(x: Array, experts: Array, weights: Array, kernels: tuple[Array, ...], precision: Any,
             partition_axis: Any, grouped: GroupedExperts = grouped_swiglu) -> Array:
    """Expert outputs [B, T, H] for ``x`` [B, T, H] routed to ``experts``/``weights`` [B, T, k].

    ``kernels`` are the experts' stacked parameters (leading axis E), which ``grouped`` runs.
    Outside a mesh: :func:`dispatch_local`. Under one: ``shard_map`` over the tokens
    each device holds, split further over the mesh axes that do not split them yet
    (``ep`` first, then ``tp``, ...) where the batch divides, with
    the experts split over ``ep`` when there is more than one ``ep`` device and it
    divides the number of experts (see the module docstring).
    """
    b, t, h = x.shape
    if jax.sharding.get_abstract_mesh().empty:
        out = dispatch_local(x.reshape(b * t, h), experts.reshape(b * t, -1), weights.reshape(b * t, -1),
                             kernels, precision, grouped)
        return out.reshape(b, t, h)
    num_experts = kernels[0].shape[0]
    ep_axes = tuple(a for a in axis_names(partition_axis.expert_axis) if active_axis_size(a) > 1)
    ep = active_axis_size(ep_axes)
    expert_split = ep > 1 and num_experts % ep == 0
    batch_axes = active_sharding_axes(partition_axis.batch_axis, b)
    seq_axes = active_sharding_axes(partition_axis.sequence_axis, t)
    token_axes = list(batch_axes)
    # weights are whole on every device but for the ep split, so any axis that does not yet
    # split the tokens (ep first, then tp, ...) may split them, where the batch divides
    mesh_axes = [a for a, _ in jax.sharding.get_abstract_mesh().shape_tuple]
    for extra in (ep_axes, *((a,) for a in mesh_axes if a not in ep_axes)):
        extra = tuple(a for a in extra if active_axis_size(a) > 1 and a not in token_axes and a not in seq_axes)
        if extra and b % (active_axis_size(tuple(token_axes)) * active_axis_size(extra)) == 0:
            token_axes.extend(extra)
    tokens_split_over_ep = bool(ep_axes) and set(ep_axes) <= set(token_axes)
    tok = PartitionSpec(tuple(token_axes) or None, seq_axes or None, None)
    kernel_specs = tuple(PartitionSpec(ep_axes if expert_split else None, *([None] * (kl.ndim - 1)))
                         for kl in kernels)

    def per_device(xl: Array, el: Array, wl: Array, *kl: Array) -> Array:
        bl, tl, _ = xl.shape
        args = (xl.reshape(bl * tl, h), el.reshape(bl * tl, -1), wl.reshape(bl * tl, -1), kl, precision)
        if not expert_split:
            out = dispatch_local(*args, grouped)
        elif tokens_split_over_ep:
            out = dispatch_all_to_all(*args, ep_axes, ep, grouped)
        else:
            out = dispatch_replicated(*args, ep_axes, ep, grouped)
        return out.reshape(bl, tl, h)

    return jax.shard_map(per_device, in_specs=(tok, tok, tok, *kernel_specs),
                         out_specs=tok)(x, experts, weights, *kernels)


class SparseMoeBlock(nnx.Module):
    """Router (``gate``: [hidden, E], no bias) and :class:`SwiGLUExperts`.

    ``__call__`` returns the block's output and this layer's :class:`RouterStats`.
    """

    def __init__(self, config: Any, num_experts: int, intermediate: int, names: tuple[str, str, str],
                 normalize: bool, *, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        h, e = config.hidden_size, num_experts
        self.gate = Dense(h, e, ("embed", None), use_bias=False, **kw)
        self.experts = SwiGLUExperts(e, h, intermediate, names, **kw)
        self.top_k = config.num_experts_per_tok
        self.normalize = normalize
        self.precision = precision

    def __call__(self, x: Array, valid: Array) -> tuple[Array, RouterStats]:
        logits = self.gate(x)
        weights, experts, probs = route(logits, self.top_k, self.normalize)
        out = dispatch(x, experts, weights, self.experts.kernels(), self.precision,
                       active_placement().partition_axis)
        return out.astype(x.dtype), router_stats(logits, probs, experts, valid)
