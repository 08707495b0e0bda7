"""The ``local`` backend: the recipe trains in this process, on this host's devices.

Why a module of its own when it is one call: the backend table
(:mod:`scaletrain.launch.backends`) names each backend's entry point alike, so the choice
reads the same for every backend and adding one never edits another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe


def run_local(recipe: Recipe) -> dict[str, Any]:
    """Train ``recipe`` here (:func:`scaletrain.run.run_training`); the run's summary."""
    from scaletrain.run import run_training

    return run_training(recipe)
