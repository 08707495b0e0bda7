"""The logs a run appends to hold whole lines, and after a resume what an uninterrupted run's hold (issue 45, 1 3 22).

A write refused part-way is made by the kernel itself: the file-size limit (``RLIMIT_FSIZE``,
with SIGXFSZ ignored) lets a write fill the bytes up to the limit and refuses the rest with
EFBIG, as a disk that fills up mid-write refuses with ENOSPC (both are "no room",
``training/disk_full.py``). The GRPO runs are tests/grpo_logs_worker.py in subprocesses on one
CPU device (as tests/test_grpo_resume.py's), so the uninterrupted run and the interrupted one
compute the same bytes.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from preference_testing import word_tokenizer
from test_disk_full import _fill, small_disk  # noqa: F401 (a fixture: a real small tmpfs)
from xla_testing import child_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "grpo_logs_worker.py")
PROMPTS = ["what is two plus three", "the sky colour", "say hello", "name a fruit", "count to four", "the dog",
           "is the cat a dog", "say goodbye"]
# one device, the cheap compile setting: every run compared here is such a child (tests/xla_testing.py)
ENV = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": child_xla_flags(1)}

# writes `record` through WRITER to PATH under a file-size limit that leaves ROOM bytes; prints what it raised
REFUSED_APPEND = """
import json, os, resource, signal, sys
from scaletrain.cli import report_user_error
path, writer, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
if writer == "JsonlWriter":
    from scaletrain.training.loggers import JsonlWriter
    log = JsonlWriter(path)
    write = log.write
else:
    from scaletrain.log_files import append_lines
    write = lambda record: append_lines(path, [json.dumps(record)])
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + room, resource.RLIM_INFINITY))
try:
    write({"step": 3, "text": "x" * 4 * room})
except OSError as err:
    print(json.dumps({"errno": err.errno, "filename": err.filename}))
    sys.exit(report_user_error(err))
"""


@pytest.mark.parametrize("writer", ["JsonlWriter", "append_lines"])
def test_a_write_refused_part_way_leaves_the_log_as_it_was_and_names_it(writer, tmp_path):
    """metrics.jsonl's writer and the one completions.jsonl and ray_attempts.jsonl append through."""
    path = tmp_path / "log.jsonl"
    before = b'{"step": 1}\n{"step": 2}\n'
    path.write_bytes(before)
    res = subprocess.run([sys.executable, "-c", REFUSED_APPEND, str(path), writer, "10"], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert res.returncode == 2, res.stderr[-3000:]
    assert json.loads(res.stdout) == {"errno": 27, "filename": str(path)}  # EFBIG, after 10 bytes were written
    assert res.stderr == f"scaletrain: error: cannot write {path} (File too large); free space or move " \
                         "training.output_dir, then resume with training.resume_if_possible=true\n"
    assert path.read_bytes() == before


@pytest.mark.parametrize("writer", ["JsonlWriter", "append_lines"])
def test_a_real_full_disk_during_an_append_leaves_the_log_as_it_was_and_names_it(writer, small_disk):
    """On a filled tmpfs (root only) the kernel writes what fits in the file's last page, then says ENOSPC."""
    from scaletrain.log_files import append_lines
    from scaletrain.training.loggers import JsonlWriter

    path = small_disk / "log.jsonl"
    before = b'{"step": 1}\n'
    path.write_bytes(before)
    ballast = _fill(small_disk, 0)
    record = {"step": 2, "text": "x" * 3 * 4096}  # more than the rest of the file's page: written in part
    with pytest.raises(OSError) as err:
        if writer == "JsonlWriter":
            log = JsonlWriter(str(path))
            try:
                log.write(record)
            finally:
                log.close()
        else:
            append_lines(str(path), [json.dumps(record)])
    os.remove(ballast)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_bytes() == before


def test_a_cut_last_line_is_removed_when_a_run_opens_its_log_saying_so(tmp_path, caplog):
    """What a refused write could leave before (or when the disk refused even the cut back): repaired on open."""
    from scaletrain.training.loggers import JsonlWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    writer = JsonlWriter(str(path))
    writer.write({"step": 3})
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": s} for s in (1, 2, 3)]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{path}: its last line was cut (4 bytes, a write refused part-way); removed it, the file keeps its "
        "earlier whole lines"]


def test_a_resume_cuts_records_after_its_step_and_refuses_a_line_that_is_no_record(tmp_path):
    from scaletrain.errors import DataError
    from scaletrain.log_files import drop_records_after

    path = tmp_path / "completions.jsonl"
    lines = [json.dumps({"step": s, "completion": "é"}, ensure_ascii=False) + "\n" for s in (2, 2, 4, 4, 6)]
    path.write_text("".join(lines) + '{"step": 8, "compl', encoding="utf-8")
    assert drop_records_after(str(path), 4) == 1  # the cut line goes first, then step 6
    assert path.read_text(encoding="utf-8") == "".join(lines[:4])
    assert drop_records_after(str(path), 4) == 0 and drop_records_after(str(tmp_path / "none.jsonl"), 4) == 0
    path.write_text(lines[0] + "not json\n" + lines[2])
    with pytest.raises(DataError, match=f"^{path}, line 2: not a JSON record with a step"):
        drop_records_after(str(path), 2)


def test_the_logged_rollouts_are_those_of_every_nth_step():
    """TRL logs completions on its logging steps (N, 2N, ...); a rollout reused by μ steps is written once, under the
    step that sampled it, when one of its steps is such a step; none past the last step."""
    from scaletrain.rl.scoring import logs_completions

    def logged(mu: int, every: int, last: int) -> list[int]:
        return [s for s in range(1, last + 1, mu) if logs_completions(s, mu, every, last)]

    assert logged(1, 3, 12) == [3, 6, 9, 12]  # the run logged 1, 3, 6, 9, 12
    assert logged(1, 1, 4) == [1, 2, 3, 4]
    assert logged(2, 4, 8) == [3, 7]  # sampled at 3 and 7, trained at 3-4 and 7-8
    assert logged(3, 2, 12) == [1, 4, 7, 10]  # every cycle of 3 holds an even step
    assert logged(3, 4, 12) == [4, 7, 10]  # 4 in 4-6, 8 in 7-9, 12 in 10-12
    assert logged(2, 4, 7) == [3]  # the rollout of step 7 trains no 8th step


# ---- GRPO runs: kill -9, a refused write, and the uninterrupted run -----------------------------------
def _worker(workdir, run: str, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKER, str(workdir), run, *mode], capture_output=True, text=True,
                          timeout=600, env=ENV)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The tokenizer, the prompts and the uninterrupted run (steps 1-6, checkpoints at 3 and 6)."""
    work = tmp_path_factory.mktemp("grpo-logs")
    word_tokenizer(str(work / "tok"))
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    ref = _worker(work, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return work


def test_completions_are_logged_on_every_nth_step(workdir):
    """log_completions_steps=2 over 6 steps of one iteration: steps 2, 4, 6, each with all 16 completions."""
    assert _steps(workdir / "ref" / "completions.jsonl") == [2] * 16 + [4] * 16 + [6] * 16


def test_a_full_disk_during_a_completions_write_leaves_every_line_whole_and_the_resume_ends_as_the_full_run(workdir):
    """Step 6's completions are refused after 64 bytes: the file keeps steps 2 and 4 whole, the run ends with the one
    line naming it; resumed from the checkpoint of step 3, it drops step 4 (redone) and ends byte for byte as the
    uninterrupted run's file."""
    out, ref = workdir / "full", (workdir / "ref" / "completions.jsonl").read_bytes()
    failed = _worker(workdir, "full", "limit", "6")
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert failed.stderr.splitlines() == [
        f"scaletrain: error: cannot write {out / 'completions.jsonl'} (File too large); free space or move "
        "training.output_dir, then resume with training.resume_if_possible=true"]
    written = (out / "completions.jsonl").read_bytes()
    assert written == ref[:len(written)] and _steps(out / "completions.jsonl") == [2] * 16 + [4] * 16
    for name in ("metrics.jsonl", "completions.jsonl"):
        assert all(json.loads(line) for line in (out / name).read_text().splitlines(keepends=True)
                   if line.endswith("\n"))
        assert (out / name).read_bytes().endswith(b"\n")
    resumed = _worker(workdir, "full")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "completions.jsonl: removed 16 records of step 4, logged after step 3 where this run resumes" \
        in resumed.stderr
    assert (out / "completions.jsonl").read_bytes() == ref


def test_a_run_killed_after_its_checkpoint_resumes_to_the_uninterrupted_runs_completions_file(workdir):
    """Killed after step 5 (checkpoint 3, completions of steps 2 and 4 written): the resume redoes steps 4-6 and the
    file holds each logged step once, byte for byte the uninterrupted run's."""
    out = workdir / "killed"
    killed = _worker(workdir, "killed", "kill", "5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _steps(out / "completions.jsonl") == [2] * 16 + [4] * 16
    resumed = _worker(workdir, "killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from"].endswith("/3")
    assert (out / "completions.jsonl").read_bytes() == (workdir / "ref" / "completions.jsonl").read_bytes()
