"""The shipped preference example: its generator, its data files and examples/dpo_smollm2.yaml.

The pairs in examples/preference/ are what scripts/make_preference_dataset.py writes: the
generator runs again here (well under a second) and must give the shipped files byte for
byte, so the files can always be regenerated and a change to the script without its output
(or the reverse) is caught. The recipe must load and name what the docs say it does.
"""

from __future__ import annotations

import importlib.util
import json

from data_helpers import REPO

from scaletrain.objectives.registry import build_objective
from scaletrain.recipe import Recipe

SCRIPT = REPO / "scripts" / "make_preference_dataset.py"
EXAMPLE = REPO / "examples" / "dpo_smollm2.yaml"


def _generator():
    spec = importlib.util.spec_from_file_location("make_preference_dataset", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_writes_the_shipped_files_byte_for_byte(tmp_path):
    _generator().main(["--out-dir", str(tmp_path)])
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "examples" / "preference" / name).read_bytes(), name


def test_pairs_are_trl_conversational_with_one_flaw_and_held_out_prompts_are_new():
    rows = {name: [json.loads(line) for line in open(REPO / "examples" / "preference" / f"{name}.jsonl")]
            for name in ("train", "eval")}
    assert (len(rows["train"]), len(rows["eval"])) == (320, 64)
    for row in rows["train"] + rows["eval"]:
        assert [m["role"] for m in row["prompt"]][-1] == "user"
        assert [m["role"] for m in row["chosen"]] == [m["role"] for m in row["rejected"]] == ["assistant"]
        assert row["chosen"][0]["content"] != row["rejected"][0]["content"]
        assert row["flaw"] in ("wrong_result", "broken_instruction")
    train_prompts = {json.dumps(r["prompt"]) for r in rows["train"]}
    assert len(train_prompts) == 320
    assert not train_prompts & {json.dumps(r["prompt"]) for r in rows["eval"]}
    # both kinds of flaw are present in both files
    for name in ("train", "eval"):
        assert {r["flaw"] for r in rows[name]} == {"wrong_result", "broken_instruction"}


def test_generator_is_deterministic_and_the_seed_matters():
    gen = _generator()
    assert gen.make(40, 3) == gen.make(40, 3)
    assert gen.make(40, 3) != gen.make(40, 4)


def test_example_recipe_validates_as_lora_dpo_on_the_shipped_pairs(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    recipe = Recipe.load(str(EXAMPLE))
    assert recipe.model.pretrained == str(tmp_path / "smollm2-135m-instruct")
    assert (recipe.objective.type, recipe.data.kind) == ("dpo", "preference")
    objective = build_objective(recipe.objective.type, recipe.objective.options)
    assert objective.beta == 0.1 and objective.loss_type == ("sigmoid",)
    assert recipe.lora is not None and recipe.lora.rank == 16
    assert "reference" not in recipe.objective.options  # with LoRA: the base with adapters off, no copy
    for source in (recipe.data.source, recipe.data.eval_source):
        assert (REPO / source).is_file(), source
    # every pair fits max_length (the longest is 82 SmolLM2 tokens): the recipe's comment says nothing is cut
    assert recipe.training.max_length >= 82
    again = Recipe.from_dict(recipe.to_dict())
    assert again == recipe
