"""In-loop evaluation (``eval_harness`` in a recipe): lm-eval tasks and eval data sets every N steps.

A 4-step run scores a local multiple-choice task and a JSONL data set at steps 2 and 4; the
records sit in metrics.jsonl beside the loss, with their cost in seconds, and the data set's
figures at the last step are those ``scaletrain eval RUN --data`` gives for the saved checkpoint
(same rows, same eval step: 1e-6 relative, float32 sums).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from eval_testing import task_yamls
from scaletrain.cli import main
from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "shakespeare.yaml")
TINY = ["training.max_training_steps=4", "training.log_steps=2", "training.evaluation_steps=null",
        "training.max_evaluation_steps=1", "training.total_batch_size=8", "training.max_length=64",
        "data.max_documents=2", "data.eval_fraction=0.1", "model.num_hidden_layers=1", "model.hidden_size=32",
        "model.intermediate_size=64", "sample.max_new_tokens=0", "training.progress_bar=false"]


def test_harness_tasks_and_data_sets_every_n_steps(tmp_path):
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    tasks = task_yamls(tmp_path)
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(json.dumps({"text": f"KING. Speak, line {i}, and be heard."}) for i in range(24)))
    out = tmp_path / "run"
    assert main(["train", RECIPE, f"training.output_dir={out}", *TINY, "eval_harness.tasks=[st_mc]",
                 f"eval_harness.include_path={tasks}", "eval_harness.every_steps=2",
                 f"eval_harness.data=[{{name: held, source: {held}}}]"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    harness = [r for r in records if r.get("split") == "harness"]
    assert [r["step"] for r in harness] == [2, 4]  # at_end does not repeat step 4
    for r in harness:
        assert 0.0 <= r["st_mc/acc"] <= 1.0 and r["seconds"] > 0 and r["held/tokens"] > 24 * 8
        assert math.isfinite(r["held/loss"]) and "held/bits_per_byte" in r
    assert harness[0]["held/loss"] != harness[1]["held/loss"]  # the current state, not the first one
    assert any(r.get("split", "train") == "train" and r["step"] == 4 and "loss" in r for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("harness/st_mc/acc")} == pytest.approx(
        {r["step"]: r["st_mc/acc"] for r in harness})
    assert [e.step for e in board.Scalars("harness/seconds")] == [2, 4]

    report = tmp_path / "after.json"
    assert main(["eval", str(out), "--data", str(held), "--output", str(report), "--no-progress"]) == 0
    after = json.loads(report.read_text())["data"]
    assert math.isclose(after["eval_loss"], harness[1]["held/loss"], rel_tol=1e-6)
    assert after["eval_tokens"] == harness[1]["held/tokens"]


def test_the_section_is_checked_with_the_recipe(tmp_path):
    with pytest.raises(ConfigError, match="eval_harness.every_steps"):
        Recipe.load(RECIPE, ["eval_harness.every_steps=0"])
    with pytest.raises(ConfigError, match="eval_harness.tastks"):
        Recipe.load(RECIPE, ["eval_harness.tastks=[x]"])
    assert "eval_harness" not in Recipe.load(RECIPE).to_dict()  # unset: recipe.yaml reads as before


def test_an_unknown_task_fails_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", RECIPE, f"training.output_dir={out}", *TINY, "eval_harness.tasks=[no_such_task]",
                 f"eval_harness.include_path={task_yamls(tmp_path)}"]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists() or "loss" not in (out / "metrics.jsonl").read_text()
