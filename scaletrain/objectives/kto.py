"""KTO over unpaired rows (prompt, completion, desirable or not), as TRL 1.16's ``KTOTrainer`` computes it.

With ``ρ = log π(y|x) - log π_ref(y|x)`` per row (summed over completion tokens) and ``z`` the KL
estimate, a desirable row's loss is ``w_d (1 - σ(β(ρ - z)))``, an undesirable one's
``w_u (1 - σ(β(z - ρ)))`` (``loss_type="apo_zero_unpaired"``: ``w_d (1 - σ(βρ))`` and ``w_u σ(βρ)``,
no KL); the loss is their mean over rows. ``z = max(0, mean(log π(y'|x) - log π_ref(y'|x)))`` over the
KL rows (each prompt with another row's completion, built by the data kind as TRL does), never
differentiated, estimated per micro-batch as TRL estimates it per device batch.

Figures: ``kl``, ``rewards/chosen`` / ``rewards/rejected`` (``βρ`` averaged over desirable /
undesirable rows), ``rewards/margins`` (their difference), ``logps/*``, ``logits/*`` (the
vocabulary-mean logit over completion tokens) and ``entropy``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.logps import halves, real_rows, sequence_stats
from scaletrain.objectives.pair_metrics import eval_figures, step_figures, zeros
from scaletrain.objectives.reference import check_source, reference_frozen_models, reference_logps

Array = jax.Array
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
ROW_KEYS = ("input_ids", "segment_ids", "loss_mask")
FIGURES = {
    "rewards/chosen": ("rewards_chosen", "rows_chosen"),
    "rewards/rejected": ("rewards_rejected", "rows_rejected"),
    "logps/chosen": ("logps_chosen", "rows_chosen"),
    "logps/rejected": ("logps_rejected", "rows_rejected"),
    "logits/chosen": ("logits_chosen", "tokens_chosen"),
    "logits/rejected": ("logits_rejected", "tokens_rejected"),
    "entropy": ("entropy", "tokens"),
    "kl": ("kl", "rows"),
}
_SUMS = ("loss", "rows", "rows_chosen", "rows_rejected", "rewards_chosen", "rewards_rejected", "logps_chosen",
         "logps_rejected", "logits_chosen", "logits_rejected", "tokens_chosen", "tokens_rejected", "tokens",
         "entropy", "kl")


@dataclasses.dataclass(frozen=True)
class KTOObjective(ObjectiveBase):
    """TRL 1.16's KTO (see the module docstring) over ``unpaired_preference`` batches."""

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference_source: str = "model"

    name: ClassVar[str] = "kto"
    normaliser: ClassVar[str] = "rows"
    logged_metrics: ClassVar[tuple[str, ...]] = ("kl", "entropy")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"objective.beta={self.beta} must be > 0")
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={self.loss_type!r} is not one of {list(KTO_LOSS_TYPES)}")
        for field in ("desirable_weight", "undesirable_weight"):
            if getattr(self, field) < 0:
                raise ConfigError(f"objective.{field}={getattr(self, field)} must be >= 0")
        check_source(self.reference_source)

    @property
    def uses_kl(self) -> bool:
        return self.loss_type == "kto"

    @property
    def sequences_per_row(self) -> int:
        """Sequences forwarded per row (the row and, for ``kto``, its KL row): what tokens/s counts."""
        return 2 if self.uses_kl else 1

    @property
    def batch_keys(self) -> tuple[str, ...]:
        keys = ROW_KEYS + ("label",) + (tuple(f"kl_{k}" for k in ROW_KEYS) if self.uses_kl else ())
        if self.reference_source == "precomputed":
            keys += ("ref_logps",) + (("ref_kl_logps",) if self.uses_kl else ())
        return keys

    @property
    def frozen_models(self) -> tuple[str, ...]:
        return reference_frozen_models(self.reference_source)

    def _rows(self, batch: Batch) -> tuple[Array, Array, Array, Any]:
        """The rows scored: the batch's, then (for ``kto``) its KL rows, concatenated for one forward."""
        if not self.uses_kl:
            return batch["input_ids"], batch["segment_ids"], batch["loss_mask"], batch.get("positions")
        cat = [jnp.concatenate([batch[k], batch[f"kl_{k}"]], axis=0) for k in ROW_KEYS]
        have = batch.get("positions") is not None and batch.get("kl_positions") is not None
        return (*cat, jnp.concatenate([batch["positions"], batch["kl_positions"]]) if have else None)

    @property
    def precomputed_keys(self) -> tuple[str, ...]:
        """The batch keys ``precompute_ref_log_probs`` serves."""
        return ("ref_logps", "ref_kl_logps") if self.uses_kl else ("ref_logps",)

    def reference_inputs(self, batch: Batch) -> dict[str, tuple[Array, Array, Array, Any]]:
        """The rows whose reference log-probabilities ``precompute_ref_log_probs`` stores, by batch key."""
        out = {"ref_logps": (*(batch[k] for k in ROW_KEYS), batch.get("positions"))}
        if self.uses_kl:
            out["ref_kl_logps"] = (*(batch[f"kl_{k}"] for k in ROW_KEYS), batch.get("kl_positions"))
        return out

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        rows_in = self._rows(batch)
        stats = sequence_stats(model, *rows_in)
        pre = (batch.get("ref_logps"),) + ((batch.get("ref_kl_logps"),) if self.uses_kl else ())
        ref = reference_logps(self.reference_source, model, frozen, rows_in, pre)
        rows = real_rows(batch["segment_ids"])
        sg = jax.lax.stop_gradient
        if self.uses_kl:
            main, kl_rows = halves(stats)
            ref_main, ref_kl = jnp.split(ref, 2)
            kl_real = real_rows(batch["kl_segment_ids"])
            kl_mean = jnp.sum((sg(kl_rows["logps"]) - ref_kl) * kl_real) / jnp.maximum(jnp.sum(kl_real), 1.0)
            kl = jnp.maximum(kl_mean, 0.0)
        else:
            main, ref_main, kl = stats, ref, jnp.zeros((), jnp.float32)
        desirable = (batch["label"] != 0).astype(jnp.float32) * rows
        undesirable = (batch["label"] == 0).astype(jnp.float32) * rows
        ratio = main["logps"] - ref_main
        if self.loss_type == "kto":
            chosen_losses = 1 - jax.nn.sigmoid(self.beta * (ratio - kl))
            rejected_losses = 1 - jax.nn.sigmoid(self.beta * (kl - ratio))
        else:
            chosen_losses = 1 - jax.nn.sigmoid(self.beta * ratio)
            rejected_losses = jax.nn.sigmoid(self.beta * ratio)
        loss = jnp.sum(self.desirable_weight * chosen_losses * desirable
                       + self.undesirable_weight * rejected_losses * undesirable)
        rewards = sg(self.beta * ratio)
        completion = main["tokens"]
        return loss, {
            "loss": loss,
            "rows": jnp.sum(rows),
            "rows_chosen": jnp.sum(desirable),
            "rows_rejected": jnp.sum(undesirable),
            "rewards_chosen": jnp.sum(rewards * desirable),
            "rewards_rejected": jnp.sum(rewards * undesirable),
            "logps_chosen": sg(jnp.sum(main["logps"] * desirable)),
            "logps_rejected": sg(jnp.sum(main["logps"] * undesirable)),
            "logits_chosen": sg(jnp.sum(main["logit_sum"] * desirable)),
            "logits_rejected": sg(jnp.sum(main["logit_sum"] * undesirable)),
            "tokens_chosen": jnp.sum(completion * desirable),
            "tokens_rejected": jnp.sum(completion * undesirable),
            "tokens": jnp.sum(completion * rows),
            "entropy": sg(jnp.sum(main["entropy_sum"] * rows)),
            "kl": kl * jnp.sum(rows),  # per-row weight, so the step's figure is the rows' average estimate
        }

    def zero_sums(self, model: Any) -> Sums:
        return zeros(_SUMS)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        out = {"loss": sums["loss"] / denom, **step_figures(sums, FIGURES)}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        out = {"eval_loss": float(totals["loss"]) / max(float(totals["rows"]), 1.0), **eval_figures(totals, FIGURES)}
        out["eval_rewards/margins"] = out["eval_rewards/chosen"] - out["eval_rewards/rejected"]
        return out
