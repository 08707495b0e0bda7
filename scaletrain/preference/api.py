"""``DPOConfig`` / ``DPOTrainer`` and ORPO's, CPO's (SimPO's) and KTO's: TRL's and EasyDeL's entry points.

Why these classes: a TRL or EasyDeL user should change only the import line. Each config is
``TrainingArguments`` plus the objective's options under TRL's names (``beta``, ``loss_type``,
``label_smoothing``, ``simpo_gamma``, ``cpo_alpha``, ``desirable_weight``, ...), so the
other arguments keep their table of other names (``per_device_train_batch_size`` is answered,
``max_steps`` is ``max_training_steps``, ...). Each trainer accepts TRL's argument names
(``args``, ``ref_model``, ``train_dataset``, ``eval_dataset``, ``processing_class``,
``peft_config``) and EasyDeL's (``arguments``, ``reference_model``) besides ours (``dataset_train``,
``tokenizer``), and what TRL accepts for them (``scaletrain.training.trl_inputs``): ``model`` as a
model folder (its tokenizer read too; ``args`` then defaults to ``<model name>-DPO``), a
``peft.LoraConfig``, and datasets of text in TRL's formats (a ``datasets.Dataset``, a list of
dicts or a file) tokenized by the recipe's data kinds. It runs
:class:`~scaletrain.preference.trainer.PreferenceTrainer` with the objective built by the
registry from the config, so Python and recipes build the same objective.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.arguments import TrainingArguments
from scaletrain.errors import ConfigError
from scaletrain.objectives.registry import (
    CPOOptions,
    DPOOptions,
    KTOOptions,
    ORPOOptions,
    RewardOptions,
    build_objective,
)
from scaletrain.preference.trainer import PreferenceTrainer
from scaletrain.training.trl_inputs import (
    ArgumentNames,
    default_arguments,
    model_from,
    preference_rows,
    tokenizer_from,
    with_peft_config,
)


class DPOConfig(TrainingArguments, DPOOptions):
    """TrainingArguments plus DPO's options (TRL's ``DPOConfig`` names)."""


class ORPOConfig(TrainingArguments, ORPOOptions):
    """TrainingArguments plus ORPO's ``beta`` (TRL's λ)."""


class CPOConfig(TrainingArguments, CPOOptions):
    """TrainingArguments plus CPO's options; ``loss_type="simpo"`` is SimPO (set ``cpo_alpha=0`` for pure SimPO)."""


class KTOConfig(TrainingArguments, KTOOptions):
    """TrainingArguments plus KTO's options (``desirable_weight`` / ``undesirable_weight``)."""


class RewardConfig(TrainingArguments, RewardOptions):
    """TrainingArguments plus TRL's ``RewardConfig`` option ``center_rewards_coefficient``."""


class _PreferenceTrainerBase(PreferenceTrainer):
    """A ``PreferenceTrainer`` built from a config of ``config_class`` and the objective registered as ``kind``."""

    kind: str
    config_class: type[TrainingArguments]
    reads_reference: bool = True
    data_kind: str = "preference"  # the recipe's data kind that prepares TRL-format rows for this trainer
    preparation: str = "trl_dpo"  # whose row preparation: TRL's DPO/KTO trainers', or its ORPO/CPO trainers'
    score_head: bool = False  # the model is a score-head model (a reward model), not a causal LM

    def __init__(self, model: Any = None, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, data_collator: Any = None,
                 peft_config: Any = None, **kwargs: Any):
        who = type(self).__name__
        named = {"model": model, "ref_model": ref_model, "args": args, "train_dataset": train_dataset,
                 "eval_dataset": eval_dataset, "processing_class": processing_class, **kwargs}
        pick = ArgumentNames(named)
        arguments, model = pick("args", "arguments"), pick("model")
        if arguments is None and isinstance(model, (str, os.PathLike)):  # TRL's default: "<model name>-DPO"
            arguments = default_arguments(self.config_class, model, self.kind.upper())
        if arguments is None:
            raise ConfigError(f"{who} needs args= (a {self.config_class.__name__})")
        if not isinstance(arguments, self.config_class):
            raise ConfigError(f"{who}(args=...) takes a {self.config_class.__name__}, got "
                              f"{type(arguments).__name__}")
        reference = pick("ref_model", "reference_model")
        if reference is not None and not self.reads_reference:
            raise ConfigError(f"{who} reads no reference model; drop ref_model")
        options = {k: getattr(arguments, k) for k in self.config_class.model_fields
                   if k not in TrainingArguments.model_fields}
        objective = build_objective(self.kind, options)  # a bad option is refused before any model or data is read
        extra: dict[str, Any] = {}
        if self.reads_reference:
            reference = reference if reference is not None else options.get("reference")
            extra = {"reference": reference, "precompute_ref_log_probs": options.get("precompute_ref_log_probs")}
        model, folder = model_from(model, arguments, who, self.score_head)
        tokenizer = tokenizer_from(pick("processing_class", "tokenizer"), folder)
        arguments = with_peft_config(arguments, peft_config, model, folder, who)
        train, evals = preference_rows(pick("train_dataset", "dataset_train"), pick("eval_dataset", "dataset_eval"),
                                       tokenizer, arguments, kind=self.data_kind, preparation=self.preparation, who=who)
        super().__init__(
            arguments, model=model, objective=objective, dataset_train=train, dataset_eval=evals,
            tokenizer=tokenizer, data_collator=data_collator, **extra, **pick.rest(),
        )


class DPOTrainer(_PreferenceTrainerBase):
    """DPO (and IPO, hinge, ... by ``loss_type``) with TRL's and EasyDeL's argument names."""

    kind = "dpo"
    config_class = DPOConfig


class ORPOTrainer(_PreferenceTrainerBase):
    """ORPO (no reference model) with TRL's and EasyDeL's argument names."""

    kind = "orpo"
    config_class = ORPOConfig
    reads_reference = False
    preparation = "trl_orpo"


class CPOTrainer(_PreferenceTrainerBase):
    """CPO, and SimPO with ``CPOConfig(loss_type="simpo")`` (no reference model)."""

    kind = "cpo"
    config_class = CPOConfig
    reads_reference = False
    preparation = "trl_orpo"


class KTOTrainer(_PreferenceTrainerBase):
    """KTO over unpaired rows with TRL's and EasyDeL's argument names."""

    kind = "kto"
    config_class = KTOConfig
    data_kind = "unpaired_preference"


class RewardTrainer(_PreferenceTrainerBase):
    """A reward model (Bradley-Terry, TRL's ``RewardTrainer``) over pairs; ``model`` as a folder loads with a
    score head (a causal LM's folder gets a new one, as TRL's does)."""

    kind = "reward"
    config_class = RewardConfig
    reads_reference = False
    score_head = True
