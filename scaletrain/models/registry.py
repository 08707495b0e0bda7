"""``(model_type, TaskType) -> (config class, module class)``, as seed 000 uses it."""

from __future__ import annotations

from scaletrain.errors import ConfigError
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config
from scaletrain.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from scaletrain.models.task import TaskType

_REGISTRY: dict[tuple[str, TaskType], tuple[type, type]] = {}


def register_module(model_type: str, task_type: TaskType, config_class: type, module_class: type) -> None:
    """Register a module class (and its config class) for a model type and task."""
    _REGISTRY[(model_type, TaskType(task_type))] = (config_class, module_class)


def get_modules_by_type(model_type: str, task_type: TaskType | str = TaskType.CAUSAL_LM) -> tuple[type, type]:
    """The ``(config_class, module_class)`` registered for ``model_type`` and ``task_type``."""
    try:
        key = (model_type, TaskType(task_type))
    except ValueError:
        raise ConfigError(f"unknown task_type {task_type!r}; known: {[t.value for t in TaskType]}") from None
    if key not in _REGISTRY:
        known = sorted({f"{m}/{t.value}" for m, t in _REGISTRY})
        raise ConfigError(f"unknown model_type/task {model_type!r}/{key[1].value}; registered: {known}")
    return _REGISTRY[key]


def registered_model_types() -> list[str]:
    return sorted({m for m, _ in _REGISTRY})


register_module("llama", TaskType.CAUSAL_LM, LlamaConfig, LlamaForCausalLM)
register_module("mistral", TaskType.CAUSAL_LM, MistralConfig, MistralForCausalLM)
register_module("qwen2", TaskType.CAUSAL_LM, Qwen2Config, Qwen2ForCausalLM)
