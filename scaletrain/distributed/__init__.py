"""Distributed training on Ray: ``RayDistributedTrainer``, the Ray Train launcher, scaling sweeps.

Names are imported lazily: ``import scaletrain.distributed`` neither imports Ray
(an optional extra, ``pip install scaletrain[ray]``) nor JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RayDistributedTrainer": "scaletrain.distributed.ray_trainer",
    "RayDistributedConfig": "scaletrain.distributed.ray_config",
    "TrainerSetupError": "scaletrain.distributed.ray_config",
    "LaunchResult": "scaletrain.distributed.launcher",
    "TrainJob": "scaletrain.distributed.launcher",
    "RecipeJob": "scaletrain.distributed.launcher",
    "launch_on_ray": "scaletrain.distributed.launcher",
    "KillWorkerOnce": "scaletrain.distributed.chaos",
    "SignalWorkerOnce": "scaletrain.distributed.chaos",
    "run_sweep": "scaletrain.distributed.sweep",
    "fit_power_law": "scaletrain.distributed.sweep",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.distributed', _EXPORTS, globals())
