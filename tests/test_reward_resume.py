"""A reward-model recipe run killed with SIGKILL and resumed ends with the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from preference_testing import word_tokenizer
from test_preference_resume import PAIRS
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "reward_resume_worker.py")


def _worker(workdir, run, kill_at=None):
    cmd = [sys.executable, WORKER, str(workdir), run, str(kill_at) if kill_at else "-"]
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(1)}  # one CPU device, as the DPO test
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_sigkill_in_a_reward_run_and_resume_is_bitwise_identical(tmp_path):
    word_tokenizer(str(tmp_path / "tok"))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    ref = _worker(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _worker(tmp_path, "run", kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _worker(tmp_path, "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["final_step"] == 6
    assert summary["params_sha256"] == ref_summary["params_sha256"]

    def losses(run):
        return {r["step"]: (r["loss"], r["accuracy"], r["margin"]) for r in
                map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"}

    assert losses("run") == losses("ref")
