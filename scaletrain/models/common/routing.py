"""Routers of a mixture of experts: which k experts each token goes to, and with what weights.

Two rules, each a module holding the router's weights under transformers' names
(``gate.weight``, and ``gate.e_score_correction_bias`` for the biased one), both computed
in float32 as transformers computes them:

- :class:`SoftmaxRouter`: softmax over all experts, top k, optionally renormalised
  (Mixtral, Qwen3-MoE, Qwen3-Next/3.5-MoE).
- :class:`BiasRouter`: DeepSeek-V3's (and GLM-4.5's, Kimi K2's) sigmoid scores with
  *group-limited* top-k: the experts are cut into ``n_group`` groups, each group scored by
  the sum of its two best scores, the tokens restricted to the best ``topk_group`` groups,
  and the top k taken there. A per-expert correction bias is added to the scores for the
  *choice only*; the weights are the plain sigmoid scores of the chosen experts (optionally
  renormalised), times ``routed_scaling_factor``. The bias is how DeepSeek balances the
  load without an auxiliary loss: it is not trained by gradients (it enters the choice
  only, through ``stop_gradient``), and Adam, Lion and the weight-decay mask (matrices
  only) leave a parameter with a zero gradient where it is.

Each router returns ``(logits, weights [.., k], experts [.., k], affinities [.., E])``:
the affinities are what :func:`~scaletrain.models.moe.router_stats` sums as each expert's
probability mass (softmax probabilities; DeepSeek's sigmoid scores normalised per token,
the ``s / sum(s)`` of its sequence-wise balance loss).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from scaletrain.models.common.dense import _init
from scaletrain.models.common.moe import route

Array = jax.Array
#: what transformers adds to the sum of the chosen weights before renormalising them
_NORM_EPS = 1e-20


def group_limited_top_k(choice: Array, top_k: int, n_group: int, topk_group: int) -> Array:
    """The ``top_k`` experts [..., k] (int32) of ``choice`` [..., E] among the ``topk_group`` best of
    ``n_group`` equal groups, a group scored by the sum of its two best entries (DeepSeek-V3)."""
    *lead, num_experts = choice.shape
    grouped = choice.reshape(*lead, n_group, num_experts // n_group)
    group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, best_groups = lax.top_k(group_scores, topk_group)
    keep = jnp.sum(jax.nn.one_hot(best_groups, n_group, dtype=jnp.int32), axis=-2) > 0  # [..., G]
    masked = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
    return lax.top_k(masked, top_k)[1].astype(jnp.int32)


def sigmoid_route(logits: Array, bias: Array, top_k: int, n_group: int, topk_group: int, normalize: bool,
                  scaling: float) -> tuple[Array, Array, Array]:
    """``(weights [..., k], experts [..., k], affinities [..., E])`` as DeepSeek-V3 routes (module docstring).

    ``bias`` [E] shifts the scores the experts are chosen by, not the weights they get.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + lax.stop_gradient(bias.astype(jnp.float32))
    experts = group_limited_top_k(lax.stop_gradient(choice), top_k, n_group, topk_group)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + _NORM_EPS)
    affinities = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return weights * scaling, experts, affinities


class SoftmaxRouter(nnx.Module):
    """``gate``: a [hidden, E] kernel (HF ``gate.weight``), softmax top-k (:func:`~scaletrain.models.moe.route`)."""

    def __init__(self, config: Any, num_experts: int, top_k: int, normalize: bool, *, param_dtype: Any,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(config)(rngs.params(), (config.hidden_size, num_experts), param_dtype),
                                logical_axes=("embed", None))
        self.top_k, self.normalize = top_k, normalize

    def __call__(self, x: Array) -> tuple[Array, Array, Array, Array]:
        logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
        weights, experts, probs = route(logits, self.top_k, self.normalize)
        return logits, weights, experts, probs


class BiasRouter(nnx.Module):
    """``gate``: a [hidden, E] kernel and the [E] ``e_score_correction_bias``, routed by :func:`sigmoid_route`.

    The options are transformers' DeepSeek-V3 keys: ``num_experts_per_tok``, ``n_group``,
    ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``.
    """

    def __init__(self, config: Any, num_experts: int, *, param_dtype: Any, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(config)(rngs.params(), (config.hidden_size, num_experts), param_dtype),
                                logical_axes=("embed", None))
        # float32 whatever param_dtype: transformers keeps it so, and updates to it are tiny steps
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32), logical_axes=(None,))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.normalize, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def __call__(self, x: Array) -> tuple[Array, Array, Array, Array]:
        logits = jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
        weights, experts, affinities = sigmoid_route(logits, self.e_score_correction_bias[...], self.top_k,
                                                     self.n_group, self.topk_group, self.normalize, self.scaling)
        return logits, weights, experts, affinities


def bias_update_rate(config: Any) -> float:
    """``config``'s ``router_bias_update_rate``: how far a step moves each correction bias (0, off, for any
    model without one)."""
    return float(getattr(config, "router_bias_update_rate", 0.0))


def balancing_bias_step(bias: Array, loads: Array, rate: float) -> Array:
    """``bias`` [..., E] moved by ``rate`` toward balance given the step's ``loads`` [..., E] (tokens per expert).

    DeepSeek-V3's auxiliary-loss-free balancing (its report, section 2.1.2): an expert above
    its layer's mean load gets its bias lowered by ``rate``, one below raised by ``rate``, one
    exactly at the mean (or a layer that saw no token) kept, so the next choices lean toward
    the idle experts without any gradient.
    """
    loads = loads.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def routing_problem(num_experts: int, top_k: int, n_group: int, topk_group: int) -> str | None:
    """What makes group-limited routing impossible, said by key (transformers' names), or None."""
    if n_group < 1 or num_experts % n_group:
        return f"n_routed_experts {num_experts} is not divisible by n_group {n_group}"
    if n_group > 1 and num_experts // n_group < 2:
        return (f"n_group {n_group} leaves {num_experts // n_group} expert per group; a group is scored by its "
                "two best experts, so each needs at least 2")
    if not 1 <= topk_group <= n_group:
        return f"topk_group {topk_group} must be between 1 and n_group ({n_group})"
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        return (f"num_experts_per_tok {top_k} must be between 1 and the {topk_group * (num_experts // n_group)} "
                f"experts of the topk_group={topk_group} groups a token may use")
    return None
