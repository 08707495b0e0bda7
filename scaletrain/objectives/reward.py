"""Reward-model training: TRL 1.16's ``RewardTrainer`` loss and figures on pair batches.

Each pair's chosen and rejected sequences go through the score-head model once, together ([2B, L]); a
sequence's reward ``r`` is its score at its last non-padding token
(:mod:`scaletrain.models.common.score_head`). Per pair the loss is Bradley-Terry's ``-log σ(r_c - r_r - m)``
with ``m`` the row's ``margin`` when the data has one (0 otherwise), plus, with ``center_rewards_coefficient``
``c``, ``c · (r_c + r_r)²`` (Eisenstein et al.'s centring, as TRL writes it); the step's loss is their mean
over pairs, kept as a sum over the micro-batch's pairs so accumulation is exact.

Figures, TRL's names: ``accuracy`` (pairs with ``r_c > r_r``), ``margin`` (mean ``r_c - r_r``, the data's
margin not subtracted) and ``mean_reward`` (over chosen and rejected sequences). TRL's ``min_reward`` and
``max_reward`` are extremes of a batch, not sums, so they are not logged (a sum over micro-batches could not
give them exactly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.logps import concatenated, real_rows
from scaletrain.objectives.pair_metrics import eval_figures, step_figures, zeros

Array = jax.Array

#: figure -> (sum key, count key)
REWARD_FIGURES: dict[str, tuple[str, str]] = {
    "accuracy": ("accuracy", "pairs"),
    "margin": ("margin", "pairs"),
    "mean_reward": ("rewards", "sequences"),
}
_SUMS = ("loss", "pairs", "sequences", "accuracy", "margin", "rewards")


def pair_rewards(model: Any, batch: Batch) -> tuple[Array, Array]:
    """``(r_chosen [B], r_rejected [B])``: each sequence's score, chosen and rejected in one forward."""
    input_ids, segment_ids, _, positions = concatenated(batch, "chosen_", "rejected_")
    scores = model.sequence_scores(input_ids, positions=positions, segment_ids=segment_ids)
    chosen, rejected = jnp.split(scores, 2)
    return chosen, rejected


@dataclasses.dataclass(frozen=True)
class RewardObjective(ObjectiveBase):
    """Bradley-Terry reward-model loss (see the module); the model is a score-head model."""

    center_rewards_coefficient: float | None = None

    name: ClassVar[str] = "reward"
    frozen_models: ClassVar[tuple[str, ...]] = ()
    normaliser: ClassVar[str] = "pairs"
    sequences_per_row: ClassVar[int] = 2
    batch_keys: ClassVar[tuple[str, ...]] = ("chosen_input_ids", "chosen_segment_ids", "rejected_input_ids",
                                             "rejected_segment_ids")
    logged_metrics: ClassVar[tuple[str, ...]] = tuple(REWARD_FIGURES)

    def __post_init__(self) -> None:
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"objective.center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0")

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        if not hasattr(model, "sequence_scores"):
            raise ConfigError("objective.type=reward trains a model with a score head; load the model as "
                              "AutoModelForSequenceClassification (a recipe or RewardTrainer does so)")
        chosen, rejected = pair_rewards(model, batch)
        rows = real_rows(batch["chosen_segment_ids"])
        margin = batch["margin"].astype(jnp.float32) if "margin" in batch else 0.0
        per_pair = -jax.nn.log_sigmoid(chosen - rejected - margin)
        if self.center_rewards_coefficient is not None:
            per_pair = per_pair + self.center_rewards_coefficient * (chosen + rejected) ** 2
        loss = jnp.sum(per_pair * rows)
        c, r = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
        return loss, {
            "loss": loss,
            "pairs": jnp.sum(rows),
            "sequences": 2 * jnp.sum(rows),
            "accuracy": jnp.sum((c > r).astype(jnp.float32) * rows),
            "margin": jnp.sum((c - r) * rows),
            "rewards": jnp.sum((c + r) * rows),
        }

    def zero_sums(self, model: Any) -> Sums:
        return zeros(_SUMS)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        return {"loss": sums["loss"] / denom, **step_figures(sums, REWARD_FIGURES)}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        pairs = max(float(totals["pairs"]), 1.0)
        return {"eval_loss": float(totals["loss"]) / pairs, **eval_figures(totals, REWARD_FIGURES)}
