"""Distributed training on Ray: ``RayDistributedTrainer``, the Ray Train launcher, scaling sweeps.

Names are imported lazily: ``import scaletrain.distributed`` neither imports Ray
(an optional extra, ``pip install scaletrain[ray]``) nor JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "RayDistributedTrainer": "scaletrain.distributed.ray_trainer",
    "RayDistributedConfig": "scaletrain.distributed.ray_trainer",
    "TrainerSetupError": "scaletrain.distributed.ray_trainer",
    "LaunchResult": "scaletrain.distributed.launcher",
    "TrainJob": "scaletrain.distributed.launcher",
    "RecipeJob": "scaletrain.distributed.launcher",
    "launch_on_ray": "scaletrain.distributed.launcher",
    "KillWorkerOnce": "scaletrain.distributed.chaos",
    "run_sweep": "scaletrain.distributed.sweep",
    "fit_power_law": "scaletrain.distributed.sweep",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'scaletrain.distributed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
