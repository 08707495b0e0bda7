"""The names ``scaletrain.distributed`` exported before launch, sweeps and EasyDeL compatibility got
packages of their own; kept so that code importing them from here runs unchanged.

New code imports from their homes: :mod:`scaletrain.launch.ray` (the Ray backend),
:mod:`scaletrain.sweep` (scaling ladders), :mod:`scaletrain.compat.easydel`
(``RayDistributedTrainer``). Lazy: importing this package imports neither Ray nor JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "RayDistributedTrainer": "scaletrain.compat.easydel.ray_trainer",
    "RayDistributedConfig": "scaletrain.compat.easydel.ray_config",
    "TrainerSetupError": "scaletrain.compat.easydel.ray_config",
    "TrainJob": "scaletrain.compat.easydel.train_job",
    "LaunchResult": "scaletrain.launch.ray.launcher",
    "RecipeJob": "scaletrain.launch.ray.launcher",
    "launch_on_ray": "scaletrain.launch.ray.launcher",
    "KillWorkerOnce": "scaletrain.launch.ray.chaos",
    "SignalWorkerOnce": "scaletrain.launch.ray.chaos",
    "run_sweep": "scaletrain.sweep.ladder",
    "fit_power_law": "scaletrain.sweep.ladder",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.distributed', _EXPORTS, globals())
