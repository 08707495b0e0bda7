"""Reward-model training number for number with TRL 1.16's ``RewardTrainer``, run here.

A random tiny transformers ``LlamaForSequenceClassification`` (``num_labels=1``) is saved with a word-level
tokenizer; TRL's ``RewardTrainer`` and ours (a recipe with ``objective.type: reward``, and the Python
``RewardTrainer`` under TRL's argument names) take one step at learning rate 0 on the same eight text pairs,
each tokenizing them itself. The first logged step's loss, ``accuracy`` and ``margin`` must agree within 1e-4
relative (float32 both sides; a score is one dot product of a final hidden state, ~1e-6 apart between XLA and
torch), with an absolute floor of 1e-5 for figures near 0 (a margin).
"""

from __future__ import annotations

import json
import math

import pytest

from preference_testing import RAGGED_PAIRS, first_train_record, hf_reward_model

pytest.importorskip("trl")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore")

FIGURES = ("loss", "accuracy", "margin", "mean_reward")
#: TRL's optional ``margin`` column: one value per pair of RAGGED_PAIRS, mixed signs and sizes
MARGINS = (0.5, -0.25, 0.0, 1.5, 0.125, -1.0, 2.0, 0.75)


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("reward") / "rm")
    return folder, hf_reward_model(folder)


def _pairs(margins=None):
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in RAGGED_PAIRS]
    return rows if margins is None else [{**row, "margin": m} for row, m in zip(rows, margins)]


def _trl_first_log(folder, tokenizer, tmp_path, coefficient, margins=None):
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=1,
                        learning_rate=0.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                        seed=0, bf16=False, center_rewards_coefficient=coefficient)
    trainer = RewardTrainer(model=folder, args=args, train_dataset=Dataset.from_list(_pairs(margins)),
                            processing_class=tokenizer)
    trainer.train()
    return next(r for r in trainer.state.log_history if "loss" in r)


def _ours_by_recipe(folder, tmp_path, coefficient, margins=None):
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in _pairs(margins)))
    out = tmp_path / "run"
    run_training(Recipe.from_dict({
        "model": {"pretrained": folder},
        "data": {"source": str(source), "kind": "preference", "eval_fraction": 0.0},
        "objective": {"type": "reward", "center_rewards_coefficient": coefficient},
        "training": {"output_dir": str(out), "total_batch_size": 8, "max_length": 12, "learning_rate": 0.0,
                     "warmup_steps": 0, "max_training_steps": 1, "log_steps": 1, "do_eval": False,
                     "save_at_end": False, "progress_bar": False, "shuffle_train_dataset": False},
    }))
    return first_train_record(str(out))


def _ours_by_api(folder, tmp_path, coefficient, margins=None):
    import scaletrain as st

    args = st.RewardConfig(output_dir=str(tmp_path / "api"), total_batch_size=8, max_length=12, learning_rate=0.0,
                           warmup_steps=0, max_training_steps=1, log_steps=1, save_at_end=False, progress_bar=False,
                           shuffle_train_dataset=False, center_rewards_coefficient=coefficient)
    st.RewardTrainer(model=folder, args=args, train_dataset=_pairs(margins)).train()
    return first_train_record(args.output_dir)


@pytest.mark.parametrize("coefficient,ours,margins", [(None, _ours_by_recipe, None), (0.01, _ours_by_api, None),
                                                      (None, _ours_by_recipe, MARGINS)],
                         ids=["plain-recipe", "centred-api", "margin-column-recipe"])
def test_reward_loss_and_metrics_equal_trl_reward_trainer(reward_folder, tmp_path, coefficient, ours, margins):
    """The first step's figures equal TRL's; with TRL's ``margin`` column the loss is ``-log σ(r_c - r_r - m)``
    on both sides (the logged ``margin`` figure stays the mean ``r_c - r_r``)."""
    folder, tokenizer = reward_folder
    theirs = _trl_first_log(folder, tokenizer, tmp_path, coefficient, margins)
    mine = ours(folder, tmp_path, coefficient, margins)
    assert 0 < theirs["accuracy"] < 1  # a random model ranks some pairs right and some wrong
    for name in FIGURES:
        assert math.isclose(mine[name], theirs[name], rel_tol=1e-4, abs_tol=1e-5), (name, mine[name], theirs[name])


def test_eval_of_pairs_with_a_reward_model_folder_scores_trls_eval_accuracy_and_loss(reward_folder, tmp_path):
    """``scaletrain eval RM_FOLDER --data PAIRS --kind preference``: a reward model's folder scores held-out pairs
    by its own scores, with no option: TRL's ``RewardTrainer.evaluate()`` figures."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from scaletrain.eval_command import run_eval

    folder, tokenizer = reward_folder
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in _pairs()))
    ours = run_eval(folder, data=str(source), kind="preference", batch_size=8, max_length=12, progress=False)["data"]
    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_eval_batch_size=8, report_to="none",
                        use_cpu=True, bf16=False)
    theirs = RewardTrainer(model=folder, args=args, train_dataset=Dataset.from_list(_pairs()),
                           eval_dataset=Dataset.from_list(_pairs()), processing_class=tokenizer).evaluate()
    assert ours["objective"] == "reward"
    for name in ("eval_loss", "eval_accuracy", "eval_margin"):
        assert math.isclose(ours[name], theirs[name], rel_tol=1e-4, abs_tol=1e-5), (name, ours[name], theirs[name])


def test_a_reward_runs_checkpoint_exports_as_a_transformers_sequence_classifier(reward_folder, tmp_path):
    """``scaletrain export`` of a reward run writes the score head: transformers loads the folder as
    ``AutoModelForSequenceClassification`` and scores as the model it started from (learning rate 0)."""
    import numpy as np
    import transformers

    from scaletrain.export import export_checkpoint
    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    folder, tokenizer = reward_folder
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in _pairs()))
    out = tmp_path / "run"
    run_training(Recipe.from_dict({
        "model": {"pretrained": folder},
        "data": {"source": str(source), "kind": "preference", "eval_fraction": 0.0},
        "objective": {"type": "reward"},
        "training": {"output_dir": str(out), "total_batch_size": 8, "max_length": 12, "learning_rate": 0.0,
                     "warmup_steps": 0, "max_training_steps": 1, "log_steps": 1, "do_eval": False,
                     "save_at_end": True, "progress_bar": False},
    }))
    export_checkpoint(str(out), str(tmp_path / "export"))
    inputs = tokenizer(["what is two plus three five</s>", "say hello goodbye</s>"], return_tensors="pt",
                       padding=True)
    scores = []
    for path in (folder, str(tmp_path / "export")):
        model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
        with torch.no_grad():
            scores.append(model(**inputs).logits[:, 0].numpy())
    np.testing.assert_allclose(scores[1], scores[0], rtol=1e-5, atol=1e-6)
