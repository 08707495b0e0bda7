"""PPO with a learned value as an :class:`~scaletrain.objectives.Objective`: the clipped policy loss and the clipped
value loss of TRL's last ``PPOTrainer`` over a rollout batch with per-token advantages.

A PPO batch is a GRPO rollout batch (``scaletrain.rl`` builds it) whose advantages are per token:

- ``input_ids`` / ``segment_ids`` / ``positions`` [N, P + C], ``completion_mask`` [N, C], as GRPO's;
- ``old_logps`` and ``values`` [N, C]: the policy's log-probabilities and its value head's values at the
  parameters that sampled (the rollout's scoring forward);
- ``advantages`` and ``returns`` [N, C]: GAE of the token rewards (the score on the last token, the KL
  penalty on each), formed once per rollout on the devices (:class:`~scaletrain.objectives.ppo_loss.GAESpec`).

The model is the policy with a value head (``score``: ``models/common/score_head.attach_value_head``); one
forward gives the log-probabilities and the values. The loss is ``policy + vf_coef * value``, each a mean
over the batch's completion tokens (TRL's ``masked_mean``), kept as sums divided once by the batch's tokens,
so micro-batches give the whole batch's loss. Figures under TRL's names: ``loss/policy_avg``,
``loss/value_avg``, ``policy/clipfrac_avg``, ``val/clipfrac_avg``, ``policy/approxkl_avg``
(``½ (logp - old)²``), ``policy/entropy_avg``, ``val/ratio``; TRL averaged the last two over every column,
padding too; here over the completion tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.pair_metrics import eval_figures, step_figures, zeros
from scaletrain.objectives.ppo_loss import GAESpec, policy_terms, value_terms
from scaletrain.objectives.token_logps import completion_token_stats_and_values

Array = jax.Array
_SUMS = ("loss", "tokens", "sequences", "policy", "value", "policy_clipped", "value_clipped", "approxkl",
         "entropy", "ratio")
#: TRL's figure -> (sum, count)
FIGURES: dict[str, tuple[str, str]] = {
    "loss/policy_avg": ("policy", "tokens"),
    "loss/value_avg": ("value", "tokens"),
    "policy/clipfrac_avg": ("policy_clipped", "tokens"),
    "val/clipfrac_avg": ("value_clipped", "tokens"),
    "policy/approxkl_avg": ("approxkl", "tokens"),
    "policy/entropy_avg": ("entropy", "tokens"),
    "val/ratio": ("ratio", "tokens"),
}


@dataclasses.dataclass(frozen=True)
class PPOObjective(ObjectiveBase):
    """PPO-clip with a clipped value loss (see the module docstring)."""

    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    temperature: float = 1.0
    #: how the rollout's scores become per-token advantages and returns (GAE)
    advantages: GAESpec = GAESpec()

    name: ClassVar[str] = "ppo"
    frozen_models: ClassVar[tuple[str, ...]] = ()
    normaliser: ClassVar[str] = "tokens"
    batch_keys: ClassVar[tuple[str, ...]] = ("input_ids", "segment_ids", "positions", "completion_mask",
                                             "old_logps", "values", "advantages", "returns")
    #: GRPO's rollout figures named without a ``/`` that the train log keeps (the ``/`` ones are kept anyway)
    logged_metrics: ClassVar[tuple[str, ...]] = ("reward", "reward_std", "frac_reward_zero_std")

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        if getattr(model, "score", None) is None:
            raise ConfigError("objective.type=ppo trains a policy with a value head; run it with PPOTrainer (or a "
                              "recipe), which adds the head")
        mask = batch["completion_mask"].astype(jnp.float32)
        logps, entropy, values = completion_token_stats_and_values(
            model, batch["input_ids"], batch["segment_ids"], batch["positions"], mask.shape[1], self.temperature)
        return self.sums_from(logps, entropy, values, batch, mask)

    def sums_from(self, logps: Array, entropy: Array, values: Array, batch: Batch, mask: Array
                  ) -> tuple[Array, Sums]:
        """The loss and sums given the current per-token log-probabilities and values (what the oracle checks)."""
        sg = jax.lax.stop_gradient
        old = batch["old_logps"].astype(jnp.float32)
        pg, pg_clipped, ratio = policy_terms(logps, old, batch["advantages"].astype(jnp.float32), self.cliprange)
        vf, vf_clipped = value_terms(values, batch["values"].astype(jnp.float32),
                                     batch["returns"].astype(jnp.float32), self.cliprange_value)
        loss = jnp.sum((pg + self.vf_coef * vf) * mask)
        diff = sg(logps) - old
        return loss, {
            "loss": sg(loss),
            "tokens": jnp.sum(mask),
            "sequences": jnp.asarray(mask.shape[0], jnp.float32),
            "policy": sg(jnp.sum(pg * mask)),
            "value": sg(jnp.sum(vf * mask)),
            "policy_clipped": jnp.sum(pg_clipped * mask),
            "value_clipped": jnp.sum(vf_clipped * mask),
            "approxkl": jnp.sum(0.5 * diff ** 2 * mask),
            "entropy": sg(jnp.sum(entropy * mask)),
            "ratio": sg(jnp.sum(ratio * mask)),
        }

    def zero_sums(self, model: Any) -> Sums:
        return zeros(_SUMS)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        return {"loss": sums["loss"] / denom, **step_figures(sums, FIGURES)}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        return {"eval_loss": float(totals["loss"]) / max(float(totals["tokens"]), 1.0),
                **eval_figures(totals, FIGURES)}
