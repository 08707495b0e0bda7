"""``GRPOConfig``: ``TrainingArguments`` plus GRPO's options, under TRL's and EasyDeL's names.

Why the options sit in a field (``grpo``) rather than beside the training arguments: one name
means two things. TRL's ``GRPOConfig.epsilon`` is the clipping range (its Adam epsilon is
``adam_epsilon``), ours ``TrainingArguments.epsilon`` is Adam's. So here ``epsilon`` is taken as
TRL means it, the clip, and Adam's is ``adam_epsilon`` (translated as everywhere else); every
other GRPO name (``num_generations``, ``beta``, ``loss_type``, ``scale_rewards``,
``max_completion_length``, EasyDeL's ``num_return_sequences``, ...) goes to ``grpo`` too, and the
rest are training arguments with their usual table of other names (``max_steps``,
``per_device_train_batch_size``, ...).

Read and set like TRL's flat dataclass, as ``DPOConfig`` is: ``config.beta``,
``config.num_generations = 8`` reach ``config.grpo`` (a set is validated as at construction),
so the Python configs look alike. The one exception is the name the two mean differently:
``config.epsilon`` is the training argument (Adam's, which the optimizer reads), and the clip is
``config.grpo.epsilon``. Given beside a nested ``grpo`` (as ``model_dump()`` writes it), ``epsilon``
is that training argument too, so a config read back from its dump equals it.

``RLOOConfig`` (TRL's names: ``normalize_advantages``, ``reward_clip_range``, ...; ``config.rloo``) and
``ReinforcePPConfig`` (``config.reinforce_pp``) hold their options the same way (:class:`RLConfig`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from scaletrain.arguments import TrainingArguments
from scaletrain.objectives.distill_options import DistillationOptions, GKDOptions
from scaletrain.objectives.grpo_options import TRL_VLLM_OPTIONS, GRPOOptions
from scaletrain.objectives.ppo_options import PPOOptions
from scaletrain.objectives.rl_variant_options import ReinforcePPOptions, RLOOOptions


class RLConfig(TrainingArguments):
    """TrainingArguments with an RL objective's options in the field ``options_field`` (see the module docstring)."""

    options_field: ClassVar[str] = "grpo"
    options_model: ClassVar[type[GRPOOptions]] = GRPOOptions

    @classmethod
    def _names(cls) -> frozenset[str]:
        # TRL's vLLM options too: GRPOOptions says what they mean here (none is needed)
        return (frozenset(cls.options_model.model_fields) | {"num_return_sequences"} | TRL_VLLM_OPTIONS
                | getattr(cls.options_model, "other_names", frozenset()))

    @classmethod
    def _flat(cls) -> frozenset[str]:
        """The options read and set flat on the config (every one but ``epsilon``, a training argument there)."""
        return frozenset(cls.options_model.model_fields) - frozenset(TrainingArguments.model_fields)

    @model_validator(mode="wrap")
    @classmethod
    def _split(cls, data: Any, handler: Any) -> Any:
        # wrap: the objective's names leave before TrainingArguments reads the rest (and translates adam_epsilon)
        if isinstance(data, dict):
            data = dict(data)
            given = data.pop(cls.options_field, None)
            # beside a nested options field (a dump read back), ``epsilon`` is the training argument it sat beside
            names = cls._names() - {"epsilon"} if given is not None else cls._names()
            picked = {k: data.pop(k) for k in list(data) if k in names}
            if isinstance(given, BaseModel):
                given = given.model_dump()
            data[cls.options_field] = cls.options_model(**{**(given or {}), **picked})
        return handler(data)

    def rl_options(self) -> GRPOOptions:
        """The objective's options this config holds."""
        return getattr(self, self.options_field)

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._flat():  # only names that are not attributes of the config itself arrive here
            return getattr(self.rl_options(), name)
        return super().__getattr__(name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        if name in cls._flat():
            super().__setattr__(cls.options_field, cls.options_model(**{**self.rl_options().model_dump(),
                                                                         name: value}))
            return
        super().__setattr__(name, value)


class GRPOConfig(RLConfig):
    """TrainingArguments with the GRPO options in ``grpo`` (see the module docstring)."""

    grpo: GRPOOptions = Field(default_factory=GRPOOptions)


class RLOOConfig(RLConfig):
    """TrainingArguments with TRL's ``RLOOConfig`` options in ``rloo``."""

    options_field: ClassVar[str] = "rloo"
    options_model: ClassVar[type[GRPOOptions]] = RLOOOptions
    rloo: RLOOOptions = Field(default_factory=RLOOOptions)


class ReinforcePPConfig(RLConfig):
    """TrainingArguments with REINFORCE++'s options in ``reinforce_pp``."""

    options_field: ClassVar[str] = "reinforce_pp"
    options_model: ClassVar[type[GRPOOptions]] = ReinforcePPOptions
    reinforce_pp: ReinforcePPOptions = Field(default_factory=ReinforcePPOptions)


class PPOConfig(RLConfig):
    """TrainingArguments with the options of TRL's last ``PPOConfig`` in ``ppo`` (``num_ppo_epochs``, ``kl_coef``,
    ``cliprange``, ``vf_coef``, ``cliprange_value``, ``gamma``, ``lam``, ``whiten_rewards``, ``value_model`` ...)
    over GRPO's rollout options."""

    options_field: ClassVar[str] = "ppo"
    options_model: ClassVar[type[GRPOOptions]] = PPOOptions
    ppo: PPOOptions = Field(default_factory=PPOOptions)


class DistillationConfig(RLConfig):
    """TrainingArguments with TRL 1.16's ``DistillationConfig`` options in ``distillation`` (``beta``,
    ``temperature``, ``max_completion_length``, ``teacher_model_name_or_path`` ...)."""

    options_field: ClassVar[str] = "distillation"
    options_model: ClassVar[type[BaseModel]] = DistillationOptions
    distillation: DistillationOptions = Field(default_factory=DistillationOptions)


class GKDConfig(RLConfig):
    """TrainingArguments with TRL's ``GKDConfig`` options in ``gkd`` (``lmbda``, ``beta``, ``temperature``,
    ``max_new_tokens``, ``seq_kd``, ``teacher_model_name_or_path`` ...)."""

    options_field: ClassVar[str] = "gkd"
    options_model: ClassVar[type[BaseModel]] = GKDOptions
    gkd: GKDOptions = Field(default_factory=GKDOptions)
