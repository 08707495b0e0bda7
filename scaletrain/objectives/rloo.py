"""RLOO as an :class:`~scaletrain.objectives.Objective`: TRL 1.16's ``RLOOTrainer`` loss over GRPO batches.

Why a GRPO objective with another loss: RLOO samples, scores and batches exactly as GRPO does (the
same rollout, the same batch keys); it differs in the advantage (the leave-one-out estimator of
``objectives/advantage_estimators.py``, with the KL taken off the reward) and in the loss, which is
per completion, not per token. With ``logps`` and ``old`` the summed log-probabilities of a completion's
tokens and ``A`` its advantage:

- ``w = exp(logps - old)`` (one weight per completion: the sum, not GSPO's mean);
- ``loss_i = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A)``, averaged over completions;
- no KL term in the loss: ``beta`` is a reward penalty, ``beta * sum_t (old_t - ref_t)`` (the first-order
  log-ratio, as the RLOO paper and TRL), taken off the reward before the advantage. ``kl`` logs its
  per-token mean; ``clip_ratio/*`` count completions, ``clip_ratio/low_min`` is 1 only when every
  completion is low-clipped and ``clip_ratio/high_max`` 1 when any is high-clipped (TRL's min / max over
  completions of the clipped flags).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from scaletrain.objectives.base import Batch, Sums
from scaletrain.objectives.grpo import GRPOObjective

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RLOOObjective(GRPOObjective):
    """TRL 1.16's RLOO loss (see the module docstring); ``loss`` holds ``epsilon``, ``epsilon_high`` and ``beta``."""

    name: ClassVar[str] = "rloo"

    @property
    def normaliser(self) -> str:
        return "sequences"  # the mean over completions

    def sums_from_logps(self, logps: Array, entropy: Array, batch: Batch, mask: Array) -> tuple[Array, Sums]:
        """The loss and sums given the current per-token log-probabilities (the part the TRL test checks)."""
        sg = jax.lax.stop_gradient
        old_tokens = batch["old_logps"] if self.num_iterations > 1 else sg(logps)
        seq = jnp.sum(logps * mask, axis=-1)
        coef = jnp.exp(seq - jnp.sum(old_tokens * mask, axis=-1))
        adv = batch["advantages"].astype(jnp.float32)
        clipped = jnp.clip(coef, 1.0 - self.loss.epsilon_low, 1.0 + self.loss.epsilon_up)
        loss = jnp.sum(-jnp.minimum(coef * adv, clipped * adv))
        low = ((coef < 1.0 - self.loss.epsilon_low) & (adv < 0)).astype(jnp.float32)
        high = ((coef > 1.0 + self.loss.epsilon_up) & (adv > 0)).astype(jnp.float32)
        kl = jnp.zeros((), jnp.float32)
        if self.loss.beta != 0.0:
            kl = sg(jnp.sum((old_tokens - batch["ref_logps"]) * mask))
        rows = jnp.asarray(mask.shape[0], jnp.float32)
        return loss, {
            **self.sampler_sums(logps, batch, mask),
            "loss": sg(loss),
            "sequences": rows,
            "tokens": jnp.sum(mask),
            "kl": kl,
            "entropy": sg(jnp.sum(entropy * mask)),
            "clip_low": jnp.sum(low),
            "clip_high": jnp.sum(high),
            "clip_region": jnp.sum(jnp.maximum(low, high)),
            "clip_count": rows,
        }

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        metrics = super().step_metrics(sums, denom)
        metrics["clip_ratio/low_min"] = (sums["clip_low"] >= sums["clip_count"]).astype(jnp.float32)
        metrics["clip_ratio/high_max"] = (sums["clip_high"] > 0).astype(jnp.float32)
        return metrics
