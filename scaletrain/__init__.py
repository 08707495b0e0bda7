"""scaletrain: train language models in JAX, from one CPU to a Ray cluster.

Public names are imported lazily so that ``import scaletrain`` stays fast and the
CLI's ``--help`` does not pay for JAX start-up.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Trainer": "scaletrain.training.trainer",
    "BaseTrainer": "scaletrain.training.base",
    "BaseTrainerProtocol": "scaletrain.training.protocol",
    "TrainerOutput": "scaletrain.training.protocol",
    "TrainState": "scaletrain.training.state",
    "Callback": "scaletrain.training.callbacks",
    "TrainingArguments": "scaletrain.arguments",
    "PartitionAxis": "scaletrain.parallel.partition",
    "AttentionMechanisms": "scaletrain.compat.easydel.enums",
    "EasyDeLGradientCheckPointers": "scaletrain.compat.easydel.enums",
    "create_mesh": "scaletrain.parallel.mesh",
    "TaskType": "scaletrain.compat.easydel.enums",
    "get_modules_by_type": "scaletrain.models.registry",
    "DecoderConfig": "scaletrain.models.common.config",
    "create_sharded_model": "scaletrain.models.factory",
    "AutoModelForCausalLM": "scaletrain.models.registry",
    "AutoModelForSequenceClassification": "scaletrain.models.registry",
    "load_hf_checkpoint": "scaletrain.models.hf",
    "save_hf_checkpoint": "scaletrain.models.hf",
    "generate": "scaletrain.generation",
    "Recipe": "scaletrain.recipe",
    "PreferenceTrainer": "scaletrain.preference.trainer",
    "DPOConfig": "scaletrain.preference.api",
    "DPOTrainer": "scaletrain.preference.api",
    "ORPOConfig": "scaletrain.preference.api",
    "ORPOTrainer": "scaletrain.preference.api",
    "CPOConfig": "scaletrain.preference.api",
    "CPOTrainer": "scaletrain.preference.api",
    "KTOConfig": "scaletrain.preference.api",
    "KTOTrainer": "scaletrain.preference.api",
    "RewardConfig": "scaletrain.preference.api",
    "RewardTrainer": "scaletrain.preference.api",
    "GRPOConfig": "scaletrain.rl.config",
    "GRPOTrainer": "scaletrain.rl.trainer",
    "RLOOConfig": "scaletrain.rl.config",
    "PPOConfig": "scaletrain.rl.config",
    "PPOTrainer": "scaletrain.rl.ppo",
    "RLOOTrainer": "scaletrain.rl.variants",
    "ReinforcePPConfig": "scaletrain.rl.config",
    "ReinforcePPTrainer": "scaletrain.rl.variants",
    "DistillationConfig": "scaletrain.rl.config",
    "DistillationTrainer": "scaletrain.rl.distill",
    "GKDConfig": "scaletrain.rl.config",
    "GKDTrainer": "scaletrain.rl.distill",
    "DPOObjective": "scaletrain.objectives.dpo",
    "ORPOObjective": "scaletrain.objectives.orpo",
    "CPOObjective": "scaletrain.objectives.orpo",
    "KTOObjective": "scaletrain.objectives.kto",
    "RayDistributedTrainer": "scaletrain.compat.easydel.ray_trainer",
    "RayDistributedConfig": "scaletrain.compat.easydel.ray_config",
    "ScaletrainError": "scaletrain.errors",
    "ConfigError": "scaletrain.errors",
    "DataError": "scaletrain.errors",
    "CheckpointError": "scaletrain.errors",
}

__all__ = sorted(_EXPORTS)




def _family_class(name: str) -> object:
    """A registered family's config or module class (``scaletrain.Qwen3Config``): found through the model
    registry, so a new family's folder is all it takes; imports the models on first use only."""
    import importlib

    # by name, as _EXPORTS are: the root package sits below everything it re-exports
    importlib.import_module("scaletrain.models")  # fills the registry
    return importlib.import_module("scaletrain.models.common.family").family_classes().get(name)


__getattr__, __dir__ = lazy_exports("scaletrain", _EXPORTS, globals(), fallback=_family_class)
