"""``scaletrain eval TARGET --data``: a run's own eval data gives the run's final eval figures; other sources.

The run is a real ``scaletrain train`` of a tiny Llama on 2 plays (4 steps, eval at the end,
2 eval batches of 8 rows). Its final ``eval_*`` figures (summary.json) are what ``scaletrain eval
RUN`` must reproduce: the same rows, batches, mesh and jitted eval step, so the figures agree
to float32 rounding of the summed losses (1e-6 relative; the token counts exactly).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from scaletrain.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalrun") / "run"
    assert main([
        "train", os.path.join(ROOT, "examples", "shakespeare.yaml"), f"training.output_dir={out}",
        "training.max_training_steps=4", "training.log_steps=2", "training.evaluation_steps=null",
        "training.max_evaluation_steps=2", "training.total_batch_size=8", "training.max_length=64",
        "data.max_documents=2", "data.eval_fraction=0.1", "model.num_hidden_layers=1", "model.hidden_size=32",
        "model.intermediate_size=64", "sample.max_new_tokens=0", "training.progress_bar=false",
    ]) == 0
    return out


def test_eval_of_a_run_equals_its_final_eval(run, tmp_path, capsys):
    summary = json.loads((run / "summary.json").read_text())
    report = tmp_path / "eval.json"
    assert main(["eval", str(run), "--output", str(report), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(report.read_text())["data"]
    assert json.loads(report.read_text())["step"] == 4
    for name in ("eval_loss", "eval_bits_per_byte"):
        assert math.isclose(figures[name], summary[f"final_{name}"], rel_tol=1e-6), name
    last_eval = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line).get("split") == "eval"][-1]
    for name in ("eval_accuracy", "eval_perplexity"):
        assert math.isclose(figures[name], last_eval[name], rel_tol=1e-6), name
    assert figures["eval_tokens"] == last_eval["eval_tokens"]
    assert "eval_loss" in printed and f"{figures['eval_loss']:.6g}" in printed


def test_eval_of_a_run_on_another_source_and_mesh(run, tmp_path):
    """Any source the data kinds read, scored whole (not just a held-out part), on another mesh (dp=2)."""
    text = tmp_path / "held.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"ROMEO. Line {i} of a play that was never written."})
                              for i in range(40)))
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["eval", str(run), "--data", str(text), "--output", str(one), "--no-progress"]) == 0
    assert main(["eval", str(run), "--data", str(text), "--mesh", "2,-1,1,1,1", "--output", str(two),
                 "--no-progress"]) == 0
    a, b = (json.loads(p.read_text())["data"] for p in (one, two))
    assert a["eval_tokens"] == b["eval_tokens"] > 40 * 10
    assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-5)
    assert a["eval_perplexity"] == pytest.approx(math.exp(a["eval_loss"]), rel=1e-9)


def test_chat_data_scores_assistant_tokens_as_transformers_does(tmp_path):
    """``--kind chat``: the loss is over the assistant turns only; the oracle is transformers' forward on each
    packed conversation, its cross-entropy summed where the pipeline's loss mask is set (1e-4 relative:
    float32 forwards that differ by summation order)."""
    import numpy as np
    import torch
    import transformers

    from data_helpers import PLAIN_TEMPLATE
    from eval_testing import tiny_hf_folder
    from scaletrain.data.build import build_datasets
    from scaletrain.data.tokenizer import load_processor
    from scaletrain.eval.data_eval import source_section

    folder = tiny_hf_folder(tmp_path / "hf")
    (tmp_path / "template.jinja").write_text(PLAIN_TEMPLATE)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"Say line {i} of the play."},
        {"role": "assistant", "content": f"ROMEO. This is line {i}, spoken softly."}]}) for i in range(12)))
    report = tmp_path / "chat.json"
    assert main(["eval", str(folder), "--data", str(chats), "--kind", "chat", "--chat-template",
                 str(tmp_path / "template.jinja"), "--max-length", "64", "--output", str(report),
                 "--no-progress"]) == 0
    figures = json.loads(report.read_text())["data"]

    section = source_section(str(chats), kind="chat", chat_template=str(tmp_path / "template.jinja"))
    rows = build_datasets(section, load_processor(str(folder)), max_length=64).eval
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, targets, all_targets = 0.0, 0, 0
    for r in range(rows.num_rows):
        for seg in set(rows.segment_ids[r].tolist()) - {0}:
            where = np.flatnonzero(rows.segment_ids[r] == seg)
            ids = torch.tensor(rows.input_ids[r, where])[None]
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0, :-1].double(), -1)
            nll = -logp.gather(1, ids[0, 1:, None])[:, 0].numpy()
            mask = rows.loss_mask[r, where][1:] != 0
            total, targets, all_targets = total + nll[mask].sum(), targets + mask.sum(), all_targets + len(nll)
    assert figures["eval_tokens"] == targets < all_targets
    assert math.isclose(figures["eval_loss"], total / targets, rel_tol=1e-4)


def test_checkpoint_picks_the_step(run, tmp_path, capsys):
    report = tmp_path / "four.json"
    assert main(["eval", str(run), "--checkpoint", "4", "--output", str(report), "--no-progress"]) == 0
    assert json.loads(report.read_text())["step"] == 4
    capsys.readouterr()
    assert main(["eval", str(run), "--checkpoint", "3"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint for step 3" in err and "[4]" in err and "Traceback" not in err
