"""A DPO recipe run killed with SIGKILL and resumed ends with the parameters of an uninterrupted run; resuming
against another reference model is refused, naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from preference_testing import export, tiny_llama, word_tokenizer
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "preference_resume_worker.py")
PAIRS = [{"prompt": f"count to {a}", "chosen": f" {b} {a}", "rejected": f" {c}"}
         for a, b, c in [("one", "yes", "no"), ("two", "one", "five"), ("four", "three", "six"),
                         ("five", "four", "red"), ("six", "five", "blue"), ("seven", "six", "cat")]] * 4


def _worker(workdir, run, kill_at=None, reference=None):
    cmd = [sys.executable, WORKER, str(workdir), run, str(kill_at) if kill_at else "-"] + ([reference] if reference
                                                                                           else [])
    # one CPU device, as tests/test_grpo_resume.py: the guarantee is the resume's, not the mesh's (sharded
    # restore is tests/test_checkpoint.py's); each of the four runs compiles for one device, not the suite's 8,
    # at the cheap setting (every run compared here is such a child: tests/xla_testing.py)
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(1)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _train_records(path):
    by_step = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            by_step[rec["step"]] = (rec["loss"], rec["rewards/margins"], rec["rewards/accuracies"])
    return by_step


@pytest.mark.slow
def test_sigkill_in_a_dpo_run_and_resume_is_bitwise_identical(tmp_path):
    word_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    ref = _worker(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _worker(tmp_path, "run", kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    other = export(tiny_llama(seed=11), str(tmp_path / "other_reference"))
    refused = _worker(tmp_path, "run", reference=other)
    assert refused.returncode != 0 and "trained against the reference" in refused.stderr, refused.stderr[-3000:]
    resumed = _worker(tmp_path, "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["final_step"] == 6
    assert summary["params_sha256"] == ref_summary["params_sha256"]
    assert summary["reference"] == ref_summary["reference"] and summary["reference"]["reference"].startswith("starting")
    records = _train_records(tmp_path / "run" / "metrics.jsonl")
    assert records == _train_records(tmp_path / "ref" / "metrics.jsonl") and len(records) == 6
    assert records[6][1] > records[1][1]  # training moved the margin
