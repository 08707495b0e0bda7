"""Preference objectives number for number with TRL 1.16 (DPO sigmoid and IPO, ORPO, CPO-SimPO, KTO), run here.

A random tiny Llama policy and a different random reference are exported to Hugging Face folders
(scaletrain's export) and loaded in torch for TRL. Each trainer takes one step at learning rate 0
on the same eight pairs; the first logged step's loss and every figure both log must agree within
1e-4 relative (float32 both sides). Our batches are built from TRL's own tokenized rows, so the
comparison is of the objectives, not of tokenization.

Tolerance: float32 log-probabilities summed over a completion are ~-5..-30 and are computed by two
programs (XLA, torch) with different summation orders: ~1e-6 relative each; a reward is β times a
difference of two of them, so its error is absolute (~1e-6), hence an absolute floor of 1e-5 for
figures that can be near 0 (margins).
"""

from __future__ import annotations

import math

import pytest

from preference_testing import (
    EVEN_PAIRS,
    RAGGED_PAIRS,
    export,
    first_train_record,
    fixed_rows,
    one_device_mesh,
    pair_row,
    tiny_llama,
    torch_model,
    word_tokenizer,
)

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_models")
    tok = word_tokenizer(str(root / "tok"))
    policy, reference = str(root / "policy"), str(root / "reference")
    export(tiny_llama(seed=0), policy)
    export(tiny_llama(seed=7), reference)
    for folder in (policy, reference):
        tok.save_pretrained(folder)
    return {"policy": policy, "reference": reference, "tokenizer": tok}


def _dataset(pairs):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])


def _trl_args(cls, out, **kw):
    return cls(output_dir=str(out), per_device_train_batch_size=8, max_steps=1, learning_rate=0.0, logging_steps=1,
               report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False, **kw)


def _trl_first_log(trainer):
    trainer.train()
    return next(r for r in trainer.state.log_history if "loss" in r)


def _rows_from_dpo(dataset):
    length = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in dataset)
    rows = []
    for r in dataset:
        p = r["prompt_ids"]
        rows.append(pair_row((p + r["chosen_ids"], [0] * len(p) + [1] * len(r["chosen_ids"])),
                             (p + r["rejected_ids"], [0] * len(p) + [1] * len(r["rejected_ids"])), length))
    return rows, length


def _rows_from_orpo(dataset):
    length = max(max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in dataset)
    rows = []
    for r in dataset:
        sides = [(r[f"{s}_input_ids"], [int(x != -100) for x in r[f"{s}_labels"]]) for s in ("chosen", "rejected")]
        assert all(sum(r[f"{s}_attention_mask"]) == len(r[f"{s}_input_ids"]) for s in ("chosen", "rejected"))
        rows.append(pair_row(*sides, length))
    return rows, length


def _ours(policy, tmp_path, rows, length, objective, reference=None):
    import scaletrain as st
    from scaletrain.preference.trainer import PreferenceTrainer

    args = st.TrainingArguments(output_dir=str(tmp_path / "ours"), total_batch_size=8, max_length=length,
                                learning_rate=0.0, max_training_steps=1, log_steps=1, save_at_end=False,
                                progress_bar=False, shuffle_train_dataset=False)
    trainer = PreferenceTrainer(args, model=st.AutoModelForCausalLM.from_pretrained(policy, mesh=one_device_mesh()),
                                dataset_train=fixed_rows(rows), objective=objective,
                                reference=reference)
    trainer.train()
    return first_train_record(args.output_dir)


def _compare(ours, theirs, names):
    checked = []
    for name in names:
        assert name in theirs, (name, sorted(theirs))
        assert name in ours, (name, sorted(ours))
        assert math.isclose(ours[name], theirs[name], rel_tol=1e-4, abs_tol=1e-5), (name, ours[name], theirs[name])
        checked.append(name)
    return checked


REWARD_FIGURES = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                  "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["ipo"]])
def test_dpo_matches_trl(folders, tmp_path, loss_type):
    from trl import DPOConfig, DPOTrainer

    from scaletrain.objectives.dpo import DPOObjective

    trainer = DPOTrainer(model=torch_model(folders["policy"]), ref_model=torch_model(folders["reference"]),
                         args=_trl_args(DPOConfig, tmp_path / "trl", beta=0.1, loss_type=loss_type,
                                        max_length=None),
                         train_dataset=_dataset(RAGGED_PAIRS), processing_class=folders["tokenizer"])
    theirs = _trl_first_log(trainer)
    rows, length = _rows_from_dpo(trainer.train_dataset)
    ours = _ours(folders["policy"], tmp_path, rows, length, DPOObjective(beta=0.1, loss_type=tuple(loss_type)),
                 reference=folders["reference"])
    assert 0 < theirs["rewards/accuracies"] < 1  # the random pair of models disagree on some pairs
    _compare(ours, theirs, REWARD_FIGURES + ["entropy", "mean_token_accuracy"])


def test_orpo_matches_trl(folders, tmp_path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from scaletrain.objectives.orpo import ORPOObjective

    trainer = ORPOTrainer(model=torch_model(folders["policy"]),
                          args=_trl_args(ORPOConfig, tmp_path / "trl", beta=0.2),
                          train_dataset=_dataset(EVEN_PAIRS), processing_class=folders["tokenizer"])
    theirs = _trl_first_log(trainer)
    rows, length = _rows_from_orpo(trainer.train_dataset)
    ours = _ours(folders["policy"], tmp_path, rows, length, ORPOObjective(beta=0.2))
    _compare(ours, theirs, REWARD_FIGURES + ["nll_loss", "log_odds_ratio", "log_odds_chosen"])


def test_simpo_matches_trl_cpo(folders, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from scaletrain.objectives.orpo import CPOObjective

    trainer = CPOTrainer(model=torch_model(folders["policy"]),
                         args=_trl_args(CPOConfig, tmp_path / "trl", loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                                        cpo_alpha=0.5),
                         train_dataset=_dataset(EVEN_PAIRS), processing_class=folders["tokenizer"])
    theirs = _trl_first_log(trainer)
    rows, length = _rows_from_orpo(trainer.train_dataset)
    ours = _ours(folders["policy"], tmp_path, rows, length, CPOObjective(loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5))
    _compare(ours, theirs, REWARD_FIGURES + ["nll_loss"])


def _rows_from_kto(dataset):
    """Our unpaired rows (each with its KL row) from TRL's tokenized KTO rows."""
    from preference_testing import pad_row

    length = max(len(r["prompt_ids"]) + max(len(r["completion_ids"]), len(r["KL_completion_ids"])) for r in dataset)
    rows = []
    for r in dataset:
        p, row = r["prompt_ids"], {"label": int(r["label"])}
        for prefix, key in (("", "completion_ids"), ("kl_", "KL_completion_ids")):
            ids, seg, mask = pad_row(p + r[key], [0] * len(p) + [1] * len(r[key]), length)
            row.update({f"{prefix}input_ids": ids, f"{prefix}segment_ids": seg, f"{prefix}loss_mask": mask})
        rows.append(row)
    return rows, length


def test_kto_matches_trl(folders, tmp_path):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from scaletrain.objectives.kto import KTOObjective

    unpaired = [{"prompt": p, "completion": c, "label": label} for p, good, bad in RAGGED_PAIRS[:4]
                for c, label in ((good, True), (bad, False))]
    # the two models swapped: with this pair the KL estimate is positive (with the other it is clamped to 0)
    policy, reference = folders["reference"], folders["policy"]
    trainer = KTOTrainer(model=torch_model(policy), ref_model=torch_model(reference),
                         args=_trl_args(KTOConfig, tmp_path / "trl", beta=0.3, desirable_weight=1.0,
                                        undesirable_weight=1.5, max_length=None),
                         train_dataset=Dataset.from_list(unpaired), processing_class=folders["tokenizer"])
    theirs = _trl_first_log(trainer)
    rows, length = _rows_from_kto(trainer.train_dataset)
    ours = _ours(policy, tmp_path, rows, length,
                 KTOObjective(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5), reference=reference)
    assert theirs["kl"] > 0  # the KL estimate is not clamped away: the comparison covers it
    _compare(ours, theirs, [f for f in REWARD_FIGURES if f != "rewards/accuracies"] + ["kl", "entropy"])


# ---- the whole run, from TRL-format rows, with no preparation option (issue 45, item 14) ---------------------------
@pytest.fixture(scope="module")
def bos_folder(folders, tmp_path_factory):
    """The policy with a tokenizer that has a bos token (never added by the tokenizer itself, as SmolLM2's): TRL's
    ORPO/CPO trainers put it before every prompt, its DPOTrainer does not, so the two preparations differ."""
    import shutil

    from preference_testing import word_tokenizer

    folder = str(tmp_path_factory.mktemp("bos") / "policy")
    shutil.copytree(folders["policy"], folder)
    return folder, word_tokenizer(folder, bos=True)


def _run_recipe(folder, tmp_path, objective):
    """Our first logged step of a recipe that names only the objective and the data kind."""
    import json

    import yaml

    from scaletrain.recipe import Recipe
    from scaletrain.run import run_training

    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in EVEN_PAIRS))
    out = tmp_path / "run"
    recipe = Recipe.from_dict({
        "model": {"pretrained": folder},
        "data": {"source": str(source), "kind": "preference", "eval_fraction": 0.0},
        "objective": objective,
        "training": {"output_dir": str(out), "total_batch_size": 8, "max_length": 7, "learning_rate": 0.0,
                     "warmup_steps": 0, "max_training_steps": 1, "log_steps": 1, "do_eval": False,
                     "save_at_end": False, "progress_bar": False, "shuffle_train_dataset": False},
    })
    run_training(recipe)
    recorded = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recorded["data"]["preparation"] == "trl_orpo"  # what the run did, recorded
    return first_train_record(str(out))


@pytest.mark.parametrize("objective,trl", [
    ({"type": "orpo", "beta": 0.2}, {"beta": 0.2}),
    ({"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5},
     {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5}),
], ids=["orpo", "simpo"])
def test_orpo_and_simpo_first_step_equals_trl_with_no_extra_option(bos_folder, tmp_path, objective, trl):
    """``objective.type: orpo`` / ``simpo`` and TRL-format rows, nothing else: the first step's figures are TRL's
    ORPOTrainer's / CPOTrainer's (rows prepared as they prepare them, bos before the prompt)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    folder, tokenizer = bos_folder
    config, trainer_class = (ORPOConfig, ORPOTrainer) if objective["type"] == "orpo" else (CPOConfig, CPOTrainer)
    trainer = trainer_class(model=torch_model(folder), args=_trl_args(config, tmp_path / "trl", **trl),
                            train_dataset=_dataset(EVEN_PAIRS), processing_class=tokenizer)
    assert all(r["chosen_input_ids"][0] == tokenizer.bos_token_id for r in trainer.train_dataset)  # the difference
    theirs = _trl_first_log(trainer)
    ours = _run_recipe(folder, tmp_path, objective)
    extra = ["nll_loss", "log_odds_ratio", "log_odds_chosen"] if objective["type"] == "orpo" else ["nll_loss"]
    _compare(ours, theirs, REWARD_FIGURES + extra)


def test_eval_of_pairs_with_objective_orpo_prepares_them_as_trl_and_scores_trls_eval_loss(bos_folder, tmp_path):
    """``scaletrain eval FOLDER --data PAIRS --kind preference --objective orpo``: the pairs are prepared as the
    ORPO run (and TRL's ORPOTrainer) prepares them, with no option, so the loss is TRL's evaluation loss."""
    import json

    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from scaletrain.eval_command import run_eval
    from scaletrain.eval_preference import PreferenceOptions

    folder, tokenizer = bos_folder
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in EVEN_PAIRS))

    def eval_loss(**keys):
        return run_eval(folder, data=str(source), kind="preference", data_keys=keys, progress=False,
                        preference=PreferenceOptions(objective="orpo", beta=0.1))["data"]["eval_loss"]

    trainer = ORPOTrainer(model=torch_model(folder), args=_trl_args(ORPOConfig, tmp_path / "trl", beta=0.1),
                          eval_dataset=_dataset(EVEN_PAIRS), train_dataset=_dataset(EVEN_PAIRS),
                          processing_class=tokenizer)
    theirs = trainer.evaluate()["eval_loss"]
    ours = eval_loss()
    assert math.isclose(ours, theirs, rel_tol=1e-4), (ours, theirs)
    assert ours == eval_loss(preparation="trl_orpo") and not math.isclose(ours, eval_loss(preparation="trl_dpo"),
                                                                            rel_tol=1e-4)
