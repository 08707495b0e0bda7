"""Models a ``RayDistributedTrainer`` loads rather than builds: a Hugging Face folder or a checkpoint.

Weights and architecture come from what is loaded; where the arrays sit (mesh,
partition axis) and how the model runs (remat, attention options:
``models.config.RUNTIME_KEYS``) come from the trainer's ``config_variables``, so a
checkpoint saved on one mesh trains on another. Apart from the façade because it
only needs those variables and a path, never the trainer.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from scaletrain.compat.easydel.ray_config import PLACEMENT_KEYS
from scaletrain.models.common.config import RUNTIME_KEYS
from scaletrain.remote_storage import fetch

if TYPE_CHECKING:  # pragma: no cover
    from flax import nnx

logger = logging.getLogger("scaletrain")


def runtime_overrides(config_variables: dict[str, Any]) -> dict[str, Any]:
    """The placement and runtime keys of ``config_variables``: what a loaded checkpoint takes from them."""
    return {k: config_variables[k] for k in (*PLACEMENT_KEYS, *RUNTIME_KEYS) if k in config_variables}


def load_hf_model(folder: str, config_variables: dict[str, Any]) -> nnx.Module:
    """The Hugging Face model in the local ``folder``, on the mesh and with the runtime keys of ``config_variables``
    (and its layout: ``scan_layers`` stacks the layers as they are read)."""
    from scaletrain.models.registry import AutoModelForCausalLM

    cv = config_variables
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=cv["dtype"], param_dtype=cv["param_dtype"],
                                                 sharding_axis_dims=cv.get("sharding_axis_dims"),
                                                 partition_axis=cv.get("partition_axis"), precision=cv.get("precision"),
                                                 scan_layers=bool(cv.get("scan_layers", False)))
    for key in RUNTIME_KEYS:  # the mesh went to the loader above
        if key in cv:
            setattr(model.config, key, cv[key])
    return model


def load_bucket_model(bucket_path: str, cache_dir: str, config_variables: dict[str, Any]) -> nnx.Module:
    """The model saved at ``bucket_path`` (local or fsspec URL, copied into ``cache_dir`` first):
    a Hugging Face folder (it has ``config.json``) or a scaletrain run/checkpoint."""
    from scaletrain.export import load_checkpoint_model

    folder = fetch(bucket_path, cache_dir)
    if os.path.isfile(os.path.join(folder, "config.json")):
        logger.info("loading the Hugging Face model at %s", bucket_path)
        return load_hf_model(folder, config_variables)
    logger.info("loading the training checkpoint at %s", bucket_path)
    cv = config_variables
    model, _ = load_checkpoint_model(folder, config_overrides=runtime_overrides(cv), dtype=cv["dtype"],
                                     param_dtype=cv["param_dtype"], precision=cv.get("precision"))
    return model
