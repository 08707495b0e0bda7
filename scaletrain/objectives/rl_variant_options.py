"""The options of GRPO's variants: RLOO (``objective: {type: rloo}``, ``RLOOConfig``) and REINFORCE++
(``type: reinforce_pp``), under TRL's names where TRL has the algorithm.

Why subclasses of :class:`~scaletrain.objectives.grpo_options.GRPOOptions`: a variant samples, scores
and batches as GRPO does (the same rollout reads the same options); it changes the advantage estimator
(``objectives/advantage_estimators.py``) and, for RLOO, the loss. The GRPO options a variant has no use
for are refused when set to anything but their default, naming the option and what the variant does
instead, so a recipe never sets a knob that silently does nothing.

RLOO's defaults are TRL 1.16's ``RLOOConfig``'s (``num_generations=2``, ``beta=0.05``) except
``max_completion_length`` (256, as GRPO's here, to suit a CPU). REINFORCE++'s are GRPO's, plus
``group_baseline`` (true: OpenRLHF's ``reinforce_baseline``, the reward less its group's mean; false:
its ``reinforce++``, the reward itself), before the batch normalisation.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from scaletrain.config_keys import key_errors
from scaletrain.objectives.advantage_estimators import AdvantageSpec
from scaletrain.objectives.grpo_options import GRPOOptions, loss_config

#: GRPO's options that RLOO does not read, with what it does instead
_NOT_RLOO = {
    "loss_type": "RLOO's loss is one clipped ratio per completion, averaged over completions (TRL's RLOOTrainer)",
    "importance_sampling_level": "RLOO's ratio is per completion (of its summed log-probabilities)",
    "scale_rewards": "RLOO's advantage is leave-one-out; normalize_advantages scales it over the batch",
    "delta": "RLOO clips with epsilon / epsilon_high only",
    "use_bias_correction_kl": "RLOO takes beta * KL off the reward, not in the loss",
    "vllm_importance_sampling_correction": "TRL's RLOOTrainer has no sampler correction",
    "vllm_importance_sampling_mode": "TRL's RLOOTrainer has no sampler correction",
    "vllm_importance_sampling_clip_min": "TRL's RLOOTrainer has no sampler correction",
    "vllm_importance_sampling_clip_max": "TRL's RLOOTrainer has no sampler correction",
}
_NOT_REINFORCE_PP = {
    "scale_rewards": "REINFORCE++ normalises the advantages over the whole batch; group_baseline chooses the "
                     "baseline",
}


def _refuse(cls: type[GRPOOptions], data: Any, refused: dict[str, str]) -> Any:
    """``data`` unless it sets one of the ``refused`` options to anything but its default (a dump of the options,
    which holds every default, passes)."""
    if not isinstance(data, dict):
        return data
    bad = [k for k in refused if k in data and data[k] != cls.model_fields[k].default]
    if bad:
        raise key_errors(cls.__name__, [(k, f"{refused[k]}: drop {k} (or use objective.type: grpo)", data[k])
                                        for k in bad])
    return data


class RLOOOptions(GRPOOptions):
    """TRL 1.16's ``RLOOConfig`` options (see the module docstring)."""

    num_generations: int = Field(2, ge=2)
    beta: float = Field(0.05, ge=0)
    normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _grpo_only(cls, data: Any) -> Any:
        return _refuse(cls, data, _NOT_RLOO)


class ReinforcePPOptions(GRPOOptions):
    """GRPO's options with REINFORCE++'s batch-normalised advantage (see the module docstring)."""

    group_baseline: bool = True

    @model_validator(mode="before")
    @classmethod
    def _grpo_only(cls, data: Any) -> Any:
        return _refuse(cls, data, _NOT_REINFORCE_PP)


def build_rloo_objective(o: RLOOOptions) -> Any:
    """The :class:`~scaletrain.objectives.rloo.RLOOObjective` of validated options."""
    from scaletrain.objectives.rloo import RLOOObjective

    spec = AdvantageSpec.of("rloo", o, reward_clip_range=o.reward_clip_range, kl_coef=o.beta)
    return RLOOObjective(loss=loss_config(o), temperature=o.temperature, num_iterations=o.num_iterations,
                         advantages=spec)


def build_reinforce_pp_objective(o: ReinforcePPOptions) -> Any:
    """GRPO's objective with REINFORCE++'s advantages."""
    from scaletrain.objectives.grpo import GRPOObjective

    return GRPOObjective(loss=loss_config(o), temperature=o.temperature, num_iterations=o.num_iterations,
                         importance_sampling_correction=o.vllm_importance_sampling_correction,
                         advantages=AdvantageSpec.of("reinforce_pp", o))
