"""Preference pairs longer than ``training.max_length`` (issue 45, item 26): by default they are cut as TRL 1.16
cuts them (``keep_start``), a pair whose prompt alone fills ``max_length`` is refused with one line naming its row
(TRL drops it), and every cut is counted at WARNING level, saying what the cut rows lose.

The bundled tokenizer (GPT-2-style byte-level BPE, eos ``<|endoftext|>``) and text pairs: no model is built, the
data is refused or cut before any.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import yaml
from data_helpers import REPO

from scaletrain.data import bundled_tokenizer_path, load_processor
from scaletrain.recipe import Recipe
from scaletrain.run import load_datasets

MAX_LENGTH = 16
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 3)  # well over MAX_LENGTH tokens alone
FITTING = [{"prompt": f"{n} plus one is", "chosen": f" {n + 1}", "rejected": f" {n + 2}"} for n in range(8)]
# a batch's worth of pairs (8, the fake devices' batch) besides the long one, so that the recipe would train
PAIRS = [FITTING[0], {"prompt": LONG_PROMPT + ". What did the fox do?", "chosen": " It jumped.",
                      "rejected": " It slept."}, *FITTING[1:]]
SHORT_PAIRS = [FITTING[0], {"prompt": "Say", "chosen": " hello" + " and hello" * 12, "rejected": " no"}, *FITTING[1:]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_processor(bundled_tokenizer_path())


def _source(tmp_path, pairs) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return str(path)


def _recipe(tmp_path, pairs, objective="dpo", **training) -> dict:
    return {
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096},
        "tokenizer": {"path": "bundled"},
        "data": {"source": _source(tmp_path, pairs), "kind": "preference", "eval_fraction": 0.0},
        "objective": {"type": objective},
        "training": {"output_dir": str(tmp_path / "run"), "total_batch_size": 8, "max_length": MAX_LENGTH,
                     "max_training_steps": 1, "progress_bar": False, **training},
    }


def _cut_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and " cut " in r.getMessage()]


def test_a_pair_whose_prompt_fills_max_length_is_refused_naming_its_row_with_no_option(tmp_path):
    """The issue's repro: a DPO recipe with no truncation option and one over-long prompt. It used to train (keep_end
    cut the prompt's start, said in an INFO line); now it is one line naming the row, exit 2, and nothing written."""
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, PAIRS)))
    done = subprocess.run([sys.executable, "-m", "scaletrain", "train", str(recipe)], capture_output=True, text=True,
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    named = [line for line in done.stderr.splitlines() if "row 2" in line]
    assert len(named) == 1, done.stderr[-2000:]
    assert f"pairs.jsonl: row 2: the prompt is" in named[0]
    assert f"fills training.max_length={MAX_LENGTH}" in named[0] and "data.skip_bad_rows" in named[0]
    assert not (tmp_path / "run" / "recipe.yaml").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_pairs_cut_under_keep_end_lose_their_prompt_start_and_are_counted_at_warning_level(tmp_path, tokenizer,
                                                                                            caplog):
    recipe = Recipe.from_dict(_recipe(tmp_path, PAIRS, truncation_mode="keep_end"))
    with caplog.at_level(logging.WARNING):
        splits = load_datasets(recipe, tokenizer)
    assert splits.stats["train_rows"] == 9 and splits.stats["train_rows_cut"] == 1
    prompt_start = tokenizer(PAIRS[1]["prompt"])["input_ids"][:4]
    assert splits.train.columns["chosen_input_ids"][1][:4].tolist() != prompt_start  # trained without its start
    (warning,) = _cut_warnings(caplog)
    assert warning.startswith(f"training.max_length={MAX_LENGTH} cut 1 of 9 preference pairs (keep_end: each lost "
                              "its start, the prompt's first tokens")
    assert "pairs.jsonl: row 2" in warning and "raise training.max_length" in warning


@pytest.mark.parametrize("objective,loses", [("dpo", "keep_start: the end of a completion is not trained on"),
                                             ("orpo", "as TRL's ORPO/CPO trainers: the end of a completion")])
def test_pairs_cut_by_default_lose_their_completion_end_and_are_counted_at_warning_level(tmp_path, tokenizer, caplog,
                                                                                          objective, loses):
    recipe = Recipe.from_dict(_recipe(tmp_path, SHORT_PAIRS, objective))
    with caplog.at_level(logging.WARNING):
        splits = load_datasets(recipe, tokenizer)
    ids, mask = (splits.train.columns[f"chosen_{k}"][1] for k in ("input_ids", "loss_mask"))
    assert tokenizer.decode(ids[mask == 0]).endswith("Say")  # the prompt kept whole (ORPO: after its bos)
    assert mask[-1] == 1  # the completion runs to max_length: its end is what was cut
    (warning,) = _cut_warnings(caplog)
    assert f"cut 1 of 9 preference pairs ({loses}" in warning and "pairs.jsonl: row 2" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_datasets(Recipe.from_dict(_recipe(tmp_path, FITTING, objective)), tokenizer)
    assert not _cut_warnings(caplog)  # nothing cut, nothing said
