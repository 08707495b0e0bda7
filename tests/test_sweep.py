"""Sweep pieces that need no Ray: member recipes, the power-law fit, the report files."""

import json
import os

import numpy as np
import pytest

from scaletrain.sweep.ladder import fit_power_law, is_finished, member_recipe, run_sweep, write_report
from scaletrain.sweep.keys import (changed_keys, keyed_recipe, move_aside, record_member, recipe_digest,
                                               refuse_or_move, stale_member)
from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe, apply_overrides
from scaletrain.training.outputs import write_summary

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


def test_fit_with_as_many_members_as_parameters_is_not_ok():
    """Issue 16 item 14: 3 points for a, b, c are fitted exactly whatever they are: no evidence, so not ok."""
    c = [1e12, 1e13, 1e14]
    fit = fit_power_law(c, [9.0, 2.0, 7.0])  # not a decreasing law at all, and still "fitted"
    assert fit["ok"] is False and fit["status"] == "exactly_determined" and fit["points"] == 3
    assert "exactly determined" in fit["reason"] and "at least 4" in fit["reason"] and "a" in fit
    assert fit_power_law([1e12, 1e13], [3.0, 2.5])["status"] == "too_few_points"
    four = fit_power_law(c + [1e15], [40.0 * x ** -0.1 + 1.5 for x in c + [1e15]])
    assert four["ok"] is True and four["status"] == "ok" and "reason" not in four


def test_report_files(tmp_path):
    members = [{"scaling_index": i, "status": "finished", "num_params": 1000 * i, "train_tokens": 100,
                "flops": 1e9 * i, "final_eval_loss": 3.0 / i ** 0.2 + 1, "output_dir": str(tmp_path / f"m{i}"),
                "error": None} for i in (1, 2, 4, 8)]
    members.append({"scaling_index": 16, "status": "failed", "error": "DataError: x", "output_dir": "m16"})
    report = {"sweep_dir": str(tmp_path), "scaled_keys": ["hidden_size"], "members": members,
              "fit": fit_power_law([m["flops"] for m in members[:4]], [m["final_eval_loss"] for m in members[:4]])}
    write_report(report, str(tmp_path))
    assert json.loads((tmp_path / "sweep.json").read_text())["fit"]["ok"]
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 6
    assert os.path.getsize(tmp_path / "sweep.png") > 10_000
    assert is_finished({"final_step": 4, "max_training_steps": 4})
    assert not is_finished({"final_step": 2, "max_training_steps": 4}) and not is_finished(None)


# Issue 16 item 6: members are keyed by their resolved recipe. The member folders below are
# written with the functions a sweep and its members use (record_member, write_summary,
# Recipe.to_yaml as run_training writes recipe.yaml), so run_sweep finds them finished and
# needs no Ray: it either reuses them all or refuses before anything runs.

def _ladder(root, *overrides):
    data = {"model": {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1},
            "training": {"output_dir": str(root), "max_training_steps": 4}, "sweep": {"scaling_indices": [1, 2, 4, 8]}}
    return Recipe.from_dict(apply_overrides(data, list(overrides)))


def _finish_member(recipe, index, record=True):
    member = member_recipe(recipe, index)
    out = member.training.output_dir
    os.makedirs(out, exist_ok=True)
    if record:
        record_member(out, index, keyed_recipe(member.to_dict()))
    with open(os.path.join(out, "recipe.yaml"), "w") as f:
        f.write(member.to_yaml())
    write_summary(out, {"final_step": 4, "max_training_steps": 4, "num_params": 1000 * index, "train_tokens": 100,
                        "flops_per_token": 1e6 * index, "final_eval_loss": 3.0 / index ** 0.2 + 1.0})
    return out


@pytest.fixture
def finished_ladder(tmp_path):
    recipe = _ladder(tmp_path / "ladder")
    return recipe, {i: _finish_member(recipe, i) for i in recipe.sweep.scaling_indices}


def test_rerun_with_the_same_recipe_reuses_finished_members(finished_ladder):
    recipe, folders = finished_ladder
    # keys that say where/how a member runs or when it pauses are not part of its key
    same = Recipe.from_dict(apply_overrides(recipe.to_dict(), [
        "ray.num_workers=2", "training.progress_bar=true", "training.exit_iteration_this_run=2",
        "training.report_to=[]", "sweep.cpus_per_member=2"]))
    report = run_sweep(same)
    assert [m["status"] for m in report["members"]] == ["skipped (finished earlier)"] * 4
    assert report["fit"]["ok"] and report["fit"]["points"] == 4
    record = json.loads(open(os.path.join(folders[2], "sweep-member.json")).read())
    assert record["recipe_sha256"] == recipe_digest(keyed_recipe(member_recipe(recipe, 2).to_dict()))


def test_rerun_with_a_changed_recipe_is_refused_naming_member_and_keys(finished_ladder):
    recipe, folders = finished_ladder
    before = {i: os.listdir(f) for i, f in folders.items()}
    changed = _ladder(recipe.training.output_dir, "training.learning_rate=0.001",
                      'sweep.member_overrides={8: ["training.seed=3"]}')
    with pytest.raises(ConfigError) as err:
        run_sweep(changed)
    msg = str(err.value)
    assert f"member-1, {folders[2]}, {folders[4]} (" in msg and f"member-8 (" in msg
    assert "training.learning_rate: 0.0003 -> 0.001" in msg and "training.seed: 0 -> 3" in msg
    assert "training.output_dir" in msg and "--rerun-changed" in msg
    assert {i: os.listdir(f) for i, f in folders.items()} == before  # nothing ran, nothing was written
    # only member 8 changed when only its override changes
    stale = {i: stale_member(f, keyed_recipe(member_recipe(_ladder(recipe.training.output_dir,
             'sweep.member_overrides={8: ["training.seed=3"]}'), i).to_dict()), {}) for i, f in folders.items()}
    assert stale == {1: None, 2: None, 4: None, 8: ["training.seed: 0 -> 3"]}


def test_changed_member_is_moved_aside_when_asked(finished_ladder):
    _, folders = finished_ladder
    assert refuse_or_move({folders[4]: ["x"]}, rerun_changed=True) == [folders[4] + ".replaced-1"]
    assert not os.path.exists(folders[4])
    assert os.path.isfile(os.path.join(folders[4] + ".replaced-1", "summary.json"))  # kept, never deleted
    os.makedirs(folders[4])
    assert move_aside(folders[4]) == folders[4] + ".replaced-2"


def test_member_without_record_or_outputs(tmp_path):
    recipe = _ladder(tmp_path / "ladder")
    keyed = keyed_recipe(member_recipe(recipe, 2).to_dict())
    changed = keyed_recipe(member_recipe(_ladder(tmp_path / "ladder", "model.num_hidden_layers=3"), 2).to_dict())
    legacy = _finish_member(recipe, 2, record=False)  # an older scaletrain: only its recipe.yaml
    assert stale_member(legacy, keyed, {}) is None
    assert stale_member(legacy, changed, {})[0].startswith("model.num_hidden_layers: (absent) -> 3")
    os.remove(os.path.join(legacy, "recipe.yaml"))
    assert "unknown" in stale_member(legacy, keyed, {})[0]
    # a member that failed before writing a summary or a checkpoint has nothing to reuse: retried
    failed = str(tmp_path / "failed")
    record_member(failed, 2, changed)
    os.makedirs(os.path.join(failed, "checkpoints"))
    assert stale_member(failed, keyed, {}) is None
    # a key a newer scaletrain added, at its default value, is not a change
    defaults = keyed_recipe(Recipe().to_dict())
    old = {**keyed, "training": {k: v for k, v in keyed["training"].items() if k != "z_loss"}}
    assert changed_keys(old, keyed, defaults) == [] and changed_keys(old, keyed) == ["training.z_loss: (absent) -> 0.0"]
