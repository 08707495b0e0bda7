"""The objectives a recipe's ``objective:`` section can name, each with its options under TRL's names.

Why a registry: the recipe, the Python configs (``DPOConfig`` ...) and the run wiring all go
from a name (``type: dpo``) to the same three things: the options it accepts (a pydantic
model, so every bad value is reported naming ``objective.<field>``), how to build the
:class:`~scaletrain.objectives.Objective` from them, and which data kind its batches come
from. A new objective (GRPO) is one :func:`register_objective` call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scaletrain.errors import ConfigError
from scaletrain.models.task import CAUSAL_LM, SEQUENCE_CLASSIFICATION


@dataclasses.dataclass(frozen=True)
class ObjectiveType:
    """A registered objective: its ``options`` model, ``build(options) -> Objective | None`` (None: the trainer's
    default language-model loss) and the ``data_kind`` whose rows it reads (None: any)."""

    name: str
    options: type[BaseModel]
    build: Callable[[Any], Any]
    data_kind: str | None = None
    #: options the trainer reads (the reference model), not the objective
    trainer_options: tuple[str, ...] = ()
    #: whether it runs under a trainer of its own, which the package of its family (a layer above this one)
    #: registers with :func:`register_trainer` when it is imported; False: ``Trainer``
    own_trainer: bool = False
    #: how its preference rows are prepared by default (``data.preparation``): as the TRL trainer of the same
    #: name prepares them, so a run's first step equals TRL's with no extra option (None: not preference rows)
    preparation: str | None = None
    #: the model it trains: a causal LM, or a score-head model (``sequence-classification``: reward models)
    model_task: str = CAUSAL_LM
    #: its model carries a value head (``score``) beside the language-model head (PPO): checkpoints hold it
    value_head: bool = False


_REGISTRY: dict[str, ObjectiveType] = {}
_TRAINERS: dict[str, type] = {}


def register_objective(kind: ObjectiveType) -> ObjectiveType:
    """Make ``kind.name`` a valid ``objective.type``; registering a name twice is a programming error."""
    if kind.name in _REGISTRY:
        raise ValueError(f"objective type {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def register_trainer(trainer: type, *kinds: str) -> type:
    """Make ``trainer`` the class that runs each objective type of ``kinds``: called by the package that defines
    it (``scaletrain.preference``, ``scaletrain.rl``), so this table names classes, not import paths, and every
    import arrow stays visible. Registering another class for a kind is a programming error."""
    for kind in kinds:
        if not get_objective_type(kind).own_trainer:
            raise ValueError(f"objective type {kind!r} runs under Trainer; register it with own_trainer=True")
        if _TRAINERS.get(kind, trainer) is not trainer:
            raise ValueError(f"objective type {kind!r} already runs under {_TRAINERS[kind].__name__}")
        _TRAINERS[kind] = trainer
    return trainer


def trainer_class(kind: str) -> type | None:
    """The trainer class of ``kind`` (None: ``Trainer``). The caller imports the family packages first
    (``run.objective_trainer``); a type whose trainer no imported package registered is a programming error."""
    if not get_objective_type(kind).own_trainer:
        return None
    if kind not in _TRAINERS:
        raise RuntimeError(f"objective type {kind!r} runs under its own trainer, but no imported package registered "
                           "one (register_trainer); import its family's trainer module first")
    return _TRAINERS[kind]


def objective_types() -> list[str]:
    return sorted(_REGISTRY)


def get_objective_type(name: str) -> ObjectiveType:
    if name not in _REGISTRY:
        raise ConfigError(f"objective.type={name!r} is not one of {objective_types()}")
    return _REGISTRY[name]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LMOptions(_Options):
    """The language-model loss takes its options from ``training`` (``z_loss``, ``loss_chunk_size``)."""


class _ReferenceOptions(_Options):
    """Where the reference log-probabilities come from (see ``training/frozen.py``)."""

    reference: str | None = None  # a model folder; unset: a copy of the starting policy, or LoRA adapters off
    precompute_ref_log_probs: bool = False


class DPOOptions(_ReferenceOptions):
    beta: float = Field(0.1, gt=0)
    loss_type: list[str] = Field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] | None = None
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    discopop_tau: float = Field(0.05, gt=0)

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class ORPOOptions(_Options):
    beta: float = Field(0.1, gt=0)


class CPOOptions(_Options):
    beta: float = Field(0.1, gt=0)
    loss_type: str = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    simpo_gamma: float = 0.5
    cpo_alpha: float = Field(1.0, ge=0)


class SimPOOptions(_Options):
    """SimPO is CPO's ``loss_type="simpo"``; without the NLL term unless ``cpo_alpha`` is set (CPO-SimPO)."""

    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    simpo_gamma: float = 0.5
    cpo_alpha: float = Field(0.0, ge=0)


class KTOOptions(_ReferenceOptions):
    beta: float = Field(0.1, gt=0)
    loss_type: str = "kto"
    desirable_weight: float = Field(1.0, ge=0)
    undesirable_weight: float = Field(1.0, ge=0)


class RewardOptions(_Options):
    """TRL's ``RewardConfig`` option: the weight of the centring term ``(r_c + r_r)²`` (None: none)."""

    center_rewards_coefficient: float | None = Field(None, ge=0)


def _objective_fields(options: BaseModel, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in options.model_dump().items() if k in names}


def _dpo(o: DPOOptions) -> Any:
    from scaletrain.objectives.dpo import DPOObjective

    kw = _objective_fields(o, DPOObjective)
    kw["loss_type"] = tuple(kw["loss_type"])
    kw["loss_weights"] = None if kw["loss_weights"] is None else tuple(kw["loss_weights"])
    return DPOObjective(**kw)


def _orpo(o: ORPOOptions) -> Any:
    from scaletrain.objectives.orpo import ORPOObjective

    return ORPOObjective(**_objective_fields(o, ORPOObjective))


def _cpo(o: CPOOptions) -> Any:
    from scaletrain.objectives.orpo import CPOObjective

    return CPOObjective(**_objective_fields(o, CPOObjective))


def _simpo(o: SimPOOptions) -> Any:
    from scaletrain.objectives.orpo import CPOObjective

    return CPOObjective(loss_type="simpo", **_objective_fields(o, CPOObjective))


def _kto(o: KTOOptions) -> Any:
    from scaletrain.objectives.kto import KTOObjective

    return KTOObjective(**_objective_fields(o, KTOObjective))


def _reward(o: RewardOptions) -> Any:
    from scaletrain.objectives.reward import RewardObjective

    return RewardObjective(**_objective_fields(o, RewardObjective))


_REFERENCE = ("reference", "precompute_ref_log_probs")
_OWN_TRAINER = True  # PreferenceTrainer: scaletrain.preference.trainer registers it for these types
register_objective(ObjectiveType("lm", LMOptions, lambda o: None))
# TRL 1.16's DPOTrainer and KTOTrainer tokenize prompt and completion apart (trl_dpo); its ORPOTrainer and
# CPOTrainer (SimPO is CPO's loss_type) keep the older preparation, bos before the prompt (trl_orpo)
register_objective(ObjectiveType("dpo", DPOOptions, _dpo, "preference", _REFERENCE, _OWN_TRAINER, "trl_dpo"))
register_objective(ObjectiveType("orpo", ORPOOptions, _orpo, "preference", (), _OWN_TRAINER, "trl_orpo"))
register_objective(ObjectiveType("cpo", CPOOptions, _cpo, "preference", (), _OWN_TRAINER, "trl_orpo"))
register_objective(ObjectiveType("simpo", SimPOOptions, _simpo, "preference", (), _OWN_TRAINER, "trl_orpo"))
register_objective(ObjectiveType("kto", KTOOptions, _kto, "unpaired_preference", _REFERENCE, _OWN_TRAINER,
                                 "trl_dpo"))

# TRL 1.16's RewardTrainer tokenizes prompt + completion whole, as its DPOTrainer's full sequences; the score head
# reads the last token (scaletrain.reward registers RewardTrainer)
register_objective(ObjectiveType("reward", RewardOptions, _reward, "preference", (), _OWN_TRAINER, "trl_dpo",
                                 SEQUENCE_CLASSIFICATION))


def _register_grpo() -> None:
    from scaletrain.objectives.grpo_options import TRAINER_OPTIONS, GRPOOptions, build_grpo_objective
    from scaletrain.objectives.rl_variant_options import (
        ReinforcePPOptions,
        RLOOOptions,
        build_reinforce_pp_objective,
        build_rloo_objective,
    )

    register_objective(ObjectiveType("grpo", GRPOOptions, build_grpo_objective, "prompt", TRAINER_OPTIONS,
                                     own_trainer=True))  # scaletrain.rl.trainer registers GRPOTrainer
    # GRPO's variants: the same rollout and trainer, another advantage estimator (and, for RLOO, loss);
    # scaletrain.rl.variants registers their trainers
    register_objective(ObjectiveType("rloo", RLOOOptions, build_rloo_objective, "prompt",
                                     tuple(RLOOOptions.model_fields), own_trainer=True))
    register_objective(ObjectiveType("reinforce_pp", ReinforcePPOptions, build_reinforce_pp_objective, "prompt",
                                     tuple(ReinforcePPOptions.model_fields), own_trainer=True))


_register_grpo()


def _register_ppo() -> None:
    from scaletrain.objectives.ppo_options import PPOOptions, build_ppo_objective

    # GRPO's rollout with a value head and GAE; scaletrain.rl.ppo registers its trainer
    register_objective(ObjectiveType("ppo", PPOOptions, build_ppo_objective, "prompt",
                                     tuple(PPOOptions.model_fields), own_trainer=True, value_head=True))


_register_ppo()


def _register_distillation() -> None:
    from scaletrain.objectives.distill_options import (
        DistillationOptions,
        GKDOptions,
        build_distillation_objective,
        build_gkd_objective,
    )

    # the student samples through GRPO's rollout machinery; scaletrain.rl.distill registers their trainers
    register_objective(ObjectiveType("distillation", DistillationOptions, build_distillation_objective, "prompt",
                                     tuple(DistillationOptions.model_fields), own_trainer=True))
    register_objective(ObjectiveType("gkd", GKDOptions, build_gkd_objective, "prompt",
                                     tuple(GKDOptions.model_fields), own_trainer=True))


_register_distillation()


def validate_options(kind: str, options: dict[str, Any] | BaseModel) -> BaseModel:
    """``options`` validated by ``kind``'s options model; ConfigError naming ``objective.<field>``."""
    from pydantic import ValidationError

    from scaletrain.config_keys import format_validation_error

    spec = get_objective_type(kind)
    if isinstance(options, spec.options):
        return options
    try:
        return spec.options.model_validate(dict(options))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, "objective", spec.options)) from None


def build_objective(kind: str, options: dict[str, Any] | BaseModel) -> Any:
    """The objective of ``kind`` with ``options`` (validated); ConfigError naming ``objective.<field>``."""
    return get_objective_type(kind).build(validate_options(kind, options))


def trainer_setup(kind: str, options: dict[str, Any] | BaseModel) -> tuple[type | None, dict[str, Any]]:
    """``(trainer class or None, keyword arguments: the objective and the trainer's options)`` for a run of
    ``kind`` (:func:`trainer_class`); ``(None, {})`` for the default language-model loss."""
    spec = get_objective_type(kind)
    valid = validate_options(kind, options)
    objective = spec.build(valid)
    if objective is None:
        return trainer_class(kind), {}
    return trainer_class(kind), {"objective": objective,
                                 **{name: getattr(valid, name) for name in spec.trainer_options}}
