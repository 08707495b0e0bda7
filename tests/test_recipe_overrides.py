"""A problem made by a command-line override names that override, and no other."""

import os

import pytest

from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(ROOT, "examples", "grpo_smollm2.yaml")


def _problem(overrides):
    with pytest.raises(ConfigError) as err:
        Recipe.load(GRPO, overrides)
    return str(err.value).splitlines()


def test_an_unknown_objective_key_among_several_overrides_is_blamed_on_its_own_override():
    lines = _problem(["objective.max_completion_length=8", "objective.generation_batch_size=16"])
    assert lines == [f"invalid command-line override (recipe {GRPO})",
                     "objective.generation_batch_size: unknown key; did you mean 'num_generations'? "
                     "[command-line override 'objective.generation_batch_size=16']"]


def test_each_of_several_bad_objective_overrides_names_its_own_override():
    lines = _problem(["objective.max_completion_length=8", "objective.generation_batch_size=16",
                      "objective.beta=x", "objective.num_generations=4"])
    assert len(lines) == 3
    assert lines[1].startswith("objective.beta: ") and lines[1].endswith("[command-line override 'objective.beta=x']")
    assert lines[2].endswith("[command-line override 'objective.generation_batch_size=16']")
    assert not any("max_completion_length" in line or "num_generations=4" in line for line in lines)


def test_a_bad_objective_key_in_the_file_is_not_blamed_on_an_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    text = open(GRPO).read()
    recipe.write_text(text.replace("  num_generations:", "  generation_batch_size: 16\n  num_generations:"))
    with pytest.raises(ConfigError) as err:
        Recipe.load(str(recipe), ["objective.max_completion_length=8"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{recipe}: invalid recipe"
    assert lines[1].startswith("objective.generation_batch_size: unknown key") and "override" not in lines[1]
