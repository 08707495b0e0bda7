"""Which backend runs a recipe, and running it there (``scaletrain train``).

A backend is a name and an entry point ``(recipe) -> summary``, imported only when
chosen (Ray is an optional extra, and the local run must not pay for importing it).
The recipe chooses: a ``ray`` section with ``num_workers`` set runs on Ray; a process
started as one of several (``launch`` section, ``--coordinator``, Slurm, Open MPI, a TPU
pod with ``launch.backend=jax``) joins them with ``jax.distributed``; anything else runs
locally, as ``scaletrain train`` always has. A new backend is one entry in
:data:`BACKENDS`, its recipe section, and one rule in :func:`backend_of`. Each entry imports its
backend inside a function, not by a ``"module:function"`` string, so the layout test sees the import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe



def _local(recipe: Recipe) -> dict[str, Any]:
    from scaletrain.launch.local import run_local

    return run_local(recipe)


def _ray(recipe: Recipe) -> dict[str, Any]:
    from scaletrain.launch.ray.launcher import run_recipe_on_ray

    return run_recipe_on_ray(recipe)


def _jax(recipe: Recipe) -> dict[str, Any]:
    from scaletrain.launch.jax.backend import run_recipe_on_jax

    return run_recipe_on_jax(recipe)


#: backend name -> its entry point ``(recipe) -> summary``
BACKENDS: dict[str, Callable[[Recipe], dict[str, Any]]] = {"local": _local, "ray": _ray, "jax": _jax}


def backend_of(recipe: Recipe) -> str:
    """The backend ``recipe`` asks for: ``ray`` when ``ray.num_workers`` is set; ``jax`` when
    ``launch.backend`` says so, or (``auto``) when this process was started as one of several
    (:func:`scaletrain.launch.jax.settings.wants_jax`); else ``local``."""
    from scaletrain.launch.jax.settings import wants_jax

    if recipe.ray.num_workers:
        if recipe.launch.backend == "jax":
            raise ConfigError("launch.backend=jax and ray.num_workers are both set: Ray starts its own JAX "
                              "processes; unset ray.num_workers, or set launch.backend=auto")
        return "ray"
    return "jax" if wants_jax(recipe) else "local"


def run_recipe(recipe: Recipe) -> dict[str, Any]:
    """Run ``recipe`` on its backend (:func:`backend_of`); the run's summary (``summary.json``)."""
    return BACKENDS[backend_of(recipe)](recipe)
