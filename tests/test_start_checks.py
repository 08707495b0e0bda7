"""What a new user meets at start: checks before any data, refused starts that leave no trace,
the step budget, recipe mistakes named where they are (issue 35, items 2, 4-7, 9, 10).

Each test fails on the code before the fix: a refused resume rewrote ``data_stats.json`` and a
refused start left a new folder behind; problems that need no data were found one per start,
each after tokenizing; ``max_steps=20`` trained one epoch of 4 steps without a word; a YAML key
given twice silently kept the last; a bad override was blamed on the recipe file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

import scaletrain as st
from data_helpers import PLAIN_TEMPLATE
from folder_testing import tree_hash
from scaletrain.errors import ConfigError, DataError, ScaletrainError
from scaletrain.recipe import Recipe
from scaletrain.run import run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _recipe(out, **sections) -> Recipe:
    """A LoRA run of a tiny Llama on one bundled play: seconds, with a checkpoint at its end."""
    base = {
        "model": dict(TINY),
        "data": {"max_documents": 1, "eval_fraction": 0.0},
        "tokenizer": {"path": "bundled"},
        "training": {"output_dir": str(out), "total_batch_size": 8, "max_length": 64, "num_train_epochs": None,
                     "max_training_steps": 2, "progress_bar": False, "do_eval": False, "report_to": []},
        "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
    }
    for name, keys in sections.items():
        base[name] = {**base.get(name, {}), **keys} if isinstance(keys, dict) else keys
    return Recipe.from_dict(base)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("start") / "run"
    summary = run_training(_recipe(out))
    return out, summary


def _refused(recipe: Recipe, match: str) -> str:
    """Start ``recipe``, expect a refusal matching ``match``; its output folder must be as it was."""
    out = recipe.training.output_dir
    before = tree_hash(out) if os.path.exists(out) else None
    with pytest.raises(ScaletrainError, match=match) as err:
        run_training(recipe)
    assert (tree_hash(out) if os.path.exists(out) else None) == before  # byte for byte, or still absent
    return str(err.value)


# ---- item 2: a refused start leaves every byte as it was, and creates nothing ------------------
def test_a_refused_resume_leaves_the_run_byte_for_byte(lora_run):
    out, _ = lora_run
    stats = (out / "data_stats.json").read_text()
    recipe = _recipe(out, model={"hidden_size": 64}, training={"resume_if_possible": True},
                     data={"max_documents": 2})
    msg = _refused(recipe, "was saved from another model")
    assert "model.hidden_size=64 (saved: 32)" in msg
    assert (out / "data_stats.json").read_text() == stats


def test_a_refused_start_creates_nothing_where_there_was_nothing(tmp_path):
    out = tmp_path / "new" / "deeper" / "run"
    _refused(_recipe(out, lora={"target_modules": ["not_a_layer"]}), "matches no linear layer")
    assert not (tmp_path / "new").exists()


# ---- item 7: checks that need no data, all before reading it, in one message ------------------
def test_checks_that_need_no_data_report_together_before_any_data_is_read(lora_run, tmp_path):
    out, _ = lora_run
    recipe = _recipe(out, data={"source": str(tmp_path / "never-read.jsonl")},  # reading it would fail
                     training={"total_batch_size": 6}, mesh={"axis_dims": [1, 4, 2, 1, 1]},
                     lora={"target_modules": ["qkv"]})
    msg = _refused(recipe, "this recipe cannot start")
    assert "(4 problems)" in msg, msg
    assert "training.total_batch_size=6 must be divisible by the batch mesh axes" in msg
    assert "puts 2 devices on ep (expert parallelism), but llama has no experts" in msg
    assert "lora.target_modules=('qkv',) matches no linear layer" in msg
    assert "already holds checkpoints [2]; set training.resume_if_possible=true" in msg
    assert "never-read" not in msg


def test_a_pretrained_folder_without_config_is_named_before_the_data(tmp_path):
    recipe = _recipe(tmp_path / "run", model={"type": "llama", "pretrained": str(tmp_path)},
                     data={"source": str(tmp_path / "never-read.jsonl")})
    recipe.model.model_extra.clear()  # no architecture keys beside a pretrained folder
    _refused(recipe, "config.json: missing")


def test_a_lora_rank_change_on_resume_names_lora_rank(lora_run):
    out, _ = lora_run
    msg = _refused(_recipe(out, lora={"rank": 8}, training={"resume_if_possible": True}), "lora.rank=8 ")
    assert "(saved: 4)" in msg and len(msg) < 400


def test_a_mesh_for_more_devices_than_there_are_says_so_in_english():
    from scaletrain.parallel.mesh import resolve_axis_dims

    with pytest.raises(ConfigError, match=r"mesh.axis_dims \[2, 1, 1, 1, 1\] uses 2 devices but 1 device is "):
        resolve_axis_dims((2, 1, 1, 1, 1), 1, name="mesh.axis_dims")


# ---- item 9: LoRA counts --------------------------------------------------------------------------
def test_lora_parameter_counts_say_trainable_of_total(lora_run):
    _, summary = lora_run
    trainable, total = summary["num_trainable_params"], summary["num_params"]
    adapters = 4 * (32 + 32) + 4 * (32 + 16)  # rank x (in + out): q_proj [32->32], v_proj [32->16]
    assert trainable == adapters and total > 100 * trainable
    from scaletrain.training.outputs import format_parameter_counts

    assert format_parameter_counts(trainable, total).startswith(f"{trainable:,} trainable of ")


# ---- item 5: an explicit step budget wins over the default epoch count ----------------------------
def _rows(n=32):
    rng = np.random.default_rng(0)
    return [{"input_ids": (rng.integers(0, 128) + np.arange(16)) % 128} for _ in range(n)]


def test_an_explicit_step_budget_wins_over_the_default_epochs(tmp_path, capsys, monkeypatch):
    assert st.TrainingArguments(max_steps=20).num_train_epochs is None  # HF's name, as HF means it
    assert st.TrainingArguments(max_training_steps=20, num_train_epochs=1).num_train_epochs == 1  # both explicit
    later = st.TrainingArguments()
    later.max_training_steps = 20
    assert later.num_train_epochs is None
    later.max_training_steps = None
    assert later.num_train_epochs == 1
    assert st.TrainingArguments().num_train_epochs == 1

    from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

    cfg = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = create_sharded_model(LlamaForCausalLM, cfg, seed=0)[0]
    args = st.TrainingArguments(output_dir=str(tmp_path / "run"), total_batch_size=8, max_length=16,
                                max_steps=10, progress_bar=False, do_eval=False, save_at_end=False, report_to=[])
    # as in a script that never set up logging (pytest's own handlers on the root logger stay out of reach)
    monkeypatch.setattr(logging.getLogger("scaletrain"), "propagate", False)
    trainer = st.Trainer(args, model=model, dataset_train=_rows())  # 4 steps per epoch
    assert trainer.train() and trainer.summary["final_step"] == 10
    plan = capsys.readouterr().err  # printed without any logging set up, as the CLI logs it
    assert "run plan" in plan and "0 -> 10 (max_training_steps=10; 4 steps per epoch, epochs not limited)" in plan


def test_both_budgets_explicit_the_smaller_is_said():
    from scaletrain.training.outputs import horizon_reason

    args = st.TrainingArguments(max_training_steps=20, num_train_epochs=1)
    assert "the smaller of max_training_steps=20 and num_train_epochs=1 x 4 steps per epoch = 4" in \
        horizon_reason(args, 4, 1)


# ---- items 4 and 6: recipe mistakes named where they are ------------------------------------------
def test_a_key_given_twice_in_a_recipe_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("training:\n  learning_rate: 0.1\n  max_training_steps: 3\n  learning_rate: 0.2\n")
    with pytest.raises(ConfigError, match=rf"{path}: line 4: key 'learning_rate' is given twice .*first on line 2"):
        Recipe.load(str(path))


def test_a_bad_override_is_named_and_a_misspelled_section_gets_a_suggestion(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("traning:\n  max_training_steps: 3\n")
    with pytest.raises(ConfigError) as err:
        Recipe.load(str(path), ["training.max_training_steps=abc", "mesh.axis_dim=[1,2]"])
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: invalid recipe"
    assert "traning: unknown key; did you mean 'training'?" in lines
    assert any(x.startswith("training.max_training_steps:") and "[command-line override "
               "'training.max_training_steps=abc']" in x for x in lines)
    assert "mesh.axis_dim: unknown key; did you mean 'axis_dims' or 'axis_names'? [command-line override " \
           "'mesh.axis_dim=[1,2]']" in lines
    good = tmp_path / "good.yaml"
    good.write_text("training:\n  max_training_steps: 3\n")
    with pytest.raises(ConfigError, match=r"^invalid command-line override \(recipe "):
        Recipe.load(str(good), ["training.max_training_steps=abc"])


def test_a_conversation_ending_with_a_user_turn_is_refused_or_skipped(tmp_path):
    from scaletrain.data.build import build_datasets
    from scaletrain.data.config import DataSection
    from scaletrain.data.prepared import resolve_tokenizer_path
    from scaletrain.data.tokenizer import load_processor

    source = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    bad = {"messages": [*good["messages"], {"role": "user", "content": "And then?"}]}
    source.write_text("\n".join(json.dumps(r) for r in [good] * 6 + [bad] + [good] * 6) + "\n")
    tok = load_processor(resolve_tokenizer_path("bundled"))
    data = DataSection(source=str(source), kind="chat", eval_fraction=0.0, chat_template=PLAIN_TEMPLATE)
    with pytest.raises(DataError, match=r"chat.jsonl: row 7: the conversation ends with a user turn \(message 2\)"):
        build_datasets(data, tok, max_length=64)
    splits = build_datasets(data.model_copy(update={"skip_bad_rows": True}), tok, max_length=64)
    assert splits.stats["bad_rows_skipped"] == 1


def test_conversations_read_as_text_suggest_kind_chat(tmp_path):
    from scaletrain.data.build import build_datasets
    from scaletrain.data.config import DataSection
    from scaletrain.data.prepared import resolve_tokenizer_path
    from scaletrain.data.tokenizer import load_processor

    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(DataError, match="these look like conversations: set data.kind: chat"):
        build_datasets(DataSection(source=str(source)), load_processor(resolve_tokenizer_path("bundled")), max_length=64)


# ---- item 10: Ctrl-C, the compile cache's folder ---------------------------------------------------
def test_ctrl_c_outside_training_is_one_line_and_status_130(monkeypatch, capsys):
    from scaletrain import cli

    def interrupted(ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_plot", interrupted)
    assert cli.main(["plot", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "scaletrain: interrupted" and "Traceback" not in err


def test_scaletrain_cache_moves_the_default_compile_cache(monkeypatch, tmp_path):
    from scaletrain.compile_cache import DEFAULT_DIR, cache_dir

    monkeypatch.delenv("SCALETRAIN_CACHE", raising=False)
    assert cache_dir(DEFAULT_DIR) == os.path.expanduser("~/.cache/scaletrain/jax")
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    assert cache_dir(DEFAULT_DIR) == str(tmp_path / "jax")
    assert cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")  # a folder of the user's own stays


def test_the_cli_refusal_is_one_message_with_status_2(lora_run):
    out, _ = lora_run
    before = tree_hash(out)
    recipe = os.path.join(ROOT, "examples", "shakespeare.yaml")
    res = subprocess.run([sys.executable, "-m", "scaletrain", "train", recipe, f"training.output_dir={out}",
                          "training.resume_if_possible=true", "model.hidden_size=64", "data.max_documents=2"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "scaletrain: error: this recipe cannot start" in res.stderr
    assert tree_hash(out) == before
    assert yaml.safe_load((out / "recipe.yaml").read_text())["model"]["hidden_size"] == 32
