"""The recipe chooses where it trains; the old import path of the Ray names keeps working.

No backend is started here: what a run on each backend does is covered by test_cli.py
(local) and the Ray tests (ray). These pin the choice itself, which those take for granted.
"""

from __future__ import annotations

import importlib

import pytest

from scaletrain.launch import backends
from scaletrain.recipe import Recipe

RECIPE = "examples/shakespeare.yaml"


@pytest.mark.parametrize(("overrides", "backend"), [
    ([], "local"),
    (["ray.max_failures=2"], "local"),  # a ray section without num_workers trains here, as before
    (["ray.num_workers=2"], "ray"),
])
def test_the_recipe_picks_its_backend(overrides, backend):
    assert backends.backend_of(Recipe.load(RECIPE, overrides)) == backend


CALLS: list[Recipe] = []


def _recording_backend(recipe: Recipe) -> dict:
    CALLS.append(recipe)
    return {"final_step": 7}


@pytest.mark.parametrize("name, module, function", [
    ("local", "scaletrain.launch.local", "run_local"),
    ("ray", "scaletrain.launch.ray.launcher", "run_recipe_on_ray"),
    ("jax", "scaletrain.launch.jax.backend", "run_recipe_on_jax"),
])
def test_every_backend_calls_its_entry_point(monkeypatch, name, module, function):
    monkeypatch.setattr(importlib.import_module(module), function, _recording_backend)
    recipe = Recipe.load(RECIPE, [])
    CALLS.clear()
    assert backends.BACKENDS[name](recipe) == {"final_step": 7} and CALLS == [recipe]
    assert sorted(backends.BACKENDS) == ["jax", "local", "ray"]


def test_run_recipe_calls_the_chosen_backend(monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "local", _recording_backend)
    recipe = Recipe.load(RECIPE, [])
    CALLS.clear()
    assert backends.run_recipe(recipe) == {"final_step": 7} and CALLS == [recipe]


def test_old_import_path_gives_the_same_objects():
    import scaletrain
    import scaletrain.distributed as old
    from scaletrain.compat.easydel import RayDistributedConfig, RayDistributedTrainer
    from scaletrain.launch.ray import KillWorkerOnce, launch_on_ray
    from scaletrain.sweep import run_sweep

    assert old.RayDistributedTrainer is RayDistributedTrainer is scaletrain.RayDistributedTrainer
    assert old.RayDistributedConfig is RayDistributedConfig is scaletrain.RayDistributedConfig
    assert (old.KillWorkerOnce, old.launch_on_ray, old.run_sweep) == (KillWorkerOnce, launch_on_ray, run_sweep)
