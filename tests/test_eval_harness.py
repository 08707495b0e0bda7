"""lm-evaluation-harness on scaletrain models: the same figures as lm-eval's own ``hf`` model.

One tiny random Llama saved as an HF folder, three local tasks (multiple choice, generation with
stop sequences, rolling log-likelihood) over JSON files: ``scaletrain eval --tasks`` and
lm-eval's ``hf`` model (torch, float32) run in this test on the same folder. Accuracy and the
generated texts must be equal; every log-likelihood within 1e-4 relative (float32 on both sides:
the two forwards differ by summation order, ~1e-6 relative on these magnitudes).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from eval_testing import task_yamls, tiny_hf_folder
from scaletrain.cli import main

TASKS = "st_mc,st_gen,st_text"
REL = 1e-4


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """``(our results dict, lm-eval hf results dict, our output folder)`` on the same model and tasks."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp("harness")
    folder = tiny_hf_folder(root / "hf")
    tasks = task_yamls(root)
    out = root / "out"
    assert main(["eval", str(folder), "--tasks", TASKS, "--include_path", str(tasks), "--output-path", str(out),
                 "--log-samples", "--batch-size", "4", "--output", str(root / "report.json"), "--no-progress"]) == 0
    ours = json.loads(open(glob.glob(str(out / "*" / "results_*.json"))[0]).read())
    ours_samples = {t: [json.loads(line) for line in open(glob.glob(str(out / "*" / f"samples_{t}_*.jsonl"))[0])]
                    for t in TASKS.split(",")}

    import lm_eval
    from lm_eval.tasks import TaskManager

    theirs = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32"},
                                     tasks=TASKS.split(","), batch_size=4, device="cpu", log_samples=True,
                                     task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    return ours, ours_samples, theirs, root


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b))


def test_same_metrics_as_lm_evals_hf_model(both):
    ours, _, theirs, _ = both
    for task, figures in theirs["results"].items():
        for key, value in figures.items():
            if "stderr" in key:
                continue
            if key.startswith(("acc", "exact_match")):
                assert ours["results"][task][key] == value, (task, key)
            elif key.startswith(("word_perplexity", "bits_per_byte")):
                assert _close(ours["results"][task][key], value), (task, key, ours["results"][task][key], value)


def test_every_request_scores_alike(both):
    """Per request: log-likelihoods within 1e-4 relative, the same is-greedy flags and generated texts."""
    _, samples, theirs, _ = both
    for task in TASKS.split(","):
        mine = {s["doc_id"]: s for s in samples[task]}
        assert len(mine) == len(theirs["samples"][task])
        for sample in theirs["samples"][task]:
            for a, b in zip(mine[sample["doc_id"]]["resps"], sample["resps"]):
                if task == "st_gen":
                    assert a == b
                elif task == "st_text":
                    assert _close(float(a[0]), float(b[0])), (a, b)
                else:
                    (ll_a, greedy_a), (ll_b, greedy_b) = a[0], b[0]
                    assert _close(float(ll_a), float(ll_b)) and str(greedy_a) == str(greedy_b), (a, b)


def test_files_and_report_as_lm_eval_writes_them(both):
    ours, _, _, root = both
    assert set(ours["results"]) == set(TASKS.split(","))
    report = json.loads((root / "report.json").read_text())
    assert report["tasks"]["st_mc/acc"] == ours["results"]["st_mc"]["acc,none"]


def test_simple_evaluate_from_python_and_no_recompile_per_request(both, tmp_path):
    """``lm_eval.simple_evaluate(model=ScaletrainLM(...))``; 15 requests of 4..12 tokens in 4-row batches compile
    one shape (the 16-token bucket), not one per request length."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from scaletrain.eval.lm_eval_model import ScaletrainLM

    ours, _, _, root = both
    lm = ScaletrainLM(pretrained=str(root / "hf"), batch_size=4)
    res = lm_eval.simple_evaluate(model=lm, tasks=["st_mc"],
                                  task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))
    assert res["results"]["st_mc"]["acc,none"] == ours["results"]["st_mc"]["acc,none"]
    assert lm.scorer.shapes_seen == {(8, 16)}  # 4 rows rounded up to the 8 devices of the fsdp axis


def test_importing_scaletrain_does_not_import_lm_eval():
    import subprocess

    code = "import scaletrain, scaletrain.eval, scaletrain.eval.harness, sys; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bad_input_is_one_message_and_exit_2(both, tmp_path, capsys):
    _, _, _, root = both
    cases = [
        (["eval", str(tmp_path / "nope")], "nope: no such file or directory"),
        (["eval", str(root / "hf"), "--tasks", "no_such_task", "--include-path", str(root / "tasks")],
         "unknown task(s) no_such_task"),
        (["eval", str(root / "hf"), "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
        (["eval", str(root / "hf")], "give --data SOURCE or --tasks"),
        (["eval", str(root / "hf"), "--data", str(root / "tasks" / "text.json"), "--kind", "poetry"],
         "--kind: unknown data kind 'poetry'; the known kinds are"),
        (["eval", str(root / "hf"), "--tasks", "st_mc", "--include-path", str(root / "tasks"),
          "--fewshot_as_multiturn"], "--fewshot_as_multiturn needs --apply_chat_template"),
        (["eval", str(root / "hf"), "--tasks", "st_mc", "--include-path", str(root / "tasks"),
          "--apply_chat_template"], "has no chat template; drop the flag"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_task_yaml_whose_data_file_is_missing_is_one_line_naming_both(both, tmp_path, capsys):
    """``dataset_kwargs.data_files`` pointing nowhere: exit 2 with one line naming the task YAML and the missing
    file (it was ``datasets``' FileNotFoundError traceback, after the model had loaded)."""
    _, _, _, root = both
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    yaml_path = tasks / "st_lost.yaml"
    missing = tmp_path / "gone" / "lost.json"
    yaml_path.write_text((root / "tasks" / "st_mc.yaml").read_text().replace("task: st_mc", "task: st_lost")
                         .replace(str(root / "tasks" / "mc.json"), str(missing)))
    assert str(missing) in yaml_path.read_text()
    assert main(["eval", str(root / "hf"), "--tasks", "st_lost", "--include-path", str(tasks), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"task YAML {yaml_path}: the file it reads, {missing}, does not exist; fix the path" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_chat_template_flags_reach_lm_eval_and_score_as_its_hf_model(both, tmp_path):
    """``--apply_chat_template --fewshot_as_multiturn`` (lm-eval's flags): the prompts lm-eval builds are the chat
    template's, two few-shot examples as turns of their own, and every request (its prompt, its score, its
    generated text) equals lm-eval's ``hf`` model given the same two options on the same folder."""
    import shutil

    import lm_eval
    import transformers
    from data_helpers import PLAIN_TEMPLATE
    from lm_eval.tasks import TaskManager

    _, _, _, root = both
    folder = tmp_path / "chat"
    shutil.copytree(root / "hf", folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = PLAIN_TEMPLATE
    tokenizer.save_pretrained(folder)
    out, tasks = tmp_path / "out", ["st_mc", "st_gen"]
    assert main(["eval", str(folder), "--tasks", ",".join(tasks), "--include_path", str(root / "tasks"),
                 "--apply_chat_template", "--fewshot_as_multiturn", "--num_fewshot", "2", "--output-path", str(out),
                 "--log_samples", "--batch-size", "4", "--no-progress"]) == 0
    results = json.loads(open(glob.glob(str(out / "*" / "results_*.json"))[0]).read())
    assert results["chat_template"] == PLAIN_TEMPLATE and results["fewshot_as_multiturn"] is True
    theirs = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32"},
                                     tasks=tasks, num_fewshot=2, apply_chat_template=True, fewshot_as_multiturn=True,
                                     batch_size=4, device="cpu", log_samples=True,
                                     task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))
    for task in tasks:
        mine = {s["doc_id"]: s for s in map(json.loads, open(glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))[0]))}
        assert len(mine) == len(theirs["samples"][task])
        for sample in theirs["samples"][task]:
            ours = mine[sample["doc_id"]]
            prompt = ours["arguments"]["gen_args_0"]["arg_0"]
            assert prompt.count("### user:") == 3 and prompt.endswith("### assistant:\n"), prompt  # 2 shots + doc
            assert len(ours["arguments"]) == len(sample["arguments"])
            for i, args in enumerate(sample["arguments"]):  # the same prompt (and continuation) per request
                assert ours["arguments"][f"gen_args_{i}"]["arg_0"] == args[0]
                if task == "st_mc":
                    assert ours["arguments"][f"gen_args_{i}"]["arg_1"] == args[1]
            for a, b in zip(ours["resps"], sample["resps"]):
                if task == "st_gen":
                    assert a == b
                else:
                    assert _close(float(a[0][0]), float(b[0][0])) and str(a[0][1]) == str(b[0][1]), (a, b)


def test_a_lora_adapter_scores_as_peft_applies_it(both, tmp_path):
    """``--adapter``: the PEFT folder applied unmerged gives lm-eval's ``hf`` model with ``peft=`` the same
    log-likelihoods (1e-4 relative), and not the base model's."""
    import jax
    import lm_eval
    import numpy as np
    from flax import nnx
    from lm_eval.tasks import TaskManager

    from scaletrain.models.registry import AutoModelForCausalLM
    from scaletrain.peft.adapter import save_peft_adapter
    from scaletrain.peft.lora import LoRAConfig, LoRAParam, apply_lora

    _, base_samples, _, root = both
    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(root / "hf")), LoRAConfig(target_modules="all-linear"))
    rng = np.random.default_rng(0)
    adapters = nnx.state(model, LoRAParam)
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(0.05 * rng.standard_normal(x.shape, np.float32),
                                                             x.sharding), adapters))
    adapter = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(root / "hf"))
    out = tmp_path / "out"
    assert main(["eval", str(root / "hf"), "--adapter", str(adapter), "--tasks", "st_mc", "--include-path",
                 str(root / "tasks"), "--output-path", str(out), "--log_samples", "--no-progress"]) == 0
    mine = [json.loads(line) for line in open(glob.glob(str(out / "*" / "samples_st_mc_*.jsonl"))[0])]
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(root / "hf"), "peft": str(adapter), "dtype": "float32"},
        tasks=["st_mc"], batch_size=4, device="cpu", log_samples=True,
        task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))["samples"]["st_mc"]
    by_doc = {s["doc_id"]: s for s in mine}
    base = {s["doc_id"]: s for s in base_samples["st_mc"]}
    for sample in theirs:
        for a, b, c in zip(by_doc[sample["doc_id"]]["resps"], sample["resps"], base[sample["doc_id"]]["resps"]):
            assert _close(float(a[0][0]), float(b[0][0])), (a, b)
            assert not _close(float(a[0][0]), float(c[0][0]))  # the adapter changed the scores


def test_without_lm_eval_tasks_say_how_to_install_it(both):
    """An install without the eval extra (lm_eval made unimportable in a fresh interpreter): one message, exit 2."""
    import subprocess

    _, _, _, root = both
    code = ("import sys; sys.modules['lm_eval'] = None; from scaletrain.cli import main; "
            f"sys.exit(main(['eval', {str(root / 'hf')!r}, '--tasks', 'st_mc']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and "pip install 'scaletrain[eval]'" in done.stderr
    assert "Traceback" not in done.stderr
