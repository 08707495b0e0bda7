"""What describes a ``RayDistributedTrainer``: EasyDeL's defaults, its saved JSON, its resolution rules.

Apart from the façade (:mod:`scaletrain.compat.easydel.ray_trainer`) because this is data
and the rules over it, with no model, trainer or Ray behind it: the defaults the
class exposes as ``CONFIG_SCALING_VARIABLES`` / ``CONFIG_VARIABLES``, which
variables go to the module rather than the config, how the model class is resolved
from ``model_class`` or ``(model_type, model_task)``, and the JSON file that
``save_config`` / ``from_config`` exchange.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
from pydantic import BaseModel

from scaletrain.compat.easydel import config_format
from scaletrain.compat.easydel.enums import TaskType
from scaletrain.errors import ConfigError
from scaletrain.models.registry import get_modules_by_type, model_class_identity
from scaletrain.parallel.partition import PartitionAxis
from scaletrain.remote_storage import read_text, write_text

logger = logging.getLogger("scaletrain")

# EasyDeL RayDistributedTrainer's defaults: multiplied by the scaling index
CONFIG_SCALING_VARIABLES: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 256 * 4,
    "moe_intermediate_size": 256 * 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
# EasyDeL RayDistributedTrainer's defaults: passed as they are
CONFIG_VARIABLES: dict[str, Any] = {
    "dtype": jnp.bfloat16,
    "param_dtype": jnp.bfloat16,
    "precision": jax.lax.Precision.DEFAULT,
    "seed": 654,
    "max_position_embeddings": 2**13,
    "gradient_checkpointing": "none",
    "initializer_range": 0.02,
    "partition_axis": PartitionAxis(),
    "attn_mechanism": "auto",
    "attn_dtype": jnp.bfloat16,
    "attn_softmax_dtype": jnp.bfloat16,
    "sharding_axis_names": ("dp", "fsdp", "ep", "tp", "sp"),
    "sharding_axis_dims": (1, -1, 1, 1, 1),
    "sharding_dcn_axis_dims": (1, -1, 1, 1, 1),
}
# passed to the module constructor, never to the config (EasyDeL's ``not_allowed``)
MODULE_KEYS = ("precision", "dtype", "param_dtype")
# where a model's arrays sit: with models.config.RUNTIME_KEYS, what a loaded checkpoint takes from this trainer
PLACEMENT_KEYS = ("sharding_axis_names", "sharding_axis_dims", "sharding_dcn_axis_dims", "partition_axis")


class TrainerSetupError(ConfigError, AssertionError):
    """The constructor could not resolve the model class.

    An ``AssertionError`` as in EasyDeL (callers catch that), and a ``ConfigError``
    so the CLI prints it as a user error without a traceback.
    """


def require(condition: bool, message: str) -> None:
    """Raise :class:`TrainerSetupError` unless ``condition`` (not ``assert``: checks must survive ``python -O``)."""
    if not condition:
        raise TrainerSetupError(message)


def resolve_model_class(model_class: type | None, model_type: str | None,
                        model_task: TaskType | str | None) -> tuple[type, str, TaskType]:
    """``(model_class, model_type, model_task)`` by EasyDeL RayDistributedTrainer's rules.

    Give ``model_class``, or both ``model_type`` and ``model_task``; with all three,
    the class wins and type/task are read from it (a warning only when they differ
    from the ones given: ``from_config(model_class=...)`` passes the saved pair).
    The class's pair is :func:`~scaletrain.models.registry.model_class_identity`'s.
    """
    if model_task is None or model_type is None:
        require(model_task is None and model_type is None,
                "If one of model_task or model_type is None, both must be None.")
        require(model_class is not None, "model_class must be provided when model_task/model_type are omitted.")
        model_type, model_task = _identity(model_class)
    elif model_class is not None:
        given = (model_type, _task(model_task))
        model_type, model_task = _identity(model_class)
        if given != (model_type, model_task):
            logger.warning("Both model_class and model_type/model_task provided. Using model_class and inferring "
                           "type/task from it (%s/%s, not %s/%s).", model_type, model_task.value, given[0],
                           given[1].value)
    model_task = _task(model_task)
    if model_class is None:
        try:
            _, model_class = get_modules_by_type(model_type=model_type, task_type=model_task)
        except ConfigError as err:
            raise TrainerSetupError(f"Could not resolve model class for {model_type}/{model_task}: {err}") from None
    return model_class, model_type, model_task


def _identity(model_class: type) -> tuple[str, TaskType]:
    try:
        model_type, task = model_class_identity(model_class)
    except ConfigError as err:
        raise TrainerSetupError(str(err)) from None
    return model_type, TaskType(task)


def _task(model_task: TaskType | str) -> TaskType:
    try:
        return TaskType(model_task)
    except ValueError:
        raise TrainerSetupError(f"unknown model_task {model_task!r}; known: {[t.value for t in TaskType]}") from None


class RayDistributedConfig(BaseModel):
    """What :meth:`RayDistributedTrainer.save_config` writes, as JSON.

    ``_saving_preprocess`` turns dtypes, ``jax.lax.Precision`` and tuples into tagged
    JSON objects, ``partition_axis`` into the plain dict of eformer's fields (EasyDeL
    reads it too) and the attention/remat enums into their values, noted in
    ``enum_types``; ``_loading_postprocess`` turns them back, so
    ``from_config(save_config(t))`` has configs equal to ``t``'s, types included. A file
    EasyDeL saved (no ``encoding``) loads by EasyDeL's rules
    (:mod:`scaletrain.compat.easydel.config_format`). ``bucket_path``, ``encoding`` and
    ``enum_types`` are additions to EasyDeL's fields (EasyDeL ignores them).
    """

    pretrained_model_name_or_path: str
    model_task: TaskType | None = None
    model_type: str | None = None
    offload_backend: str | None = None
    config_scaling_variables: dict[str, int] | None = None
    config_variables: dict[str, Any] | None = None
    bucket_path: str | None = None
    encoding: str | None = None
    enum_types: dict[str, str] | None = None

    def _saving_preprocess(self) -> None:
        """Encode the variables for JSON (in place; call once before dumping)."""
        if self.config_variables is not None:
            self.config_variables, self.enum_types = config_format.encode_variables(self.config_variables)
            self.encoding = config_format.ENCODING
        if self.config_scaling_variables is not None:
            for key, value in self.config_scaling_variables.items():
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ConfigError(f"config_scaling_variables.{key} must be an int, got {value!r}")

    def _loading_postprocess(self) -> None:
        """Decode what ``_saving_preprocess`` encoded (in place; call once after loading)."""
        if self.config_variables is not None:
            self.config_variables = config_format.decode_variables(self.config_variables, self.enum_types,
                                                                    self.encoding)

    @classmethod
    def read(cls, path: str | os.PathLike) -> RayDistributedConfig:
        """The config saved at ``path`` (local path or fsspec URL), decoded."""
        cfg = cls(**json.loads(read_text(path)))
        cfg._loading_postprocess()
        return cfg

    def write(self, path: str | os.PathLike) -> None:
        """Save as JSON at ``path``; encodes a shallow copy, so this object (and its dicts) stay as they are."""
        cfg = self.model_copy()
        cfg._saving_preprocess()
        write_text(path, cfg.model_dump_json(indent=2))
