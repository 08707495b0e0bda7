"""The ``ray`` backend: N JAX processes under Ray Train, restarts after failures, stops on signals.

:mod:`.launcher` starts the worker group and decides restarts; :mod:`.cluster` reaches
Ray (a local instance or a running cluster) and sets the workers' environment;
:mod:`.worker_callbacks` report from inside the group; :mod:`.failures` tells a user
error from a crash; :mod:`.driver_stop` forwards SIGTERM/SIGINT; :mod:`.chaos` injects
failures in tests; :mod:`.prelaunch` checks a recipe before any worker starts. Names are imported lazily:
``import scaletrain.launch.ray`` imports neither Ray nor JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "LaunchResult": "scaletrain.launch.ray.launcher",
    "RecipeJob": "scaletrain.launch.ray.launcher",
    "launch_on_ray": "scaletrain.launch.ray.launcher",
    "run_recipe_on_ray": "scaletrain.launch.ray.launcher",
    "WorkersFailedError": "scaletrain.launch.ray.failures",
    "KillWorkerOnce": "scaletrain.launch.ray.chaos",
    "SignalWorkerOnce": "scaletrain.launch.ray.chaos",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.launch.ray', _EXPORTS, globals())
