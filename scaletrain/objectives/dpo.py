"""DPO and its relatives (IPO, hinge, robust, ...) with TRL 1.16's ``DPOTrainer`` formulas and figures.

Per pair, with ``c`` and ``r`` the chosen and rejected completions' log-ratios to the reference
(``log pi(y|x) - log pi_ref(y|x)``, summed over completion tokens) and ``d = c - r``:
``sigmoid`` ``-log σ(β d)`` (DPO), ``hinge`` ``max(0, 1 - β d)``, ``ipo`` ``(c/|y_c| - r/|y_r| - 1/(2β))²``
(per-token log-ratios, as TRL), and the others in :data:`PER_PAIR_LOSSES`. ``loss_type`` may list
several, weighted by ``loss_weights`` (default 1 each), as TRL's MPO-style combination. The loss is
the mean over pairs, computed as a sum over the micro-batch's pairs (the normaliser), so gradient
accumulation is exact.

The figures are TRL's: ``rewards/{chosen,rejected,accuracies,margins}`` (rewards ``β c``, ``β r``),
``logps/{chosen,rejected}`` (summed completion log-probabilities), ``logits/{chosen,rejected}``
(the vocabulary-mean logit averaged over completion tokens), ``entropy`` (over chosen and rejected
completion tokens) and ``mean_token_accuracy`` (chosen completion tokens whose target is the argmax).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.logps import concatenated, halves, real_rows, sequence_stats
from scaletrain.objectives.pair_metrics import PAIR_FIGURES, eval_figures, reward_sums, step_figures, zeros
from scaletrain.objectives.reference import check_source, reference_frozen_models, reference_logps

Array = jax.Array
logsig = jax.nn.log_sigmoid


@dataclasses.dataclass(frozen=True)
class PairTerms:
    """What a per-pair loss reads: log-ratios, completion lengths and the options."""

    chosen: Array  # log pi(y_c|x) - log pi_ref(y_c|x)
    rejected: Array
    chosen_tokens: Array
    rejected_tokens: Array
    beta: float
    label_smoothing: float
    discopop_tau: float


def _ipo(t: PairTerms) -> Array:
    delta = t.chosen / jnp.maximum(t.chosen_tokens, 1.0) - t.rejected / jnp.maximum(t.rejected_tokens, 1.0)
    return (delta - 1 / (2 * t.beta)) ** 2


def _sigmoid_norm(t: PairTerms) -> Array:
    delta = t.chosen / jnp.maximum(t.chosen_tokens, 1.0) - t.rejected / jnp.maximum(t.rejected_tokens, 1.0)
    return -logsig(t.beta * delta)


def _exo_pair(t: PairTerms) -> Array:
    z, eps = t.beta * (t.chosen - t.rejected), t.label_smoothing
    return (jax.nn.sigmoid(z) * (logsig(z) - jnp.log1p(-eps))
            + jax.nn.sigmoid(-z) * (logsig(-z) - jnp.log(eps)))


def _robust(t: PairTerms) -> Array:
    z, eps = t.beta * (t.chosen - t.rejected), t.label_smoothing
    return (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps)


def _discopop(t: PairTerms) -> Array:
    z = t.beta * (t.chosen - t.rejected)
    mix = jax.nn.sigmoid(z / t.discopop_tau)
    return -logsig(z) * (1 - mix) + jnp.exp(-z) * mix


#: TRL 1.16's per-pair DPO losses (its batch-level ``aot``, ``aot_unpaired`` and ``sft`` are not offered:
#: they are not sums over pairs, so accumulation could not be exact)
PER_PAIR_LOSSES: dict[str, Callable[[PairTerms], Array]] = {
    "sigmoid": lambda t: -logsig(t.beta * (t.chosen - t.rejected)),
    "hinge": lambda t: jax.nn.relu(1 - t.beta * (t.chosen - t.rejected)),
    "ipo": _ipo,
    "exo_pair": _exo_pair,
    "nca_pair": lambda t: (-logsig(t.beta * t.chosen) - 0.5 * logsig(-t.beta * t.chosen)
                           - 0.5 * logsig(-t.beta * t.rejected)),
    "robust": _robust,
    "bco_pair": lambda t: -logsig(t.beta * t.chosen) - logsig(-t.beta * t.rejected),
    "sppo_hard": lambda t: (t.chosen - 0.5 / t.beta) ** 2 + (t.rejected + 0.5 / t.beta) ** 2,
    "apo_zero": lambda t: 1 - jax.nn.sigmoid(t.beta * t.chosen) + jax.nn.sigmoid(t.beta * t.rejected),
    "apo_down": lambda t: jax.nn.sigmoid(t.beta * t.chosen) + 1 - jax.nn.sigmoid(t.beta * (t.chosen - t.rejected)),
    "discopop": _discopop,
    "sigmoid_norm": _sigmoid_norm,
}

DPO_FIGURES: dict[str, tuple[str, str]] = {
    **PAIR_FIGURES,
    "logits/chosen": ("logits_chosen", "tokens_chosen"),
    "logits/rejected": ("logits_rejected", "tokens_rejected"),
    "entropy": ("entropy", "tokens"),
    "mean_token_accuracy": ("top1_chosen", "tokens_chosen"),
}
_SUMS = ("loss", "pairs", "rewards_chosen", "rewards_rejected", "rewards_accuracies", "rewards_margins",
         "logps_chosen", "logps_rejected", "logits_chosen", "logits_rejected", "tokens_chosen", "tokens_rejected",
         "tokens", "entropy", "top1_chosen")


def check_loss_types(loss_type: tuple[str, ...], loss_weights: tuple[float, ...] | None, label_smoothing: float,
                     field: str = "objective") -> None:
    """ConfigError naming the field for a loss type TRL's DPO does not have (or we do not offer), weights of
    another length, or a ``label_smoothing`` its loss type cannot take."""
    if not loss_type:
        raise ConfigError(f"{field}.loss_type is empty; give one of {sorted(PER_PAIR_LOSSES)} or a list of them")
    for name in loss_type:
        if name not in PER_PAIR_LOSSES:
            why = " (a batch-level loss: not offered)" if name in ("aot", "aot_unpaired", "sft") else ""
            raise ConfigError(f"{field}.loss_type={name!r} is not one of {sorted(PER_PAIR_LOSSES)}{why}")
    if loss_weights is not None and len(loss_weights) != len(loss_type):
        raise ConfigError(f"{field}.loss_weights has {len(loss_weights)} weights for {len(loss_type)} loss types "
                          f"{list(loss_type)}; give one weight per loss type")
    if "robust" in loss_type and not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"{field}.label_smoothing={label_smoothing} must be in [0, 0.5) for loss_type robust")
    if "exo_pair" in loss_type and not 0.0 < label_smoothing < 1.0:
        raise ConfigError(f"{field}.label_smoothing={label_smoothing} must be in (0, 1) for loss_type exo_pair")


@dataclasses.dataclass(frozen=True)
class DPOObjective(ObjectiveBase):
    """TRL 1.16's DPO loss family over pair batches (``chosen_*`` / ``rejected_*`` keys, see the module).

    ``reference_source``: where the reference log-probabilities come from (``objectives/reference.py``).
    """

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    reference_source: str = "model"

    name: ClassVar[str] = "dpo"
    normaliser: ClassVar[str] = "pairs"
    #: sequences forwarded per row (chosen and rejected): what tokens/s counts
    sequences_per_row: ClassVar[int] = 2
    #: figures the train log records besides ``loss`` (TRL's names without a ``/``)
    logged_metrics: ClassVar[tuple[str, ...]] = ("entropy", "mean_token_accuracy")

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            object.__setattr__(self, "loss_type", (self.loss_type,))
        object.__setattr__(self, "loss_type", tuple(self.loss_type))
        if self.loss_weights is not None:
            object.__setattr__(self, "loss_weights", tuple(float(w) for w in self.loss_weights))
        if self.beta <= 0:
            raise ConfigError(f"objective.beta={self.beta} must be > 0")
        check_loss_types(self.loss_type, self.loss_weights, self.label_smoothing)
        check_source(self.reference_source)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        keys = tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in ("input_ids", "segment_ids",
                                                                                 "loss_mask"))
        return keys + (self.precomputed_keys if self.reference_source == "precomputed" else ())

    @property
    def frozen_models(self) -> tuple[str, ...]:
        return reference_frozen_models(self.reference_source)

    #: the batch keys ``precompute_ref_log_probs`` serves
    precomputed_keys: ClassVar[tuple[str, ...]] = ("ref_chosen_logps", "ref_rejected_logps")

    def reference_inputs(self, batch: Batch) -> dict[str, tuple[Array, Array, Array, Any]]:
        """The rows whose reference log-probabilities ``precompute_ref_log_probs`` stores, by batch key."""
        return {f"ref_{side}_logps": (batch[f"{side}_input_ids"], batch[f"{side}_segment_ids"],
                                      batch[f"{side}_loss_mask"], batch.get(f"{side}_positions"))
                for side in ("chosen", "rejected")}

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        """The summed loss over the micro-batch's pairs and the figures' sums (one policy forward of [2B, L])."""
        rows_in = concatenated(batch, "chosen_", "rejected_")
        chosen, rejected = halves(sequence_stats(model, *rows_in))
        ref = reference_logps(self.reference_source, model, frozen, rows_in,
                              tuple(batch.get(k) for k in ("ref_chosen_logps", "ref_rejected_logps")))
        ref_chosen, ref_rejected = jnp.split(ref, 2)
        rows = real_rows(batch["chosen_segment_ids"])
        terms = PairTerms(chosen["logps"] - ref_chosen, rejected["logps"] - ref_rejected, chosen["tokens"],
                          rejected["tokens"], self.beta, self.label_smoothing, self.discopop_tau)
        weights = self.loss_weights or (1.0,) * len(self.loss_type)
        per_pair = sum(w * PER_PAIR_LOSSES[name](terms) for name, w in zip(self.loss_type, weights))
        loss = jnp.sum(per_pair * rows)
        sg = jax.lax.stop_gradient
        sums = {
            "loss": loss,
            **reward_sums(self.beta * terms.chosen, self.beta * terms.rejected, chosen["logps"], rejected["logps"],
                          rows),
            "logits_chosen": sg(jnp.sum(chosen["logit_sum"])),
            "logits_rejected": sg(jnp.sum(rejected["logit_sum"])),
            "tokens_chosen": jnp.sum(chosen["tokens"]),
            "tokens_rejected": jnp.sum(rejected["tokens"]),
            "tokens": jnp.sum(chosen["tokens"]) + jnp.sum(rejected["tokens"]),
            "entropy": sg(jnp.sum(chosen["entropy_sum"]) + jnp.sum(rejected["entropy_sum"])),
            "top1_chosen": sg(jnp.sum(chosen["top1_sum"])),
        }
        return loss, sums

    def zero_sums(self, model: Any) -> Sums:
        return zeros(_SUMS)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        return {"loss": sums["loss"] / denom, **step_figures(sums, DPO_FIGURES)}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        pairs = max(float(totals["pairs"]), 1.0)
        return {"eval_loss": float(totals["loss"]) / pairs, **eval_figures(totals, DPO_FIGURES)}
