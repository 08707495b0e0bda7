"""Hugging Face ``config.json`` <-> our model configs (``DecoderConfig`` and family).

Why a module of its own: what a config.json *means* (defaults, legacy keys, the
options we refuse) is a separate question from how the weights are read and written
(:mod:`scaletrain.models.hf`). The transformers config classes (a runtime dependency
anyway) resolve defaults and legacy keys (``rope_scaling``/``rope_theta`` vs
``rope_parameters``), so a config.json means here exactly what it means to
transformers. Anything we would compute differently raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.models.common.family import ARCHITECTURES, FAMILIES
from scaletrain.models.common.config import DecoderConfig
from scaletrain.models.common.layer_types import check_hf_layer_types
from scaletrain.models.hf_family import ROPE_TYPES
from scaletrain.models.hf_multimodal import language_model_config
from scaletrain.parallel.partition import PartitionAxis

logger = logging.getLogger("scaletrain")

# FAMILIES (HF model_type -> its mapping) and ARCHITECTURES (-> the HF architecture class name) are
# filled by each family package's register(...) call (scaletrain.models.common.family)
__all__ = ["ARCHITECTURES", "CONFIG_FILE", "FAMILIES", "ROPE_TYPES", "config_from_hf", "config_to_hf",
           "load_hf_config", "read_hf_config", "supported_model_type"]
CONFIG_FILE = "config.json"


def read_hf_config(local_dir: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a local HF folder (ConfigError naming the path if unusable)."""
    path = os.path.join(os.fspath(local_dir), CONFIG_FILE)
    if not os.path.isdir(local_dir):
        raise ConfigError(f"{os.fspath(local_dir)}: not a directory; pass a local Hugging Face model folder")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing; a Hugging Face model folder needs config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return language_model_config(raw, path)  # a vision-language folder reads as its language model


def supported_model_type(raw: dict[str, Any], where: str = CONFIG_FILE) -> str:
    """The ``model_type`` of an HF config dict; ConfigError naming it unless we implement it."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return model_type


def load_hf_config(
    local_dir: str | os.PathLike,
    sharding_axis_dims: tuple[int, ...] | None = None,
    partition_axis: PartitionAxis | dict[str, Any] | None = None,
) -> DecoderConfig:
    """Our config for a local HF folder, with the mesh placement fields set when given."""
    raw = read_hf_config(local_dir)
    runtime: dict[str, Any] = {}
    if sharding_axis_dims is not None:
        runtime["sharding_axis_dims"] = tuple(sharding_axis_dims)
    if partition_axis is not None:
        runtime["partition_axis"] = partition_axis
    return config_from_hf(raw, os.path.join(os.fspath(local_dir), CONFIG_FILE), **runtime)


def config_from_hf(raw: dict[str, Any], where: str = CONFIG_FILE, **runtime: Any) -> DecoderConfig:
    """Our config for an HF ``config.json`` dict; ``runtime`` sets placement fields.

    Raises ConfigError naming the model_type or option we do not implement, rather
    than building a model that would silently compute something else.
    """
    family = FAMILIES[supported_model_type(raw, where)]
    quantization = raw.get("quantization_config")
    if quantization and (not isinstance(quantization, dict)
                         or quantization.get("quant_method") not in family.quantizations):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        readable = f" ({family.model_type} reads {list(family.quantizations)})" if family.quantizations else ""
        raise ConfigError(f"{where}: quantization_config with quant_method {method!r} is not supported"
                          f"{readable}; dequantize first")
    check_hf_layer_types(raw, family.config_class, where)  # before transformers' own, many-line refusal
    try:
        hf = family.transformers_config().from_dict(dict(raw))
    except (ValueError, TypeError) as exc:  # transformers' own validation of the keys
        raise ConfigError(f"{where}: transformers rejects this {family.model_type} config: {exc}") from None
    if getattr(hf, "attention_dropout", 0.0):
        logger.warning("%s: attention_dropout=%s is ignored (scaletrain has no dropout)", where, hf.attention_dropout)
    fields = family.from_hf(hf, where)
    fields.update({k: v for k, v in runtime.items() if v is not None})
    try:
        return family.config_class(**fields)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"{where}: {exc}") from None


def config_to_hf(config: DecoderConfig, dtype: str) -> Any:
    """A transformers config object for ``config``; ConfigError if HF cannot express it.

    Only architecture keys travel; placement fields (mesh, partition axes, remat,
    attention implementation) are runtime choices of this library.
    """
    model_type = config.model_type
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} cannot be exported; supported: {sorted(ARCHITECTURES)}")
    family = FAMILIES[model_type]

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"model_type {model_type!r} with {what} has no Hugging Face equivalent; cannot export")

    hf = family.transformers_config()(**family.to_hf(config, refuse))
    hf.architectures = [family.architecture]
    hf.dtype = dtype
    return hf
