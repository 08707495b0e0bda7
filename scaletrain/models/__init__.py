"""Model configs, modules and the (model_type, task) registry."""

from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config
from scaletrain.models.factory import create_sharded_model, mesh_for_config
from scaletrain.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from scaletrain.models.registry import get_modules_by_type, register_module, registered_model_types
from scaletrain.models.task import TaskType

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "MistralConfig",
    "MistralForCausalLM",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "TaskType",
    "create_sharded_model",
    "get_modules_by_type",
    "mesh_for_config",
    "register_module",
    "registered_model_types",
]
