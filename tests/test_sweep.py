"""Sweep pieces that need no Ray: member recipes, the power-law fit, the report files."""

import json
import os

import numpy as np
import pytest

from scaletrain.distributed.sweep import fit_power_law, is_finished, member_recipe, write_report
from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe

pytest.importorskip("scipy")


def _recipe(**model):
    base = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    return Recipe.from_dict({"model": {**base, **model}, "training": {"output_dir": "/tmp/ladder"},
                             "ray": {"num_workers": 2},
                             "sweep": {"member_overrides": {4: ["training.learning_rate=0.001"]}}})


def test_member_recipe_scales_the_keys_and_owns_a_folder():
    recipe = _recipe()
    m = member_recipe(recipe, 4)
    keys = m.model.config_overrides
    assert (keys["hidden_size"], keys["intermediate_size"], keys["num_attention_heads"],
            keys["num_key_value_heads"]) == (64, 128, 8, 4)
    assert m.training.output_dir == "/tmp/ladder/member-4" and m.training.resume_if_possible
    assert m.ray.num_workers is None  # a member is one process
    assert m.training.learning_rate == 0.001 and member_recipe(recipe, 2).training.learning_rate == 3e-4
    custom = Recipe.from_dict({**recipe.to_dict(), "sweep": {"scaled_keys": ["num_hidden_layers"]}})
    with pytest.raises(ConfigError, match="model.num_hidden_layers"):
        member_recipe(custom, 2)
    with pytest.raises(ConfigError, match="pretrained"):
        member_recipe(Recipe.from_dict({**recipe.to_dict(), "model": {"pretrained": "/x"}}), 2)


def test_recipe_ray_section_is_validated():
    with pytest.raises(ConfigError, match="ray.num_workrs"):
        Recipe.from_dict({"ray": {"num_workrs": 2}})
    with pytest.raises(ConfigError, match="ray.num_workers"):
        Recipe.from_dict({"ray": {"num_workers": 0}})


def test_power_law_fit_recovers_known_parameters():
    c = np.geomspace(1e12, 1e16, 5)
    loss = 40.0 * c ** -0.1 + 1.5
    fit = fit_power_law(list(c), list(loss))
    assert fit["ok"] and fit["points"] == 5
    assert fit["b"] == pytest.approx(0.1, rel=1e-3) and fit["c"] == pytest.approx(1.5, rel=1e-3)
    assert fit["a"] == pytest.approx(40.0, rel=1e-2)
    few = fit_power_law([1e12, 1e13], [3.0, 2.5])
    assert few["ok"] is False and "at least 3" in few["reason"]
    assert fit_power_law([1e12, None, float("nan")], [3.0, 2.0, 1.0])["points"] == 1


def test_report_files(tmp_path):
    members = [{"scaling_index": i, "status": "finished", "num_params": 1000 * i, "train_tokens": 100,
                "flops": 1e9 * i, "final_eval_loss": 3.0 / i ** 0.2 + 1, "output_dir": str(tmp_path / f"m{i}"),
                "error": None} for i in (1, 2, 4)]
    members.append({"scaling_index": 8, "status": "failed", "error": "DataError: x", "output_dir": "m8"})
    report = {"sweep_dir": str(tmp_path), "scaled_keys": ["hidden_size"], "members": members,
              "fit": fit_power_law([m["flops"] for m in members[:3]], [m["final_eval_loss"] for m in members[:3]])}
    write_report(report, str(tmp_path))
    assert json.loads((tmp_path / "sweep.json").read_text())["fit"]["ok"]
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 5
    assert os.path.getsize(tmp_path / "sweep.png") > 10_000
    assert is_finished({"final_step": 4, "max_training_steps": 4})
    assert not is_finished({"final_step": 2, "max_training_steps": 4}) and not is_finished(None)
