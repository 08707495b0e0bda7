"""Chaos: kill, signal or fill the disk of a run at seeded moments, then resume; nothing may be lost.

Single process: the run of tests/resume_worker.py (a subprocess, so it can be killed)
goes through one round per event — ``kill -9``, SIGTERM and a full disk, in an order
and at steps drawn from ``SCALETRAIN_CHAOS_SEED`` (printed) — and then resumes to its
horizon. After each round every checkpoint that was complete before the event must
still be there; at the end the run's ``params_sha256`` and logged losses must equal an
uninterrupted run's, and every checkpoint it kept must load and hold the reference's
parameters at that step.

The triggers are deterministic: the test waits for the run to log a chosen step in
``metrics.jsonl`` and only then strikes; where exactly the blow lands relative to the
asynchronous checkpoint writes varies, and the assertions hold wherever it lands.

"Disk full": ``prlimit(RLIMIT_FSIZE)`` lowered to 0 on the running process from
outside (no root needed). From then on every write the process makes to a regular
file fails with EFBIG (CPython ignores SIGXFSZ), which is how a full disk looks to the
writer (ENOSPC), for every file at once: checkpoint chunks, metrics, summary. Lifting
it is starting the next process without the limit.

Ray: a SIGKILLed worker's restart that ends bit-identical, and a SIGTERMed (preempted)
worker that stops every process with a checkpoint and resumes bit-identically, are
tests/test_ray_launch.py's (they share its documented uninterrupted run).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time

import pytest

from scaletrain.training.checkpoint import step_folders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from folder_testing import checkpoint_params_sha256  # noqa: E402
from resume_worker import build_trainer  # noqa: E402

SEED = int(os.environ.get("SCALETRAIN_CHAOS_SEED", "1616"))
STEPS, ROWS, ACCUM = 10, 64, 1  # resume_worker saves every 2 steps and logs every step
EVENTS = ("kill9", "sigterm", "disk_full")
PROCESS_TIMEOUT = 300  # a hung process fails the test instead of hanging it (JAX ignores SIGTERM when hung)


def _train_losses(out) -> dict[int, float]:
    """Loss per logged step; a resumed run's later line for a step wins."""
    by_step = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            if line.endswith("\n"):
                rec = json.loads(line)
                if rec.get("split") == "train":
                    by_step[rec["step"]] = rec["loss"]
    return by_step


def _logged_lines(out) -> list[dict]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def _start(out, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "resume_worker.py"), str(out), str(ACCUM),
                             str(ROWS), str(STEPS)], stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_for_step(proc, out, lines_before: int, step: int) -> bool:
    """Until this process logs a step >= ``step`` (a new line of metrics.jsonl); False if it ended first."""
    while proc.poll() is None:
        if any(r.get("split") == "train" and r["step"] >= step for r in _logged_lines(out)[lines_before:]):
            return True
        time.sleep(0.01)  # polling a file the run appends to; no assertion depends on this interval
    return False


def _strike(proc, event: str) -> None:
    if event == "kill9":
        proc.send_signal(signal.SIGKILL)
    elif event == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:  # disk full: every write to a regular file fails from now on (soft limit only: no privilege needed)
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (0, hard))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same 8 fake devices and flags as the subprocesses)."""
    out = tmp_path_factory.mktemp("chaos") / "reference"
    trainer = build_trainer(str(out), ACCUM, ROWS, STEPS)
    trainer.train()
    return out, trainer


def test_single_process_chaos_resumes_exactly_and_loses_no_checkpoint(reference, tmp_path):
    ref_out, ref_trainer = reference
    rng = random.Random(SEED)
    events = rng.sample(EVENTS, len(EVENTS))
    triggers = sorted(rng.sample(range(2, STEPS - 2), len(events)))
    print(f"\nchaos seed {SEED} (SCALETRAIN_CHAOS_SEED): {list(zip(events, triggers))}")
    out = tmp_path / "run"
    complete: set[int] = set()  # checkpoints seen complete before some event
    for rnd, (event, at) in enumerate(zip(events, triggers)):
        lines_before = len(_logged_lines(out))
        with open(tmp_path / f"round-{rnd}.log", "w") as log:
            proc = _start(out, log)
            try:
                struck = _wait_for_step(proc, out, lines_before, at)
                complete |= set(step_folders(str(out / "checkpoints")))  # complete: orbax renames on commit
                if struck:
                    _strike(proc, event)
                rc = proc.wait(timeout=PROCESS_TIMEOUT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tail = (tmp_path / f"round-{rnd}.log").read_text()[-3000:]
        where = f"round {rnd}: {event} at step {at} (seed {SEED}); rc {rc}\n{tail}"
        assert struck, where  # the run got to the step (it did not fail or finish first)
        if event == "kill9":
            assert rc == -signal.SIGKILL, where
        elif event == "sigterm":  # a clean stop with a checkpoint at the step it stopped after
            summary = json.loads((out / "summary.json").read_text())
            assert rc == 0 and "SIGTERM" in summary["stop_reason"], where
            assert summary["final_step"] in step_folders(str(out / "checkpoints")), where
            complete.add(summary["final_step"])
        else:  # the full disk fails the run; it must not hang or be mistaken for a finished one
            assert rc not in (0, -signal.SIGKILL), where
        lost = complete - set(step_folders(str(out / "checkpoints")))
        assert not lost, f"checkpoints {sorted(lost)} lost; {where}"

    with open(tmp_path / "final.log", "w") as log:
        proc = _start(out, log)
        rc = proc.wait(timeout=PROCESS_TIMEOUT)
    final = (tmp_path / "final.log").read_text()[-3000:]
    assert rc == 0, final
    summary = json.loads((out / "summary.json").read_text())
    ref_summary = json.loads((ref_out / "summary.json").read_text())
    assert summary["final_step"] == STEPS and summary["resumed_from"] is not None
    assert summary["params_sha256"] == ref_summary["params_sha256"], f"seed {SEED}: not bit-identical"
    assert _train_losses(out) == _train_losses(ref_out)  # every step's loss, redone steps included

    kept = step_folders(str(out / "checkpoints"))
    assert complete <= set(kept), f"checkpoints {sorted(complete - set(kept))} lost (seed {SEED})"
    ref_steps = set(step_folders(str(ref_out / "checkpoints")))
    for step in kept:  # each loads; a step the reference also saved holds the reference's parameters there
        got = checkpoint_params_sha256(ref_trainer, out, step)
        if step in ref_steps:
            want = checkpoint_params_sha256(ref_trainer, ref_out, step)
            assert got == want, f"checkpoint {step} differs (seed {SEED})"
