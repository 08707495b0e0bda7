"""DeepSeek's auxiliary-loss-free load balancing: the routers' correction biases moved after each update.

Why in the train step and not in the optimizer: the bias is not learned from a gradient (it
enters the expert *choice* only, through ``stop_gradient``); it is steered by the step's loads.
With ``router_bias_update_rate`` > 0 (a model option, :class:`~scaletrain.models.deepseek_v3.RoutedMoeConfig`)
each ``e_score_correction_bias`` is kept out of the optimizer (no moments, no weight decay,
no share of the clipping norm: :func:`router_bias_mask`) and, once the optimizer has updated
the rest, moved by ``rate * sign(mean load - load)`` per expert
(:func:`~scaletrain.models.common.routing.balancing_bias_step`) from that layer's loads summed
over the step's micro-batches. The bias stays a parameter of the model, so checkpoints save and
restore it with the rest and an export writes it where transformers reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.key_paths import key_names
from scaletrain.models.common.routing import balancing_bias_step, bias_update_rate
from scaletrain.models.common.scanned_layers import stacked_axes

Array = jax.Array
#: the router's correction bias, as transformers (and our parameter tree) names it
BIAS = "e_score_correction_bias"
#: the objective's sum of each layer's expert loads ([L, E]), :func:`scaletrain.objectives.router_losses.router_sums`
LAYER_LOADS = "expert_layer_tokens"


def is_router_bias(path: tuple[Any, ...]) -> bool:
    """Whether the parameter at ``path`` (a pytree key path) is a router's correction bias."""
    keys = key_names(path)
    return bool(keys) and keys[-1] == BIAS


def router_bias_mask(params: Any) -> Any:
    """``params`` as bools: True on each correction bias (what the optimizer leaves out)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_router_bias(path), params)


def outside_optimizer(config: Any, lora: Any) -> Callable[[Any], Any] | None:
    """What the optimizer must leave out for a model of ``config``: its correction biases when they follow
    the loads (:func:`router_bias_mask`), else None; refused with LoRA, whose frozen base holds them."""
    if bias_update_rate(config) <= 0:
        return None
    if lora is not None:
        raise ConfigError("model.router_bias_update_rate: LoRA freezes the routers' correction biases with the "
                          "base model; set it to 0 or train without lora")
    return router_bias_mask


def _layer_index(path: tuple[Any, ...]) -> int:
    keys = key_names(path)
    return int(keys[keys.index("layers") + 1])


def update_router_biases(params: Any, sums: dict[str, Array], rate: float, apply: Array) -> Any:
    """``params`` with every correction bias moved by ``rate`` from ``sums``' per-layer loads, where ``apply``
    (the step's finiteness guard) holds; stacked layers ([L, E] biases) take the loads as they are."""
    if LAYER_LOADS not in sums:
        raise ConfigError("model.router_bias_update_rate: this objective does not report each layer's expert "
                          "loads (only the language-model objective, SFT and pre-training, does); set it to 0")
    loads = sums[LAYER_LOADS]

    def move(path: tuple[Any, ...], leaf: Array) -> Array:
        if not is_router_bias(path):
            return leaf
        layer_loads = loads if stacked_axes(path) else loads[_layer_index(path)]
        return jnp.where(apply, balancing_bias_step(leaf, layer_loads, rate), leaf)

    return jax.tree_util.tree_map_with_path(move, params)


def router_bias_metrics(params: Any) -> dict[str, Array]:
    """``moe/expert_<e>_bias``: each expert's correction bias, the mean over the MoE layers (as
    ``moe/expert_<e>_tokens`` counts over all layers); ``{}`` for a model without one."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    biases = [leaf.reshape(-1, leaf.shape[-1]).astype(jnp.float32) for path, leaf in flat if is_router_bias(path)]
    if not biases:
        return {}
    mean = jnp.mean(jnp.concatenate(biases, axis=0), axis=0)
    return {f"moe/expert_{e}_bias": mean[e] for e in range(mean.shape[0])}
