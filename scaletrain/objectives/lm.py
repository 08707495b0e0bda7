"""The language-model objective: next-token cross-entropy, z-loss and a mixture of experts' router losses.

Why these together: they are what pre-training and SFT optimise, all summed over the
micro-batch's target tokens (``loss_mask`` restricts the targets, e.g. to assistant
turns), so the step divides the sum of micro-batches once by the batch's target
tokens. With ``chunk_size`` the head and the loss run chunk by chunk with their
gradient computed in the forward pass (:func:`~scaletrain.objectives.fused_loss.fused_head_loss`:
no whole logits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.models.common.routing import bias_update_rate
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.fused_loss import fused_head_loss
from scaletrain.objectives.loss import LossSums, cross_entropy_sums, eval_metrics, target_mask
from scaletrain.objectives.model_outputs import aux_shapes, hidden_and_aux
from scaletrain.objectives.router_losses import router_metrics, router_objective, router_sums

Array = jax.Array
ROUTER_SUMS = ("aux_loss", "router_z_loss", "expert_tokens")


@dataclasses.dataclass(frozen=True)
class LanguageModelObjective(ObjectiveBase):
    """Causal-LM loss over target tokens; ``z_loss`` weighs ``log(Z)^2``, ``chunk_size`` fuses head and loss.

    Its sums: ``loss``, ``z_loss``, ``correct``, ``tokens`` (the normaliser) and, for a
    mixture of experts, ``aux_loss``, ``router_z_loss`` (token-weighted) and
    ``expert_tokens`` (assignments per expert), and ``expert_layer_tokens`` (per layer) when the model
    updates its routers' correction biases.
    """

    z_loss: float = 0.0
    chunk_size: int | None = None

    name: ClassVar[str] = "lm"
    batch_keys: ClassVar[tuple[str, ...]] = ("input_ids",)
    frozen_models: ClassVar[tuple[str, ...]] = ()
    normaliser: ClassVar[str] = "tokens"

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        """``(loss + z_loss * z_loss [+ router losses], sums)`` summed over ``batch``'s target tokens."""
        mask = target_mask(batch["input_ids"], batch.get("segment_ids"), batch.get("loss_mask"))
        hidden, aux = hidden_and_aux(model, batch)
        stats = aux.get("router")
        if self.chunk_size:
            kernel, transposed = model.lm_head_weight()
            pa = model.config.partition_axis
            objective, sums = fused_head_loss(hidden, kernel, batch["input_ids"], mask, model.dtype, self.chunk_size,
                                              self.z_loss, model.precision, transposed, pa.batch_axis,
                                              pa.sequence_axis, model.logit_softcap())
        else:
            sums = cross_entropy_sums(model.compute_logits(hidden), batch["input_ids"], mask)
            objective = sums.loss + self.z_loss * sums.z_loss
        per_layer = bias_update_rate(model.config) > 0
        return objective + router_objective(model, stats, sums.tokens), {
            **sums._asdict(), **router_sums(stats, sums.tokens, per_layer)}

    def zero_sums(self, model: Any) -> Sums:
        """Float32 zeros shaped like the sums: scalars, and the router sums from the router statistics' shapes."""
        tokens = jax.ShapeDtypeStruct((), jnp.float32)
        shapes: dict[str, Any] = {name: tokens for name in LossSums._fields}
        router = aux_shapes(model).get("router")
        if router is not None:
            per_layer = bias_update_rate(model.config) > 0
            shapes.update(jax.eval_shape(lambda r, t: router_sums(r, t, per_layer), router, tokens))
        return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        """``loss``, ``z_loss``, ``accuracy`` per target token, ``tokens``, and ``moe/...`` for experts."""
        return {
            "loss": sums["loss"] / denom,
            "z_loss": sums["z_loss"] / denom,
            "accuracy": sums["correct"] / denom,
            "tokens": sums["tokens"],
            **router_metrics({k: sums[k] for k in ROUTER_SUMS if k in sums}, denom),
        }

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        """``eval_loss``, ``eval_accuracy``, ``eval_perplexity``, ``eval_tokens`` (and ``eval_bits_per_byte``)."""
        return eval_metrics(LossSums(*(float(totals[name]) for name in LossSums._fields)), bytes_per_token)
