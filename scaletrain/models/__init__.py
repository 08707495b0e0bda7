"""Model configs, modules and the (model_type, task) registry.

Importing this package imports every family package (``models/<family>/``), whose
``register(...)`` call fills the registry and the config.json tables: a new family is
one folder and one import line here.
"""

from scaletrain.models.llama.config import LlamaConfig
from scaletrain.models.factory import create_sharded_model, mesh_for_config
from scaletrain.models.gemma3 import Gemma3ForCausalLM, Gemma3TextConfig
from scaletrain.models.llama import LlamaForCausalLM
from scaletrain.models.mistral import MistralConfig, MistralForCausalLM
from scaletrain.models.mixtral import MixtralConfig, MixtralForCausalLM
from scaletrain.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from scaletrain.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from scaletrain.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from scaletrain.models.registry import get_modules_by_type, register_module, registered_model_types
from scaletrain.models.task import TaskType

__all__ = [
    "Gemma3ForCausalLM",
    "Gemma3TextConfig",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MistralConfig",
    "MistralForCausalLM",
    "MixtralConfig",
    "MixtralForCausalLM",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "TaskType",
    "create_sharded_model",
    "get_modules_by_type",
    "mesh_for_config",
    "register_module",
    "registered_model_types",
]
