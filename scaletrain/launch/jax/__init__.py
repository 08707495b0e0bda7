"""The ``jax`` backend: processes started by Slurm, on TPU VMs, by Open MPI, by hand or by
``scaletrain launch`` join one ``jax.distributed`` job without Ray.

:mod:`.settings` finds this process's place (coordinator, count, id); :mod:`.rendezvous`
checks that the processes agree before JAX starts; :mod:`.backend` initialises
``jax.distributed`` and trains; :mod:`.lost` names a process that died; :mod:`.supervisor` is
``scaletrain launch --nproc N``.
Names are imported lazily: importing the package imports no JAX.
"""

from __future__ import annotations

from scaletrain._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "JaxJob": "scaletrain.launch.jax.settings",
    "resolve_job": "scaletrain.launch.jax.settings",
    "run_recipe_on_jax": "scaletrain.launch.jax.backend",
    "launch_processes": "scaletrain.launch.jax.supervisor",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports('scaletrain.launch.jax', _EXPORTS, globals())
