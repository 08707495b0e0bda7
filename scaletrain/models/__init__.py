"""Model configs, modules and the (model_type, task) registry."""

from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from scaletrain.models.factory import create_sharded_model, mesh_for_config
from scaletrain.models.gemma3 import Gemma3ForCausalLM
from scaletrain.models.gemma3_config import Gemma3TextConfig
from scaletrain.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from scaletrain.models.registry import get_modules_by_type, register_module, registered_model_types
from scaletrain.models.task import TaskType

__all__ = [
    "Gemma3ForCausalLM",
    "Gemma3TextConfig",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MistralConfig",
    "MistralForCausalLM",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "TaskType",
    "create_sharded_model",
    "get_modules_by_type",
    "mesh_for_config",
    "register_module",
    "registered_model_types",
]
