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
    "AttentionMechanisms": "scaletrain.models.options",
    "EasyDeLGradientCheckPointers": "scaletrain.models.options",
    "create_mesh": "scaletrain.parallel.mesh",
    "TaskType": "scaletrain.models.task",
    "get_modules_by_type": "scaletrain.models.registry",
    "LlamaConfig": "scaletrain.models.llama",
    "DecoderConfig": "scaletrain.models.common.config",
    "MistralConfig": "scaletrain.models.mistral",
    "Qwen2Config": "scaletrain.models.qwen2",
    "Qwen3Config": "scaletrain.models.qwen3",
    "LlamaForCausalLM": "scaletrain.models.llama",
    "MistralForCausalLM": "scaletrain.models.mistral",
    "Qwen2ForCausalLM": "scaletrain.models.qwen2",
    "Qwen3ForCausalLM": "scaletrain.models.qwen3",
    "Gemma3TextConfig": "scaletrain.models.gemma3",
    "Gemma3ForCausalLM": "scaletrain.models.gemma3",
    "MixtralConfig": "scaletrain.models.mixtral",
    "Qwen3MoeConfig": "scaletrain.models.qwen3_moe",
    "MixtralForCausalLM": "scaletrain.models.mixtral",
    "Qwen3MoeForCausalLM": "scaletrain.models.qwen3_moe",
    "create_sharded_model": "scaletrain.models.factory",
    "AutoModelForCausalLM": "scaletrain.models.registry",
    "load_hf_checkpoint": "scaletrain.models.hf",
    "save_hf_checkpoint": "scaletrain.models.hf",
    "generate": "scaletrain.generation",
    "Recipe": "scaletrain.recipe",
    "PreferenceTrainer": "scaletrain.training.preference",
    "DPOConfig": "scaletrain.training.preference_api",
    "DPOTrainer": "scaletrain.training.preference_api",
    "ORPOConfig": "scaletrain.training.preference_api",
    "ORPOTrainer": "scaletrain.training.preference_api",
    "CPOConfig": "scaletrain.training.preference_api",
    "CPOTrainer": "scaletrain.training.preference_api",
    "KTOConfig": "scaletrain.training.preference_api",
    "KTOTrainer": "scaletrain.training.preference_api",
    "GRPOConfig": "scaletrain.rl.config",
    "GRPOTrainer": "scaletrain.rl.trainer",
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


__getattr__, __dir__ = lazy_exports('scaletrain', _EXPORTS, globals())
