"""A mixture-of-experts block with shared experts: routed SwiGLU experts plus an always-on SwiGLU.

Why its own block: DeepSeek-V3, Kimi K2 and GLM-4.5 add ``n_shared_experts`` experts every
token goes through (one SwiGLU of ``n_shared_experts * moe_intermediate_size``, HF
``mlp.shared_experts``) to the routed ones, chosen by the sigmoid :class:`BiasRouter`;
Qwen3-Next and Qwen3.5-MoE add one shared expert (``mlp.shared_expert``) scaled per token
by a sigmoid gate (``mlp.shared_expert_gate``: a [hidden, 1] projection) to softmax
routing. One block takes the router, the shared expert's name and width, and whether it
is gated; the routed experts' dispatch (dropless, over ``ep``) is
:func:`scaletrain.models.moe.dispatch`, shared with Mixtral and Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scaletrain.models.common.layers import MLP
from scaletrain.models.common.routing import BiasRouter, SoftmaxRouter
from scaletrain.models.common.dense import Dense
from scaletrain.models.common.moe import RouterStats, SwiGLUExperts, dispatch, router_stats
from scaletrain.models.common.placement import active_placement

Array = jax.Array
#: the per-expert linears' names on disk (``experts.<e>.gate_proj.weight`` ...)
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def empty_stats(num_experts: int) -> RouterStats:
    """The statistics of a layer without experts (a dense layer among MoE ones): all zero, no rows."""
    zero = jnp.zeros((), jnp.float32)
    return RouterStats(jnp.zeros((num_experts,), jnp.float32), jnp.zeros((num_experts,), jnp.float32), zero, zero)


class SharedExpertMoe(nnx.Module):
    """``gate`` (the router), ``experts`` (routed SwiGLUs) and a shared SwiGLU named ``shared_name``.

    ``router``: ``"sigmoid"`` (:class:`BiasRouter`, DeepSeek-V3's keys on ``config``) or
    ``"softmax"`` (:class:`SoftmaxRouter`, renormalised when ``normalize``). ``gated``: the shared
    expert's output times ``sigmoid(shared_expert_gate(x))`` (Qwen3-Next). ``shared_intermediate``
    0 is a block without a shared expert.
    """

    def __init__(self, config: Any, num_experts: int, intermediate: int, shared_intermediate: int, *,
                 router: str = "sigmoid", normalize: bool = True, shared_name: str = "shared_experts",
                 gated: bool = False, dtype: Any, param_dtype: Any, precision: Any, rngs: nnx.Rngs):
        if router == "sigmoid":
            self.gate: nnx.Module = BiasRouter(config, num_experts, param_dtype=param_dtype, rngs=rngs)
        elif router == "softmax":
            self.gate = SoftmaxRouter(config, num_experts, config.num_experts_per_tok, normalize,
                                      param_dtype=param_dtype, rngs=rngs)
        else:
            raise ValueError(f"router {router!r}: use 'sigmoid' or 'softmax'")
        kw = dict(config=config, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.experts = SwiGLUExperts(num_experts, config.hidden_size, intermediate, EXPERT_NAMES, **kw)
        self.shared_name = shared_name if shared_intermediate else None
        if self.shared_name:
            setattr(self, shared_name, MLP(config, dtype, param_dtype, precision, rngs,
                                           intermediate_size=shared_intermediate))
        self.shared_expert_gate = (Dense(config.hidden_size, 1, ("embed", None), use_bias=False, **kw)
                                   if gated and shared_intermediate else None)
        self.num_experts = num_experts
        self.precision = precision

    def __call__(self, x: Array, valid: Array) -> tuple[Array, RouterStats]:
        """The block's output [B, T, H] and this layer's router statistics (padding left out of them)."""
        logits, weights, experts, affinities = self.gate(x)
        out = dispatch(x, experts, weights, self.experts.kernels(), self.precision,
                       active_placement().partition_axis).astype(x.dtype)
        if self.shared_name:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(x.dtype) * shared
            out = out + shared
        return out, router_stats(logits, affinities, experts, valid)
