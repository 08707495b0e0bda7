"""A GKD recipe run (on-policy and dataset steps drawn from (seed, step), a teacher folder) killed with SIGKILL and
resumed ends with the parameters and figures of an uninterrupted run; resuming with other weights in the teacher's
folder is refused by the teacher's digest, naming it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from preference_testing import export, tiny_llama, word_tokenizer
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distill_resume_worker.py")
ROWS = [("what is two plus three", "five"), ("the sky colour", "blue"), ("say hello", "hello world"),
        ("name a fruit", "apple"), ("count to four", "one two three four"), ("the dog", "runs"),
        ("is the cat a dog", "no"), ("say goodbye", "goodbye")]


def _worker(workdir, run, kill_at=None):
    cmd = [sys.executable, WORKER, str(workdir), run, str(kill_at) if kill_at else "-"]
    # one CPU device and the cheap compile setting, as GRPO's resume test (tests/xla_testing.py)
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(1)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _train_records(path):
    keys = ("loss", "entropy", "rollout/on_policy", "completions/mean_length")
    return {r["step"]: tuple(r.get(k) for k in keys)
            for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"}


@pytest.mark.slow
def test_gkd_sigkill_and_resume_is_bitwise_identical_and_another_teacher_is_refused(tmp_path):
    word_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                                                    for p, c in ROWS))
    export(tiny_llama(seed=5, layers=1), str(tmp_path / "teacher"))
    ref = _worker(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _worker(tmp_path, "run", kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # the same objective.teacher folder, other weights in it (a teacher exported again): refused by its digest
    os.rename(tmp_path / "teacher", tmp_path / "teacher_kept")
    export(tiny_llama(seed=11, layers=1), str(tmp_path / "teacher"))
    refused = _worker(tmp_path, "run")
    assert refused.returncode != 0 and "trained against the teacher" in refused.stderr, refused.stderr[-3000:]
    shutil.rmtree(tmp_path / "teacher")
    os.rename(tmp_path / "teacher_kept", tmp_path / "teacher")
    resumed = _worker(tmp_path, "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"].endswith("/2") and summary["final_step"] == 6
    assert summary["params_sha256"] == ref_summary["params_sha256"]
    assert summary["teacher"] == ref_summary["teacher"]
    assert summary["teacher"]["teacher"].endswith("teacher")
    records, ref_records = _train_records(tmp_path / "run" / "metrics.jsonl"), _train_records(
        tmp_path / "ref" / "metrics.jsonl")
    assert records == ref_records
    sources = {r[2] for r in ref_records.values()}
    assert sources == {0.0, 1.0}  # both kinds of step ran: sampled from the student and read from the dataset
