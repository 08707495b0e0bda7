"""Where a family registers itself: ``register(...)``, called once in its package, is the only place
its ``model_type`` is tied to its classes and its config.json mapping.

Why a registry below the families: the lookup by ``(model_type, task)``
(:mod:`scaletrain.models.registry`), the config.json reader and writer
(:mod:`scaletrain.models.hf_config`) and the list of supported types all read the
tables here, so a new family is one folder and one call, with no list to extend
elsewhere. :mod:`scaletrain.models` imports every family package, so the tables are
full wherever a model module is used.
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.hf_family import HFFamily
from scaletrain.models.task import TaskType

#: ``(model_type, task) -> (config class, module class)``
MODULES: dict[tuple[str, TaskType], tuple[type, type]] = {}
#: HF ``model_type`` -> its config.json mapping
FAMILIES: dict[str, HFFamily] = {}
#: HF ``model_type`` -> the HF architecture class name
ARCHITECTURES: dict[str, str] = {}


def register_module(model_type: str, task_type: TaskType, config_class: type, module_class: type) -> None:
    """Register a module class (and its config class) for a model type and task."""
    MODULES[(model_type, TaskType(task_type))] = (config_class, module_class)


def register(hf: HFFamily, causal_lm: type, base_module: type | None = None) -> None:
    """Register a family: its config.json mapping ``hf`` (which names the config class, whose
    ``model_type`` is the family's) and its causal LM (and base module, where EasyDeL names one)."""
    model_type = hf.model_type
    for module in (causal_lm, base_module):
        if module is not None and module.config_class is not hf.config_class:
            raise TypeError(f"{module.__qualname__}.config_class is not {hf.config_class.__qualname__}")
    FAMILIES[model_type] = hf
    ARCHITECTURES[model_type] = hf.architecture
    register_module(model_type, TaskType.CAUSAL_LM, hf.config_class, causal_lm)
    if base_module is not None:
        register_module(model_type, TaskType.BASE_MODULE, hf.config_class, base_module)


def get_modules_by_type(model_type: str, task_type: TaskType | str = TaskType.CAUSAL_LM) -> tuple[type, type]:
    """The ``(config_class, module_class)`` registered for ``model_type`` and ``task_type``."""
    try:
        key = (model_type, TaskType(task_type))
    except ValueError:
        raise ConfigError(f"unknown task_type {task_type!r}; known: {[t.value for t in TaskType]}") from None
    if key not in MODULES:
        known = sorted({f"{m}/{t.value}" for m, t in MODULES})
        raise ConfigError(f"unknown model_type/task {model_type!r}/{key[1].value}; registered: {known}")
    return MODULES[key]


def registered_model_types() -> list[str]:
    return sorted({m for m, _ in MODULES})


def registered_module_types(module_class: type) -> list[tuple[str, TaskType]]:
    """Every ``(model_type, task)`` ``module_class`` is registered under."""
    return [key for key, (_, cls) in MODULES.items() if cls is module_class]


__all__: list[Any] = ["ARCHITECTURES", "FAMILIES", "MODULES", "get_modules_by_type", "register", "register_module",
                      "registered_model_types", "registered_module_types"]
