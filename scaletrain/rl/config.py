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
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from scaletrain.arguments import TrainingArguments
from scaletrain.objectives.grpo_options import TRL_VLLM_OPTIONS, GRPOOptions

# TRL's vLLM options too: GRPOOptions says what they mean here (none is needed)
_GRPO_NAMES = frozenset(GRPOOptions.model_fields) | {"num_return_sequences"} | TRL_VLLM_OPTIONS
#: the options read and set flat on the config (every one but ``epsilon``, a training argument there)
_FLAT = frozenset(GRPOOptions.model_fields) - frozenset(TrainingArguments.model_fields)


class GRPOConfig(TrainingArguments):
    """TrainingArguments with the GRPO options in ``grpo`` (see the module docstring)."""

    grpo: GRPOOptions = Field(default_factory=GRPOOptions)

    @model_validator(mode="wrap")
    @classmethod
    def _split(cls, data: Any, handler: Any) -> Any:
        # wrap: the GRPO names leave before TrainingArguments reads the rest (and translates adam_epsilon)
        if isinstance(data, dict):
            data = dict(data)
            given = data.pop("grpo", None)
            # beside a nested ``grpo`` (a dump read back), ``epsilon`` is the training argument it sat beside
            names = _GRPO_NAMES - {"epsilon"} if given is not None else _GRPO_NAMES
            picked = {k: data.pop(k) for k in list(data) if k in names}
            if isinstance(given, GRPOOptions):
                given = given.model_dump()
            data["grpo"] = GRPOOptions(**{**(given or {}), **picked})
        return handler(data)

    def __getattr__(self, name: str) -> Any:
        if name in _FLAT:  # only names that are not attributes of the config itself arrive here
            return getattr(self.grpo, name)
        return super().__getattr__(name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FLAT:
            super().__setattr__("grpo", GRPOOptions(**{**self.grpo.model_dump(), name: value}))
            return
        super().__setattr__(name, value)
