"""``(model_type, task) -> (config class, module class)``, as EasyDeL's RayDistributedTrainer
uses it, and ``AutoModelForCausalLM``, which reads that map for a Hugging Face folder's model_type.

The map is filled by each family package's ``register(...)`` call
(:mod:`scaletrain.models.common.family`; :mod:`scaletrain.models` imports every family).
The loader itself (:mod:`scaletrain.models.hf`) takes the module class as an argument.
"""

from __future__ import annotations

import os
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from scaletrain.errors import ConfigError
from scaletrain.models.common.family import (
    MODULES,
    get_modules_by_type,
    register_module,
    registered_model_types,
    registered_module_types,
)
from scaletrain.models.hf import load_hf_checkpoint
from scaletrain.models.hf_config import CONFIG_FILE, read_hf_config, supported_model_type
from scaletrain.models.task import CAUSAL_LM, SEQUENCE_CLASSIFICATION, TASKS, task_name
from scaletrain.parallel.partition import PartitionAxis

__all__ = ["MODULES", "AutoModelForCausalLM", "AutoModelForSequenceClassification", "get_modules_by_type", "model_class_identity", "register_module",
           "registered_model_types"]


def model_class_identity(model_class: type) -> tuple[str, str]:
    """``(model_type, task)`` of a module class: its ``_model_type`` / ``_model_task``, else its registry entry.

    EasyDeL reads the two class attributes directly, so a class without them failed
    with a bare ``AttributeError``; here a registered class needs neither, and any
    other class gets a ConfigError that names it and says what to add.
    """
    name = getattr(model_class, "__qualname__", repr(model_class))
    model_type = getattr(model_class, "_model_type", None)
    task = getattr(model_class, "_model_task", None)
    if model_type is None or task is None:
        entries = registered_module_types(model_class)
        if not entries:
            raise ConfigError(
                f"model_class {name} has no _model_type/_model_task and is not registered: give it class "
                "attributes `_model_type = \"...\"` and `_model_task = 'causal-language-model'`, or call "
                "scaletrain.models.register_module(model_type, task, config_class, module_class)"
            )
        model_type, task = entries[0]
    try:
        return model_type, task_name(task)
    except ValueError:
        raise ConfigError(f"model_class {name} has _model_task={task!r}; known tasks: "
                          f"{list(TASKS)}") from None


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
        _, module_class = get_modules_by_type(model_type, CAUSAL_LM)
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


class AutoModelForSequenceClassification(AutoModelForCausalLM):
    """The family's decoder with a one-label score head (:mod:`scaletrain.models.common.score_head`): a reward
    model. A folder without ``score.weight`` (a causal LM's) loads with a new head, as transformers' does."""

    @staticmethod
    def from_pretrained(local_dir: str | os.PathLike, **kwargs: Any) -> nnx.Module:
        """Load a local HF folder as its family's ``*ForSequenceClassification``; the keyword arguments are
        :meth:`AutoModelForCausalLM.from_pretrained`'s."""
        where = os.path.join(os.fspath(local_dir), CONFIG_FILE)
        _, module_class = get_modules_by_type(supported_model_type(read_hf_config(local_dir), where),
                                              SEQUENCE_CLASSIFICATION)
        return load_hf_checkpoint(local_dir, module_class, **kwargs)
