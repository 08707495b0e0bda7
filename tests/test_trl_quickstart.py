"""TRL's own quick-start scripts run on scaletrain with only the import line changed.

The scripts are read from the installed TRL's README (its package metadata), not copied here, so
this tests what TRL documents. Nothing may reach a hub, so two more lines change, and only
those: the model id becomes a local tiny model folder (a random Llama with a word-level tokenizer
and a chat template, written by ``save_pretrained``) and the hub dataset becomes a local JSON file in
the same TRL format as the named dataset (conversational, implicit prompt for ultrafeedback;
prompt + solution for DeepMath; prompt / completion / label for kto-mix). The GRPO script's reward is
TRL's own ``trl.rewards.accuracy_reward`` (``math_verify``, in the test extra), called by our trainer.

Beside the scripts: the other things TRL's trainers take (a path, a list of dicts, a
``peft.LoraConfig``) give the rows and adapters the recipe path gives, and what cannot be mapped
is one error naming the field.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re

import numpy as np
import pytest

from preference_testing import export, tiny_llama, word_tokenizer

pytest.importorskip("trl")
pytest.importorskip("datasets")

# a chat template in the word tokenizer's own words: each turn's content and </s>
TEMPLATE = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"

PAIRS = [("what is two plus three", "five", "six seven"), ("the sky colour", "blue", "green red"),
         ("say hello", "hello world", "goodbye"), ("name a fruit", "apple", "stone stone"),
         ("count to four", "one two three four", "one"), ("is the cat a dog", "no", "yes maybe"),
         ("what is two plus two", "four", "five six"), ("the dog", "runs", "sits sits")]


def _turns(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny random Llama and its tokenizer in one folder, as ``save_pretrained`` writes a hub model."""
    out = str(tmp_path_factory.mktemp("hub") / "tiny-chat-llama")
    export(tiny_llama(0, max_position_embeddings=512), out)
    tok = word_tokenizer(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def trl_quick_start(trainer: str) -> str:
    """The ```python block under ``### `<trainer>` `` in the installed TRL's README."""
    readme = importlib.metadata.metadata("trl").get_payload()
    section = readme.split(f"### `{trainer}`", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def run_script(script: str, replacements: dict[str, str], cwd) -> dict:
    """Apply ``replacements`` (each must occur exactly once) and run the script in ``cwd``."""
    for old, new in replacements.items():
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    namespace: dict = {"__name__": "__main__"}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(script, "<trl quick start>", "exec"), namespace)
    finally:
        os.chdir(here)
    return namespace


def _train_records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("split") == "train"]


def _final_step(run_dir) -> int:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["final_step"]


def _dataset_line(script: str) -> str:
    return re.search(r'load_dataset\("[^"]+", split="train"\)', script).group(0)


def _model_id(script: str) -> str:
    return re.search(r'model=("[^"]+")', script).group(1)


def test_trl_dpo_quick_start_trains_with_only_the_import_line_changed(folder, tmp_path):
    # ultrafeedback_binarized's format: conversational chosen / rejected, the prompt implicit (their shared start)
    data = _write_jsonl(tmp_path / "ultrafeedback.jsonl",
                        [{"chosen": _turns(p, c), "rejected": _turns(p, r)} for p, c, r in PAIRS])
    script = trl_quick_start("DPOTrainer")
    run_script(script, {"from trl import DPOTrainer": "from scaletrain import DPOTrainer",
                        _model_id(script): repr(folder),
                        _dataset_line(script): f'load_dataset("json", data_files={data!r}, split="train")'},
               tmp_path)
    run_dir = tmp_path / "tiny-chat-llama-DPO"  # TRL's default output_dir: <model name>-DPO
    assert _final_step(run_dir) == 1  # 8 pairs, a default batch of 8, one epoch: one step
    first = _train_records(run_dir)[0]
    # the policy starts as its reference (a copy): DPO's loss is ln 2 and every reward 0 at the first step
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0


def test_trl_grpo_quick_start_trains_with_only_the_import_line_changed(folder, tmp_path):
    # DeepMath-103K's format: a conversational prompt and a solution column the reward reads (math answers, which
    # math_verify parses: a solution it cannot parse would make TRL's reward return None and skip the row)
    solutions = ["5", "4"]
    data = _write_jsonl(tmp_path / "deepmath.jsonl",
                        [{"prompt": [{"role": "user", "content": p}], "solution": a}
                         for (p, _, _), a in zip([PAIRS[0], PAIRS[6]], solutions)])
    script = trl_quick_start("GRPOTrainer")
    assert "reward_funcs=accuracy_reward" in script
    run_script(script, {"from trl import GRPOTrainer": "from scaletrain import GRPOTrainer",
                        _model_id(script): repr(folder),
                        _dataset_line(script): f'load_dataset("json", data_files={data!r}, split="train")'},
               tmp_path)
    run_dir = tmp_path / "tiny-chat-llama-GRPO"
    assert _final_step(run_dir) == 2  # 2 prompts, 8 completions each (TRL's num_generations), one prompt a step
    records = _train_records(run_dir)
    # a random word-level model writes no number: TRL's math check scored every completion 0 (not None: the
    # solutions parse), and our trainer logged it under TRL's name
    assert all(r["reward"] == 0.0 and r["rewards/accuracy_reward/mean"] == 0.0 for r in records)
    # completions are logged on logging steps, every log_completions_steps=10 as TRL's: a 2-step run logs none
    assert not (run_dir / "completions.jsonl").exists()


def test_trl_kto_quick_start_trains_with_only_the_import_line_changed(folder, tmp_path):
    # kto-mix-14k's format: conversational prompt / completion and a boolean label
    rows = [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": a}],
             "label": label} for p, c, r in PAIRS for a, label in ((c, True), (r, False))]
    data = _write_jsonl(tmp_path / "kto-mix.jsonl", rows)
    script = trl_quick_start("KTOTrainer")
    run_script(script, {"from trl import KTOTrainer": "from scaletrain import KTOTrainer",
                        _model_id(script): repr(folder),
                        _dataset_line(script): f'load_dataset("json", data_files={data!r}, split="train")'},
               tmp_path)
    run_dir = tmp_path / "tiny-chat-llama-KTO"
    assert _final_step(run_dir) == 2  # 16 rows, batches of 8
    last = _train_records(run_dir)[-1]  # step 2 (log_steps 10: the last step is logged)
    # the policy starts as its reference (a copy), where KTO's loss is 1 - sigmoid(0) = 0.5; one update at the
    # default learning rate moves it by ~1e-4 (measured 5e-5), far inside 1e-2
    assert last["step"] == 2 and last["loss"] == pytest.approx(0.5, abs=1e-2) and last["kl"] >= 0


def test_a_path_a_list_of_dicts_and_a_dataset_give_the_recipe_kinds_rows(folder, tmp_path):
    import datasets

    import scaletrain as st
    from scaletrain.data import load_processor
    from scaletrain.data.build import build_datasets
    from scaletrain.data.config import DataSection
    from scaletrain.training.trl_inputs import preference_rows

    tok = load_processor(folder)
    args = st.DPOConfig(output_dir=str(tmp_path / "run"), max_length=32)
    rows = [{"prompt": p, "chosen": " " + c, "rejected": " " + r} for p, c, r in PAIRS]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    recipe = build_datasets(DataSection(kind="preference", source=path, eval_fraction=0.0), tok, max_length=32,
                            truncation_mode=args.truncation_mode).train
    for given in (path, rows, datasets.Dataset.from_list(rows)):
        train, evals = preference_rows(given, given, tok, args, kind="preference", preparation="trl_dpo",
                                       who="DPOTrainer")
        assert train.num_rows == evals.num_rows == len(PAIRS)
        for key, column in recipe.columns.items():
            np.testing.assert_array_equal(train.columns[key], column, err_msg=f"{type(given).__name__}: {key}")
    already = [dict(zip(recipe.columns, values)) for values in zip(*recipe.columns.values())]
    assert preference_rows(already, None, tok, args, kind="preference", preparation="trl_dpo",
                           who="DPOTrainer") == (already, None)  # prepared rows are used as given


def test_python_rows_are_cut_as_trls_trainer_and_a_recipe_cut_them_unless_args_say(folder, tmp_path):
    """DPOConfig leaves truncation_mode unset: the rows are cut as TRL's DPOTrainer cuts them (keep_start), the
    same arrays a recipe gets; a truncation_mode given in args is kept."""
    import scaletrain as st
    from scaletrain.data import load_processor
    from scaletrain.data.build import build_datasets
    from scaletrain.data.config import DataSection
    from scaletrain.training.trl_inputs import preference_rows

    tok = load_processor(folder)
    long = " ".join(["one two three four"] * 6)
    rows = [{"prompt": p, "chosen": f" {c} {long}", "rejected": f" {r} {long}"} for p, c, r in PAIRS]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)

    def recipe(mode: str):
        return build_datasets(DataSection(kind="preference", source=path, eval_fraction=0.0), tok, max_length=24,
                              truncation_mode=mode).train.columns

    for args, mode in ((st.DPOConfig(output_dir=str(tmp_path / "a"), max_length=24), "keep_start"),
                       (st.DPOConfig(output_dir=str(tmp_path / "b"), max_length=24, truncation_mode="keep_end"),
                        "keep_end")):
        train, _ = preference_rows(path, None, tok, args, kind="preference", preparation="trl_dpo", who="DPOTrainer")
        for key, column in recipe(mode).items():
            np.testing.assert_array_equal(train.columns[key], column, err_msg=f"{mode}: {key}")
    assert any((recipe("keep_start")[k] != recipe("keep_end")[k]).any() for k in recipe("keep_end"))  # rows were cut


def test_text_rows_without_a_tokenizer_are_one_error_naming_processing_class(tmp_path):
    import scaletrain as st
    from scaletrain.training.trl_inputs import preference_rows

    args = st.DPOConfig(output_dir=str(tmp_path / "run"))
    with pytest.raises(st.ConfigError, match=r"DPOTrainer: train_dataset holds text rows; pass processing_class="):
        preference_rows([{"chosen": "a", "rejected": "b"}], None, None, args, kind="preference",
                        preparation="trl_dpo", who="DPOTrainer")


def test_a_peft_lora_config_maps_onto_our_lora_and_an_unsupported_field_is_named(folder):
    from peft import LoraConfig

    import scaletrain as st
    from scaletrain.peft.lora_config import LoRAConfig
    from scaletrain.training.trl_inputs import lora_from_peft

    model = tiny_llama(0)
    mapped = lora_from_peft(LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"], use_rslora=True,
                                       task_type="CAUSAL_LM"), model, folder)
    assert mapped == LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), rslora=True,
                                base_model=folder)
    # no targets: PEFT's defaults for the model's type (Llama: q_proj, v_proj), as TRL's trainers get them
    assert lora_from_peft(LoraConfig(), model).target_modules == ("q_proj", "v_proj")
    assert lora_from_peft(LoraConfig(target_modules="all-linear"), model).target_modules == "all-linear"
    for bad, field in ((LoraConfig(lora_dropout=0.05), "lora_dropout"), (LoraConfig(use_dora=True), "use_dora"),
                       (LoraConfig(bias="all"), "bias"), (LoraConfig(modules_to_save=["lm_head"]), "modules_to_save"),
                       (LoraConfig(task_type="SEQ_CLS"), "task_type")):
        with pytest.raises(st.ConfigError, match=rf"^peft_config: LoraConfig\.{field}=") as info:
            lora_from_peft(bad, model)
        assert "\n" not in str(info.value)


def test_model_given_as_a_name_that_is_not_a_folder_is_one_error(tmp_path):
    import scaletrain as st

    with pytest.raises(st.ConfigError, match=r"DPOTrainer\(model='Qwen/Qwen3-0.6B'\): not a local model folder"):
        st.DPOTrainer(model="Qwen/Qwen3-0.6B", args=st.DPOConfig(output_dir=str(tmp_path / "run")),
                      train_dataset=[{"chosen": "a", "rejected": "b"}])


def test_orpo_trainer_takes_a_model_folder_a_list_of_dicts_and_a_peft_lora_config(folder, tmp_path):
    from peft import LoraConfig

    import scaletrain as st
    from scaletrain.peft.lora import lora_config_of

    rows = [{"prompt": p, "chosen": " " + c, "rejected": " " + r} for p, c, r in PAIRS]
    trainer = st.ORPOTrainer(model=folder, train_dataset=rows,
                             args=st.ORPOConfig(output_dir=str(tmp_path / "run"), max_length=32, beta=0.1,
                                                progress_bar=False, report_to=()),
                             peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    lora = lora_config_of(trainer.model)
    assert (lora.rank, lora.alpha, lora.target_modules, lora.base_model) == (4, 8.0, ("q_proj", "v_proj"), folder)
    trainer.train()
    record = _train_records(tmp_path / "run")[0]
    assert np.isfinite(record["loss"]) and np.isfinite(record["log_odds_ratio"])
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["objective"] == "orpo"


def test_a_python_lora_run_records_its_model_folder_as_base_and_exports_that_folders_tokenizer(folder, tmp_path):
    import scaletrain as st
    from scaletrain.export import tokenizer_for
    from scaletrain.training.trl_inputs import with_peft_config

    args = st.DPOConfig(output_dir=str(tmp_path / "run"), lora={"rank": 4, "init_from": None})
    given = with_peft_config(args, None, tiny_llama(0), folder, "DPOTrainer")
    assert given.lora.base_model == folder and args.lora.base_model is None  # as a recipe's model.pretrained
    # a run from Python has no recipe: its export writes the base folder's tokenizer (chat template and all),
    # not the bundled one, which does not fit the model
    meta = {"recipe": None, "arguments": given.model_dump()}
    assert tokenizer_for(meta).chat_template == TEMPLATE
