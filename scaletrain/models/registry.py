"""``(model_type, TaskType) -> (config class, module class)``, as EasyDeL's RayDistributedTrainer
uses it, and ``AutoModelForCausalLM``, which reads that map for a Hugging Face folder's model_type.

The loader itself (:mod:`scaletrain.models.hf`) takes the module class as an
argument, so the registry sits above every model family and the loader below them.
"""

from __future__ import annotations

import os
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from scaletrain.errors import ConfigError
from scaletrain.models.config import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from scaletrain.models.gemma3 import Gemma3ForCausalLM, Gemma3TextModel
from scaletrain.models.gemma3_config import Gemma3TextConfig
from scaletrain.models.hf import load_hf_checkpoint
from scaletrain.models.hf_config import CONFIG_FILE, read_hf_config, supported_model_type
from scaletrain.models.llama import (
    LlamaForCausalLM,
    LlamaModel,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from scaletrain.models.moe_config import MixtralConfig, Qwen3MoeConfig
from scaletrain.models.moe_decoder import MixtralForCausalLM, Qwen3MoeForCausalLM
from scaletrain.models.task import TaskType
from scaletrain.parallel.partition import PartitionAxis

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


def model_class_identity(model_class: type) -> tuple[str, TaskType]:
    """``(model_type, task)`` of a module class: its ``_model_type`` / ``_model_task``, else its registry entry.

    EasyDeL reads the two class attributes directly, so a class without them failed
    with a bare ``AttributeError``; here a registered class needs neither, and any
    other class gets a ConfigError that names it and says what to add.
    """
    name = getattr(model_class, "__qualname__", repr(model_class))
    model_type = getattr(model_class, "_model_type", None)
    task = getattr(model_class, "_model_task", None)
    if model_type is None or task is None:
        entries = [key for key, (_, cls) in _REGISTRY.items() if cls is model_class]
        if not entries:
            raise ConfigError(
                f"model_class {name} has no _model_type/_model_task and is not registered: give it class "
                "attributes `_model_type = \"...\"` and `_model_task = TaskType....`, or call "
                "scaletrain.models.register_module(model_type, task, config_class, module_class)"
            )
        model_type, task = entries[0]
    try:
        return model_type, TaskType(task)
    except ValueError:
        raise ConfigError(f"model_class {name} has _model_task={task!r}; known tasks: "
                          f"{[t.value for t in TaskType]}") from None


register_module("llama", TaskType.CAUSAL_LM, LlamaConfig, LlamaForCausalLM)
register_module("llama", TaskType.BASE_MODULE, LlamaConfig, LlamaModel)
register_module("mistral", TaskType.CAUSAL_LM, MistralConfig, MistralForCausalLM)
register_module("qwen2", TaskType.CAUSAL_LM, Qwen2Config, Qwen2ForCausalLM)
register_module("qwen3", TaskType.CAUSAL_LM, Qwen3Config, Qwen3ForCausalLM)
register_module("gemma3_text", TaskType.CAUSAL_LM, Gemma3TextConfig, Gemma3ForCausalLM)
register_module("gemma3_text", TaskType.BASE_MODULE, Gemma3TextConfig, Gemma3TextModel)
register_module("mixtral", TaskType.CAUSAL_LM, MixtralConfig, MixtralForCausalLM)
register_module("qwen3_moe", TaskType.CAUSAL_LM, Qwen3MoeConfig, Qwen3MoeForCausalLM)


class AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained(local_dir)`` picks the class from config.json's model_type."""

    def __init__(self) -> None:
        raise TypeError("use AutoModelForCausalLM.from_pretrained(local_dir)")

    @staticmethod
    def from_pretrained(
        local_dir: str | os.PathLike,
        *,
        dtype: Any = "float32",
        param_dtype: Any = "float32",
        mesh: Mesh | None = None,
        sharding_axis_dims: tuple[int, ...] | None = None,
        partition_axis: PartitionAxis | dict[str, Any] | None = None,
        precision: Any = None,
        scan_layers: bool = False,
    ) -> nnx.Module:
        """Load a local HF folder (no hub access) as the class registered for its model_type;
        see :func:`scaletrain.models.hf.load_hf_checkpoint`."""
        where = os.path.join(os.fspath(local_dir), CONFIG_FILE)
        model_type = supported_model_type(read_hf_config(local_dir), where)
        _, module_class = get_modules_by_type(model_type, TaskType.CAUSAL_LM)
        return load_hf_checkpoint(
            local_dir,
            module_class,
            dtype=dtype,
            param_dtype=param_dtype,
            mesh=mesh,
            sharding_axis_dims=sharding_axis_dims,
            partition_axis=partition_axis,
            precision=precision,
            scan_layers=scan_layers,
        )
