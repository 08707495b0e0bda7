"""A full disk stops a run at once with one line, whatever the loggers, and the run resumes exactly.

Issue 35, item 1. Before the fix a save refused for lack of room was only logged by
orbax's threads (hundreds of lines of tracebacks) and training went on to the next
save; with TensorBoard on (the default) tensorboardX's writer thread died on ENOSPC
and the loop then blocked forever in ``add_event``.

The run is tests/disk_full_worker.py, in a subprocess ended as ``scaletrain train``
ends one (exit status 2, one line). Two ways to fill its disk: TensorStore's own
ENOSPC error injected into orbax's writer thread for one save (always runs), and a
real tmpfs filled with ballast right after the first checkpoint (needs root to
mount; skipped otherwise). In both the earlier checkpoint stays intact and, once
space is back, the run resumes to parameters bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from scaletrain.training.checkpoint import step_folders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from folder_testing import checkpoint_params_sha256  # noqa: E402
from disk_full_worker import MAX_STEPS, SAVE_STEPS, build_trainer  # noqa: E402

LOGGERS = {"tensorboard": ("tensorboard",), "none": ()}  # the default report_to, and none
FAILED_SAVE = 2 * SAVE_STEPS  # the first save fits; this one does not
PROMPT_S = 10.0  # "within seconds": from the refused write (or the filled disk) to the process's exit
TMPFS_SIZE, SLACK = 16 << 20, 320 << 10  # room left after the ballast: the logs fit, a checkpoint (>= 600 KiB) not


def _start(out, loggers: str, *mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "disk_full_worker.py"), str(out), loggers,
                             *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> tuple[int, str, float]:
    """Exit status, stderr, and when it ended; a hung run fails the test instead of hanging it."""
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err, time.time()


def _last_logged_step(out) -> int:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return max(json.loads(line)["step"] for line in f if line.endswith("\n"))


def _train_losses(out) -> dict[int, float]:
    """Loss per logged step (a resumed run's later line for a step wins); every line must be JSON."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r.get("split") == "train"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same 8 fake devices and flags as the subprocess)."""
    out = tmp_path_factory.mktemp("disk-full") / "reference"
    trainer = build_trainer(str(out), ())
    trainer.train()
    return out, trainer


def _check_stopped_and_resumes(out, rc: int, err: str, reference, loggers: str, may_warn: str | None = None):
    """Exit 2 with the one line naming the checkpoints folder; the first checkpoint intact; an exact resume.

    ``may_warn``: the one warning a side logger that met the full disk too may add.
    """
    ref_out, ref_trainer = reference
    lines = err.splitlines()
    if may_warn is not None and len(lines) == 2 and may_warn in lines[0]:
        lines = lines[1:]
    assert rc == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]  # no orbax traceback, no second report of the same failure
    assert lines[0].startswith(f"scaletrain: error: {out / 'checkpoints'}: cannot write a checkpoint "
                               "(No space left on device)"), lines[0]
    assert f"checkpoints [{SAVE_STEPS}] are intact" in lines[0]
    assert _last_logged_step(out) < FAILED_SAVE + SAVE_STEPS  # it stopped before the next save came due
    assert step_folders(str(out / "checkpoints")) == [SAVE_STEPS]
    saved = checkpoint_params_sha256(ref_trainer, out, SAVE_STEPS)
    assert saved == checkpoint_params_sha256(ref_trainer, ref_out, SAVE_STEPS)
    resumed = build_trainer(str(out), LOGGERS[loggers])
    resumed.train()
    assert resumed.resumed_from == str(out / "checkpoints" / str(SAVE_STEPS))
    assert resumed.summary["final_step"] == MAX_STEPS
    assert resumed.summary["params_sha256"] == json.loads((ref_out / "summary.json").read_text())["params_sha256"]
    assert _train_losses(out) == _train_losses(ref_out)  # every step's loss; a half-written line was dropped


@pytest.mark.parametrize("loggers", LOGGERS)
def test_disk_full_during_save_stops_the_run_with_one_line(loggers, reference, tmp_path):
    out, failed_at = tmp_path / "run", tmp_path / "failed_at"
    rc, err, ended = _finish(_start(out, loggers, "refuse", str(FAILED_SAVE), str(failed_at)))
    first_refusal = float(failed_at.read_text().split()[0])
    assert ended - first_refusal < PROMPT_S, err[-3000:]
    _check_stopped_and_resumes(out, rc, err, reference, loggers)


# ---- a real full filesystem ---------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of TMPFS_SIZE mounted for this test (root only; skipped where it cannot be mounted)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    where = tmp_path / "disk"
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)  # busy: detach, freed when idle


def _fill(where, slack: int) -> str:
    """Take all but ``slack`` bytes of the filesystem at ``where`` with one ballast file; its path."""
    st = os.statvfs(where)
    ballast = os.path.join(where, "ballast")
    fd = os.open(ballast, os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - slack)
    finally:
        os.close(fd)
    return ballast


@pytest.mark.parametrize("loggers", LOGGERS)
def test_real_full_disk_stops_the_run_with_one_line_and_resumes_exactly(loggers, reference, small_disk, tmp_path):
    out, ready, go = small_disk / "run", tmp_path / "ready", tmp_path / "go"
    proc = _start(out, loggers, "pause", str(ready), str(go))
    while not ready.exists() and proc.poll() is None:
        time.sleep(0.01)  # the run finishes its first checkpoint; no assertion depends on this interval
    ballast = _fill(small_disk, SLACK)
    filled = time.time()
    go.touch()
    rc, err, ended = _finish(proc)
    assert ended - filled < PROMPT_S, err[-3000:]
    os.remove(ballast)  # space is back
    # TensorBoard may meet the full disk too (its buffered events): then one warning, and it is off
    _check_stopped_and_resumes(out, rc, err, reference, loggers, may_warn="WARNING scaletrain: TensorBoard cannot write")


# ---- a side logger that cannot write never blocks or stops training -----------------------------
class _FullDisk:
    """A file that takes ``room`` bytes, then refuses every write and flush with ENOSPC."""

    def __init__(self, room: int):
        self.room = room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return len(data)

    def flush(self) -> None:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self.flush()


@pytest.mark.parametrize("room", [0, 3000], ids=["cannot-open", "fails-later"])
def test_tensorboard_that_cannot_write_never_blocks_training(room, tmp_path, monkeypatch, caplog):
    import scaletrain as st
    from scaletrain.training.loggers import TensorBoardWriter, RunWriters

    import tensorboardX.record_writer

    monkeypatch.setattr(tensorboardX.record_writer, "open_file", lambda path: _FullDisk(room))
    monkeypatch.setattr(TensorBoardWriter, "FLUSH_SECONDS", 0.0)  # every record reaches the "disk"
    writers = RunWriters(st.TrainingArguments(output_dir=str(tmp_path), report_to=("tensorboard",)))
    records = [{"step": s, "split": "train", "loss": 1.0 / s, "text": "x" * 100} for s in range(1, 101)]

    def log_all() -> None:  # more records than tensorboardX's queue of ten holds
        for r in records:
            writers.write(r)
        writers.close()

    worker = threading.Thread(target=log_all, daemon=True)
    started = time.perf_counter()
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a logger that cannot write blocked training"
    assert time.perf_counter() - started < 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "TensorBoard cannot write (No space left on device)" in warnings[0], warnings
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 101))  # the run's record is whole


def test_a_metrics_line_half_written_on_a_full_disk_is_dropped_when_the_run_resumes(tmp_path):
    from scaletrain.training.loggers import JsonlWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # the disk took half of step 3's line
    writer = JsonlWriter(str(path))
    writer.write({"step": 3})
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": s} for s in (1, 2, 3)]


def test_only_orbax_reports_of_a_refused_write_are_silenced():
    import logging

    from scaletrain.training.disk_full import NoRoomRecords

    def record(msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord("absl", logging.ERROR, __file__, 1, msg, None,
                                 (type(exc), exc, None) if exc else None)

    keep = NoRoomRecords().filter
    assert not keep(record("Save Finalize thread failed.", ValueError("... No space left on device [os_error_code='28']")))
    assert not keep(record("raised an exception: Failed to write: [os_error_code='28']"))
    assert keep(record("Save Finalize thread failed.", ValueError("PERMISSION_DENIED")))
    assert keep(record("an unrelated warning"))
