"""``scaletrain eval TARGET --kind preference``: reward accuracy and margins with the run's objective and reference.

The run is a real ``scaletrain train`` of a tiny random Llama with DPO (a frozen copy of its
starting model as the reference, rebuilt here from the recipe and checked by its digest), 4
steps and an evaluation at the end. ``scaletrain eval RUN`` must give the run's final
``eval_rewards/*`` figures: the same rows, batches, mesh and jitted eval step, so they agree to
float32 rounding of the summed figures (1e-5 relative, 1e-6 absolute for figures near 0).
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from preference_testing import export, tiny_llama, word_tokenizer
from scaletrain.cli import main

PAIRS = [{"prompt": f"count to {a}", "chosen": f" {b} {a}", "rejected": f" {c}"}
         for a, b, c in [("one", "yes", "no"), ("two", "one", "five"), ("four", "three", "six"),
                         ("five", "four", "red"), ("six", "five", "blue"), ("seven", "six", "cat")]] * 4
FIGURES = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen",
           "eval_rewards/rejected", "eval_logps/chosen", "eval_logps/rejected")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("evalpref")
    word_tokenizer(str(work / "tok"))
    _jsonl(work / "pairs.jsonl", PAIRS)
    recipe = {
        "model": {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 4, "num_key_value_heads": 2},
        "tokenizer": {"path": str(work / "tok")},
        "data": {"kind": "preference", "source": str(work / "pairs.jsonl"), "eval_fraction": 0.25},
        "objective": {"type": "dpo", "beta": 0.5},
        "training": {"output_dir": str(work / "run"), "total_batch_size": 8, "max_length": 16,
                     "num_train_epochs": None, "max_training_steps": 4, "learning_rate": 1e-2, "log_steps": 2,
                     "evaluation_steps": None, "progress_bar": False, "report_to": []},
        "sample": {"max_new_tokens": 0},
    }
    (work / "dpo.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(work / "dpo.yaml")]) == 0
    word_tokenizer(export(tiny_llama(seed=3, layers=1), str(work / "hf")))  # a model folder with its tokenizer
    return work


def test_eval_of_a_dpo_run_equals_its_final_eval(work, tmp_path, capsys):
    run = work / "run"
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("split") == "eval"][-1]
    out = tmp_path / "eval.json"
    assert main(["eval", str(run), "--output", str(out), "--no-progress"]) == 0
    figures = json.loads(out.read_text())["data"]
    assert (figures["kind"], figures["objective"], figures["beta"]) == ("preference", "dpo", 0.5)
    assert figures["reference"] == "the run's starting model"
    assert abs(last["eval_rewards/margins"]) > 1e-3  # training moved the policy off its reference
    for name in FIGURES:
        assert math.isclose(figures[name], last[name], rel_tol=1e-5, abs_tol=1e-6), (name, figures[name], last[name])
    assert "eval_rewards/accuracies" in capsys.readouterr().out


def test_hf_folder_against_itself_as_reference_scores_log_two(work, tmp_path):
    """Policy = reference: every log-ratio is 0, so the margin and accuracy are 0 and the DPO loss is exactly ln 2."""
    folder = str(work / "hf")
    out = tmp_path / "self.json"
    assert main(["eval", folder, "--data", str(work / "pairs.jsonl"), "--kind", "preference", "--reference", folder,
                 "--beta", "0.3", "--max-length", "16", "--output", str(out), "--no-progress"]) == 0
    figures = json.loads(out.read_text())["data"]
    assert figures["rows"] == len(PAIRS) and figures["beta"] == 0.3
    assert figures["eval_rewards/margins"] == 0.0 and figures["eval_rewards/accuracies"] == 0.0
    assert math.isclose(figures["eval_loss"], math.log(2), rel_tol=1e-6)
    # ORPO reads no reference; KTO scores unpaired rows against one
    assert main(["eval", folder, "--data", str(work / "pairs.jsonl"), "--kind", "preference", "--objective", "orpo",
                 "--max-length", "16", "--output", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["data"]["reference"] is None
    kto = _jsonl(tmp_path / "kto.jsonl", [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                                          for p in PAIRS[:6] for side in ("chosen", "rejected")])
    assert main(["eval", folder, "--data", kto, "--kind", "unpaired_preference", "--reference", folder,
                 "--max-length", "16", "--output", str(out), "--no-progress"]) == 0
    figures = json.loads(out.read_text())["data"]
    assert figures["objective"] == "kto" and figures["eval_rewards/margins"] == 0.0


def test_eval_logs_the_number_of_pairs_it_scores(work, caplog):
    """``--data PAIRS --kind preference``: the log counts the 24 pairs scored, not the one-row stand-in training
    side the data is built beside (it said "1 preference pairs ... 1 train rows")."""
    import logging

    caplog.set_level(logging.INFO)
    source = str(work / "pairs.jsonl")
    assert main(["eval", str(work / "hf"), "--data", source, "--kind", "preference", "--objective", "orpo",
                 "--max-length", "16", "--no-progress"]) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert f"scoring {len(PAIRS)} preference pairs of {source} ({len(PAIRS)} rows of up to 16 tokens, " \
           "0 sequences cut)" in lines, lines
    assert not any("train rows" in line or "1 preference pairs" in line for line in lines), lines


@pytest.mark.parametrize("extra,message", [
    ([], "--reference DIR"),
    (["--reference", "/nonexistent"], "--reference /nonexistent: not a Hugging Face model folder"),
    (["--objective", "kto"], "--objective kto reads --kind unpaired_preference data"),
    (["--objective", "orpo", "--reference", "{folder}"], "reads no reference model; drop --reference"),
    (["--beta", "0"], "--beta 0.0: must be > 0"),
])
def test_bad_preference_options_are_one_message(work, tmp_path, capsys, extra, message):
    folder = str(work / "hf")
    extra = [e.replace("{folder}", folder) for e in extra]
    code = main(["eval", folder, "--data", str(work / "pairs.jsonl"), "--kind", "preference", "--max-length", "16",
                 "--no-progress", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_an_adapter_is_scored_against_its_base_with_adapters_off(work, tmp_path):
    """``--adapter`` without ``--reference``: the base with the adapters off, which is the base folder itself, so
    the figures equal ``--reference BASE``'s (two programs, one function: float32 rounding, 1e-5 relative)."""
    import jax
    import numpy as np
    from flax import nnx

    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.peft.adapter import save_peft_adapter
    from scaletrain.peft.lora import LoRAConfig, LoRAParam, apply_lora

    base = str(work / "hf")
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base), LoRAConfig(target_modules="all-linear"))
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(0.3 * rng.standard_normal(x.shape, np.float32),
                                                             x.sharding), nnx.state(model, LoRAParam)))
    adapter = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=base)
    common = ["eval", base, "--adapter", str(adapter), "--data", str(work / "pairs.jsonl"), "--kind", "preference",
              "--beta", "1", "--max-length", "16", "--no-progress", "--output"]
    assert main([*common, str(tmp_path / "off.json")]) == 0
    assert main([*common, str(tmp_path / "folder.json"), "--reference", base]) == 0
    off, folder = (json.loads((tmp_path / f"{n}.json").read_text())["data"] for n in ("off", "folder"))
    assert off["reference"] == "base (adapters off)" and folder["reference"] == base
    assert abs(off["eval_rewards/chosen"]) > 1e-3  # the adapter moved the policy off its base
    for name in FIGURES:
        assert math.isclose(off[name], folder[name], rel_tol=1e-5, abs_tol=1e-6), name
