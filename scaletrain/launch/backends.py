"""Which backend runs a recipe, and running it there (``scaletrain train``).

A backend is a name and an entry point ``(recipe) -> summary``, imported only when
chosen (Ray is an optional extra, and the local run must not pay for importing it).
The recipe chooses: a ``ray`` section with ``num_workers`` set runs on Ray, anything
else runs locally, as ``scaletrain train`` always has. A new backend is one entry in
:data:`BACKENDS`, its recipe section, and one rule in :func:`backend_of`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe

#: backend name -> ``"module:function"`` of its entry point
BACKENDS: dict[str, str] = {
    "local": "scaletrain.launch.local:run_local",
    "ray": "scaletrain.launch.ray.launcher:run_recipe_on_ray",
}


def backend_of(recipe: Recipe) -> str:
    """The backend ``recipe`` asks for: ``ray`` when ``ray.num_workers`` is set, else ``local``."""
    return "ray" if recipe.ray.num_workers else "local"


def run_recipe(recipe: Recipe) -> dict[str, Any]:
    """Run ``recipe`` on its backend (:func:`backend_of`); the run's summary (``summary.json``)."""
    module, _, function = BACKENDS[backend_of(recipe)].partition(":")
    return getattr(importlib.import_module(module), function)(recipe)
