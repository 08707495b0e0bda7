"""PPO's options (``objective: {type: ppo, ...}``, ``PPOConfig``) under the names of TRL's last ``PPOConfig``.

Why a subclass of :class:`~scaletrain.objectives.grpo_options.GRPOOptions`: PPO samples, scores and batches
through GRPO's rollout (the same sampling options, reward functions and weights); it adds a value head and
forms per-token advantages by GAE. TRL 1.16 has no PPO trainer (not in ``trl.experimental`` either), so the
names and defaults are those of its last ``PPOConfig``: ``num_ppo_epochs`` (4), ``whiten_rewards`` (false),
``kl_coef`` (0.05), ``kl_estimator`` (``k1``), ``cliprange`` (0.2), ``vf_coef`` (0.1), ``cliprange_value``
(0.2), ``gamma`` (1.0), ``lam`` (0.95), ``num_mini_batches`` (1), and ``value_model`` (TRL:
``value_model_path``, also accepted): a reward model's folder whose ``score`` starts the value head.

Differences, each for a reason: ``num_generations`` defaults to 1 (PPO's baseline is the value, not the
group); ``num_ppo_epochs`` is GRPO's ``num_iterations`` (each epoch one optimizer step on the whole rollout);
``num_mini_batches`` above 1 (several optimizer steps per epoch on shuffled parts) is not built and is refused;
the value head shares the policy's trunk (TRL's value model was a second whole network). GRPO's options that
PPO does not read are refused when set, naming what PPO does instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from scaletrain.config_keys import key_errors
from scaletrain.objectives.grpo_options import GRPOOptions
from scaletrain.objectives.ppo_loss import GAESpec

_NOT_PPO = {
    "loss_type": "PPO's loss is a mean over the batch's completion tokens (TRL's PPOTrainer)",
    "importance_sampling_level": "PPO's ratio is per token",
    "scale_rewards": "PPO's advantages are GAE over the value head, whitened over the batch",
    "epsilon": "PPO clips with cliprange",
    "epsilon_high": "PPO clips with cliprange",
    "delta": "PPO clips with cliprange",
    "beta": "PPO's KL penalty is kl_coef, on each token's reward",
    "num_iterations": "PPO's epochs over a rollout are num_ppo_epochs",
    "use_bias_correction_kl": "PPO's KL is in the reward (kl_coef, kl_estimator), not in the loss",
    "vllm_importance_sampling_correction": "PPO has no sampler correction",
    "tools": "PPO's GAE runs over contiguous completion tokens; tool turns are not offered with PPO yet",
    "environment_factory": "PPO's GAE runs over contiguous completion tokens; environments are not offered with "
                           "PPO yet",
}


class PPOOptions(GRPOOptions):
    """TRL's last ``PPOConfig`` options over GRPO's rollout options (see the module docstring).

    ``beta`` and ``num_iterations`` are not set by a user (refused); they mirror ``kl_coef`` and
    ``num_ppo_epochs``, so the rollout (which reads them) scores the reference and keeps the rollout as GRPO's."""

    num_generations: int = Field(1, ge=1)
    num_ppo_epochs: int = Field(4, ge=1)
    num_mini_batches: int = Field(1, ge=1, le=1)
    whiten_rewards: bool = False
    kl_coef: float = Field(0.05, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k1"
    cliprange: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.1, ge=0)
    cliprange_value: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    value_model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _ppo_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "value_model_path" in data:  # TRL's name
            data.setdefault("value_model", data.pop("value_model_path"))
        if data.get("num_mini_batches", 1) not in (1, None):
            raise key_errors(cls.__name__, [("num_mini_batches", "several optimizer steps per PPO epoch are not "
                                             "built yet: use 1 (gradient_accumulation_steps splits a batch "
                                             "for memory)", data["num_mini_batches"])])
        mirrored = {"beta": data.get("kl_coef", cls.model_fields["kl_coef"].default),
                    "num_iterations": data.get("num_ppo_epochs", cls.model_fields["num_ppo_epochs"].default)}
        given = [k for k in _NOT_PPO if k in data and data[k] != mirrored.get(k)
                 and data[k] != cls.model_fields[k].get_default(call_default_factory=True)]
        if given:
            raise key_errors(cls.__name__, [(k, f"{_NOT_PPO[k]}: drop {k}", data[k]) for k in given])
        return {**data, **mirrored}


def build_ppo_objective(o: PPOOptions) -> Any:
    """The :class:`~scaletrain.objectives.ppo.PPOObjective` of validated options."""
    from scaletrain.objectives.ppo import PPOObjective

    return PPOObjective(cliprange=o.cliprange, cliprange_value=o.cliprange_value, vf_coef=o.vf_coef,
                        temperature=o.temperature,
                        advantages=GAESpec(gamma=o.gamma, lam=o.lam, token_kl_coef=o.kl_coef,
                                           kl_estimator=o.kl_estimator, whiten_rewards=o.whiten_rewards))
