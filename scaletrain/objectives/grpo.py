"""GRPO (and DAPO, Dr. GRPO, BNPO, GSPO) as an :class:`~scaletrain.objectives.Objective`, with TRL 1.16's loss.

A GRPO batch is a rollout batch scored and ready to learn from (``scaletrain.rl`` builds it):

- ``input_ids`` / ``segment_ids`` / ``positions`` [N, P + C]: each completion after its
  left-padded prompt, as the rollout engine laid them out;
- ``completion_mask`` [N, C]: 1 on the completion tokens that count (a truncated completion's
  are 0 with ``mask_truncated_completions``);
- ``advantages`` [N]: the rewards made advantages by the objective's ``advantages`` estimator
  (``objectives/advantage_estimators.py``; GRPO's group normalisation by default);
- ``old_logps`` [N, C] when ``num_iterations > 1`` (the policy that sampled, scored by the
  trainer's forward before the first update); with one iteration the current log-probabilities,
  held constant, stand in for them, as in TRL, so the ratio is exactly 1;
- ``ref_logps`` [N, C] when ``beta != 0``; ``importance_sampling_ratio`` [N, C] or [N, 1] with
  ``vllm_importance_sampling_correction``;
- ``sampler_logps`` [N, C] with ``sampler_check``: the sampler's log-probabilities of its tokens,
  compared with this forward's (``rollout/logprob_diff_max`` / ``_mean``). Why here: with one
  iteration the update's forward runs at the parameters that sampled, so it is the trainer's
  forward the check needs, and the rollout saves a forward of its own (TRL skips that forward too).

Why sums: ``grpo`` and ``dr_grpo`` average over completions (the sum of per-row figures,
divided by the batch's completions), ``bnpo`` and ``dapo`` over the whole batch's completion
tokens; either way the step adds micro-batches and divides once, so accumulation gives the
loss of the whole batch. (TRL's ``bnpo`` and ``grpo`` average per micro-batch instead; with one
micro-batch the figures are equal.) The figures are TRL's: ``kl``, ``entropy``,
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from scaletrain.objectives.advantage_estimators import AdvantageSpec
from scaletrain.objectives.base import Batch, ObjectiveBase, Sums
from scaletrain.objectives.grpo_loss import GRPOLossConfig, loss_sum, normaliser_key, per_token_terms
from scaletrain.objectives.pair_metrics import eval_figures, step_figures, zeros
from scaletrain.objectives.token_logps import completion_token_stats

Array = jax.Array
ROW_KEYS = ("input_ids", "segment_ids", "positions", "completion_mask", "advantages")
_SUMS = ("loss", "sequences", "tokens", "kl", "entropy", "clip_low", "clip_high", "clip_region", "clip_count")
_CHECK_SUMS = ("logprob_diff_sum", "logprob_diff_max")


def figures() -> dict[str, tuple[str, str]]:
    """TRL's figure names -> (sum, count). The clip ratios count tokens, or completions at the sequence level
    (one weight per completion, as TRL's ``global_masked_mean`` counts them)."""
    return {
        "kl": ("kl", "tokens"),
        "entropy": ("entropy", "tokens"),
        "clip_ratio/low_mean": ("clip_low", "clip_count"),
        "clip_ratio/high_mean": ("clip_high", "clip_count"),
        "clip_ratio/region_mean": ("clip_region", "clip_count"),
    }


@dataclasses.dataclass(frozen=True)
class GRPOObjective(ObjectiveBase):
    """TRL 1.16's GRPO loss over GRPO batches (see the module docstring); ``loss`` holds its options."""

    loss: GRPOLossConfig = GRPOLossConfig()
    temperature: float = 1.0
    num_iterations: int = 1
    importance_sampling_correction: bool = False
    #: compare ``sampler_logps`` with this forward's; its ``logprob_diff_max`` sum is a max only with one
    #: micro-batch (the step adds micro-batches' sums), so the GRPO trainer sets it only then
    sampler_check: bool = False
    #: how the rollout turns rewards into the batch's ``advantages`` (an estimator of the registry and its options)
    advantages: AdvantageSpec = AdvantageSpec()

    name: ClassVar[str] = "grpo"
    frozen_models: ClassVar[tuple[str, ...]] = ()
    logged_metrics: ClassVar[tuple[str, ...]] = ("kl", "entropy", "reward", "reward_std", "frac_reward_zero_std")

    @property
    def normaliser(self) -> str:
        return normaliser_key(self.loss.loss_type)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        keys = ROW_KEYS
        if self.num_iterations > 1:
            keys += ("old_logps",)
        if self.loss.beta != 0.0:
            keys += ("ref_logps",)
        if self.importance_sampling_correction:
            keys += ("importance_sampling_ratio",)
        if self.sampler_check:
            keys += ("sampler_logps",)
        return keys

    def loss_and_sums(self, model: Any, batch: Batch, frozen: Mapping[str, Any]) -> tuple[Array, Sums]:
        mask = batch["completion_mask"].astype(jnp.float32)
        logps, entropy = completion_token_stats(model, batch["input_ids"], batch["segment_ids"], batch["positions"],
                                                mask.shape[1], self.temperature)
        return self.sums_from_logps(logps, entropy, batch, mask)

    def sums_from_logps(self, logps: Array, entropy: Array, batch: Batch, mask: Array) -> tuple[Array, Sums]:
        """The loss and sums given the current per-token log-probabilities (the part the TRL test checks)."""
        sg = jax.lax.stop_gradient
        old = batch["old_logps"] if self.num_iterations > 1 else sg(logps)
        terms = per_token_terms(self.loss, logps, old, batch["advantages"].astype(jnp.float32), mask,
                                ref=batch.get("ref_logps") if self.loss.beta != 0.0 else None,
                                is_ratio=batch.get("importance_sampling_ratio")
                                if self.importance_sampling_correction else None)
        loss = loss_sum(self.loss, terms.loss, mask)
        tokens = jnp.sum(mask)
        rows = jnp.asarray(mask.shape[0], jnp.float32)
        if terms.coef.shape[1] == 1:  # one weight per completion
            weight, count = jnp.ones_like(terms.coef), rows
        else:
            weight, count = mask, tokens
        region = jnp.maximum(terms.low_clipped, terms.high_clipped)
        return loss, {
            **self.sampler_sums(logps, batch, mask),
            "loss": sg(loss),
            "sequences": rows,
            "tokens": tokens,
            "kl": jnp.zeros((), jnp.float32) if terms.kl is None else sg(jnp.sum(terms.kl * mask)),
            "entropy": sg(jnp.sum(entropy * mask)),
            "clip_low": jnp.sum(terms.low_clipped * weight),
            "clip_high": jnp.sum(terms.high_clipped * weight),
            "clip_region": jnp.sum(region * weight),
            "clip_count": count,
        }

    def sampler_sums(self, logps: Array, batch: Batch, mask: Array) -> Sums:
        """With ``sampler_check``: the sampler's log-probabilities against this forward's, over the tokens the loss
        counts (``rollout/logprob_diff_*``); else nothing."""
        if not self.sampler_check:
            return {}
        diff = jnp.abs(jax.lax.stop_gradient(logps) - batch["sampler_logps"].astype(jnp.float32)) * (mask != 0)
        return {"logprob_diff_sum": jnp.sum(diff), "logprob_diff_max": jnp.max(diff)}

    def zero_sums(self, model: Any) -> Sums:
        return zeros(_SUMS + (_CHECK_SUMS if self.sampler_check else ()))

    def step_metrics(self, sums: Sums, denom: Array) -> dict[str, Array]:
        check: dict[str, Array] = {}
        if self.sampler_check:
            check = {"rollout/logprob_diff_max": sums["logprob_diff_max"],
                     "rollout/logprob_diff_mean": sums["logprob_diff_sum"] / jnp.maximum(sums["tokens"], 1.0)}
        return {"loss": sums["loss"] / denom, **step_figures(sums, figures()), **check}

    def eval_metrics(self, totals: Mapping[str, Any], bytes_per_token: float | None = None) -> dict[str, float]:
        denom = max(float(totals[self.normaliser]), 1.0)
        return {"eval_loss": float(totals["loss"]) / denom,
                **eval_figures(totals, figures())}
