"""The router losses of a mixture of experts in the train step's objective and metrics.

Why apart from the cross-entropy: they come from the model's router statistics,
not from the logits, and exist only for models with experts (whose forward returns
``aux["router"]``, see :mod:`scaletrain.objectives.model_outputs`); for any other model
every function here is a no-op, so the objective has one code path.

The step's objective is a *sum* over target tokens that is divided once by the
batch's target-token count. The router losses are means over the batch, so they
enter as ``coef * loss * tokens``: with one micro-batch the divided objective is
exactly transformers' ``loss + router_aux_loss_coef * aux_loss``; with several,
each micro-batch's router loss is weighted by its share of the target tokens (the
balancing loss is a product of batch means, so it does not split into micro-batches
exactly; transformers' gradient accumulation averages it per micro-batch likewise).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.models.common.moe import RouterStats, load_balancing_loss, router_z_loss

Array = jax.Array


def router_objective(model: Any, stats: RouterStats | None, tokens: Array) -> Array:
    """``tokens * (router_aux_loss_coef * aux + router_z_loss_coef * z)``: the term the summed objective gets."""
    if stats is None:
        return jnp.zeros((), jnp.float32)
    cfg = model.config
    aux, z = load_balancing_loss(stats), router_z_loss(stats)
    return tokens * (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z)


def router_sums(stats: RouterStats | None, tokens: Array, per_layer: bool = False) -> dict[str, Array]:
    """What the step sums over micro-batches: token-weighted losses and the tokens each expert got.

    ``per_layer`` adds ``expert_layer_tokens`` ([L, E]: each layer's assignments), what the
    correction-bias update reads (:mod:`scaletrain.training.router_bias`); only then, so a run
    without it sums exactly what it always did.
    """
    if stats is None:
        return {}
    layer = {"expert_layer_tokens": stats.counts.reshape(-1, stats.counts.shape[-1])} if per_layer else {}
    return {
        **layer,
        "aux_loss": tokens * load_balancing_loss(stats),
        "router_z_loss": tokens * router_z_loss(stats),
        # assignments per expert, all layers together: a token counts once per layer and chosen expert
        "expert_tokens": jnp.sum(stats.counts.reshape(-1, stats.counts.shape[-1]), axis=0),
    }


def router_metrics(sums: dict[str, Array], denom: Array) -> dict[str, Array]:
    """Step metrics (``moe/...``) from the summed :func:`router_sums`; ``{}`` for a model without experts.

    ``moe/expert_<e>_tokens`` are the assignments to expert e over the batch and all
    layers; ``moe/max_expert_load`` is the busiest expert's over the mean (1 is balanced).
    """
    if not sums:
        return {}
    counts = sums["expert_tokens"]
    out = {
        "moe/aux_loss": sums["aux_loss"] / denom,
        "moe/router_z_loss": sums["router_z_loss"] / denom,
        "moe/max_expert_load": jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1e-9),
    }
    out.update({f"moe/expert_{e}_tokens": counts[e] for e in range(counts.shape[0])})
    return out
