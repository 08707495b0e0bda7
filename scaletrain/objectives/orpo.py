"""ORPO and CPO/SimPO: reference-free preference objectives with an NLL term, as TRL 1.16 computes them.

**ORPO** (``trl.experimental.orpo``): with ``p_c``, ``p_r`` the chosen and rejected completions'
*per-token average* log-probabilities, ``log_odds = (p_c - p_r) - (log(1 - e^p_c) - log(1 - e^p_r))``;
loss ``= nll - β · mean(log σ(log_odds))``, ``nll`` the cross-entropy of the chosen rows over all
their real tokens (prompt and completion, as TRL). Rewards ``β p_c``, ``β p_r``; figures
``nll_loss``, ``log_odds_ratio`` (mean ``log σ(log_odds)``), ``log_odds_chosen`` (mean ``log_odds``).

**CPO** (``trl.experimental.cpo``), SimPO being its ``loss_type="simpo"``: with ``l_c``, ``l_r``
the completions' log-probabilities (per-token averages for ``ipo`` and ``simpo``, sums otherwise)
and ``z = l_c - l_r`` (minus ``simpo_gamma / β`` for SimPO): ``sigmoid``/``simpo``
``-(1-ε) log σ(β z) - ε log σ(-β z)``, ``hinge`` ``max(0, 1 - β z)``, ``ipo`` ``(z - 1/(2β))²``;
loss ``= mean + cpo_alpha · nll``, ``nll`` over the chosen completion tokens. Rewards ``β l``.

The NLL is a mean over the *batch's* tokens while the rest is a mean over pairs; the
objective asks for the batch's token count (``batch_totals``) and scales its NLL sum by
``pairs / tokens`` of the whole batch, so the step's single division by pairs is exact under
accumulation. ``logits/*`` average the vocabulary-mean logit over the rows' real positions
(TRL averages over its padded batch, the same figure when no row is padded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.errors import ConfigError
from scaletrain.objectives.base import TOTAL_PREFIX, Batch, ObjectiveBase, Sums
from scaletrain.objectives.logps import concatenated, halves, real_rows, sequence_stats
from scaletrain.objectives.pair_metrics import PAIR_FIGURES, eval_figures, reward_sums, step_figures, zeros

Array = jax.Array
logsig = jax.nn.log_sigmoid
PAIR_KEYS = tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in ("input_ids", "segment_ids", "loss_mask"))
_LOG_HALF = -0.6931471805599453


def log1mexp(x: Array) -> Array:
    """``log(1 - e^x)`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return jnp.where(x < _LOG_HALF, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def _average(stats: Mapping[str, Array]) -> Array:
    return stats["logps"] / jnp.maximum(stats["tokens"], 1.0)


class _WithNll(ObjectiveBase):
    """Shared by ORPO and CPO: the NLL over the chosen rows, normalised by the whole batch's tokens."""

    normaliser: ClassVar[str] = "pairs"
    #: sequences forwarded per row (chosen and rejected): what tokens/s counts
    sequences_per_row: ClassVar[int] = 2
    nll_over_prompt: ClassVar[bool]
    logit_key: ClassVar[str]  # which positions logits/* average over
    count_key: ClassVar[str]
    figures: ClassVar[dict[str, tuple[str, str]]]
    sum_keys: ClassVar[tuple[str, ...]]
    batch_keys: ClassVar[tuple[str, ...]] = PAIR_KEYS
    frozen_models: ClassVar[tuple[str, ...]] = ()

    def batch_totals(self, batch: Batch) -> dict[str, Array]:
        """The whole batch's pairs and chosen NLL target tokens (see the module docstring)."""
        seg = batch["chosen_segment_ids"]
        same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
        if not self.nll_over_prompt:
            same = same & (batch["chosen_loss_mask"][:, 1:] != 0)
        return {"pairs": jnp.sum(real_rows(seg)), "nll_tokens": jnp.sum(same.astype(jnp.float32))}

    def _forward(self, model: Any, batch: Batch) -> tuple[dict[str, Array], dict[str, Array], Array, dict]:
        chosen, rejected = halves(sequence_stats(model, *concatenated(batch, "chosen_", "rejected_")))
        rows = real_rows(batch["chosen_segment_ids"])
        nll_key, tokens_key = ("seq_logps", "seq_tokens") if self.nll_over_prompt else ("logps", "tokens")
        nll_sum = -jnp.sum(chosen[nll_key])
        scale = batch[TOTAL_PREFIX + "pairs"] / jnp.maximum(batch[TOTAL_PREFIX + "nll_tokens"], 1.0)
        sg = jax.lax.stop_gradient
        common = {
            "nll_sum": sg(nll_sum),
            "nll_tokens": jnp.sum(chosen[tokens_key]),
            "logits_chosen": sg(jnp.sum(chosen[self.logit_key])),
            "logits_rejected": sg(jnp.sum(rejected[self.logit_key])),
            "count_chosen": jnp.sum(chosen[self.count_key]),
            "count_rejected": jnp.sum(rejected[self.count_key]),
        }
        return chosen, rejected, rows, {"scaled_nll": nll_sum * scale, **common}

    def zero_sums(self, model: Any) -> Sums:
        return zeros(self.sum_keys)

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        return {"loss": sums["loss"] / denom, **step_figures(sums, self.figures)}


_NLL_FIGURES = {
    "logits/chosen": ("logits_chosen", "count_chosen"),
    "logits/rejected": ("logits_rejected", "count_rejected"),
    "nll_loss": ("nll_sum", "nll_tokens"),
}
_COMMON_SUMS = ("loss", "pairs", "rewards_chosen", "rewards_rejected", "rewards_accuracies", "rewards_margins",
                "logps_chosen", "logps_rejected", "nll_sum", "nll_tokens", "logits_chosen", "logits_rejected",
                "count_chosen", "count_rejected")


@dataclasses.dataclass(frozen=True)
class ORPOObjective(_WithNll):
    """TRL 1.16's ORPO (see the module docstring); ``beta`` is TRL's λ."""

    beta: float = 0.1

    name: ClassVar[str] = "orpo"
    nll_over_prompt: ClassVar[bool] = True
    logit_key: ClassVar[str] = "seq_logit_sum"
    count_key: ClassVar[str] = "seq_tokens"
    figures: ClassVar[dict[str, tuple[str, str]]] = {
        **PAIR_FIGURES, **_NLL_FIGURES,
        "log_odds_ratio": ("log_odds_ratio", "pairs"),
        "log_odds_chosen": ("log_odds_chosen", "pairs"),
    }
    sum_keys: ClassVar[tuple[str, ...]] = _COMMON_SUMS + ("ratio_sum", "log_odds_ratio", "log_odds_chosen")
    logged_metrics: ClassVar[tuple[str, ...]] = ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"objective.beta={self.beta} must be > 0")

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        chosen, rejected, rows, common = self._forward(model, batch)
        p_c, p_r = _average(chosen), _average(rejected)
        log_odds = (p_c - p_r) - (log1mexp(p_c) - log1mexp(p_r))
        ratio = logsig(log_odds)
        ratio_sum = jnp.sum(ratio * rows)
        loss = common.pop("scaled_nll") - self.beta * ratio_sum
        sg = jax.lax.stop_gradient
        return loss, {
            "loss": loss, **common, **reward_sums(self.beta * p_c, self.beta * p_r, p_c, p_r, rows),
            "ratio_sum": sg(ratio_sum), "log_odds_ratio": sg(ratio_sum),
            "log_odds_chosen": sg(jnp.sum(log_odds * rows)),
        }

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        pairs, tokens = max(float(totals["pairs"]), 1.0), max(float(totals["nll_tokens"]), 1.0)
        loss = float(totals["nll_sum"]) / tokens - self.beta * float(totals["ratio_sum"]) / pairs
        return {"eval_loss": loss, **eval_figures(totals, self.figures)}


CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclasses.dataclass(frozen=True)
class CPOObjective(_WithNll):
    """TRL 1.16's CPO; ``loss_type="simpo"`` is SimPO (see the module docstring)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    name: ClassVar[str] = "cpo"
    nll_over_prompt: ClassVar[bool] = False
    logit_key: ClassVar[str] = "all_logit_sum"
    count_key: ClassVar[str] = "positions"
    figures: ClassVar[dict[str, tuple[str, str]]] = {**PAIR_FIGURES, **_NLL_FIGURES}
    sum_keys: ClassVar[tuple[str, ...]] = _COMMON_SUMS + ("pair_loss",)
    logged_metrics: ClassVar[tuple[str, ...]] = ("nll_loss",)

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"objective.beta={self.beta} must be > 0")
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={self.loss_type!r} is not one of {list(CPO_LOSS_TYPES)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 0.5)")

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        chosen, rejected, rows, common = self._forward(model, batch)
        average = self.loss_type in ("ipo", "simpo")
        l_c, l_r = (_average(chosen), _average(rejected)) if average else (chosen["logps"], rejected["logps"])
        z = l_c - l_r
        if self.loss_type == "simpo":
            z = z - self.simpo_gamma / self.beta
        if self.loss_type in ("sigmoid", "simpo"):
            eps = self.label_smoothing
            per_pair = -logsig(self.beta * z) * (1 - eps) - logsig(-self.beta * z) * eps
        elif self.loss_type == "hinge":
            per_pair = jax.nn.relu(1 - self.beta * z)
        else:
            per_pair = (z - 1 / (2 * self.beta)) ** 2
        pair_loss = jnp.sum(per_pair * rows)
        scaled_nll = common.pop("scaled_nll")
        if not self.cpo_alpha:  # TRL computes no NLL then, and reports nll_loss 0
            common["nll_sum"] = jnp.zeros((), jnp.float32)
        loss = pair_loss + (self.cpo_alpha * scaled_nll if self.cpo_alpha else 0.0)
        return loss, {"loss": loss, **common, **reward_sums(self.beta * l_c, self.beta * l_r, l_c, l_r, rows),
                      "pair_loss": jax.lax.stop_gradient(pair_loss)}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        pairs, tokens = max(float(totals["pairs"]), 1.0), max(float(totals["nll_tokens"]), 1.0)
        loss = float(totals["pair_loss"]) / pairs + self.cpo_alpha * float(totals["nll_sum"]) / tokens
        return {"eval_loss": loss, **eval_figures(totals, self.figures)}
