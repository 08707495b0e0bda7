"""Where the suite's time goes, per test file and per xdist worker: an opt-in record for balancing ``make test``.

Why: pytest's ``--durations`` names single tests, but the suite's wall time is decided per *file* (``--dist
loadfile`` sends each file whole to one worker) and by how the two workers end: one idle while the other
finishes its last file is wasted wall time. With ``SCALETRAIN_TEST_TIMELINE=DIR`` each test process writes
``DIR/<worker>.jsonl``, one line per file it ran: when it began and ended (wall clock, seconds since the epoch),
its tests' wall seconds, and the CPU seconds of the process and of the children it waited for (subprocesses
run by a test; Ray's workers are the raylet's children and are not counted). ``python tests/suite_timeline.py
DIR`` prints the files by CPU and how each worker ended. Off (and free) unless the variable is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import pytest

ENV = "SCALETRAIN_TEST_TIMELINE"


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class TimelineRecorder:
    """A pytest plugin: times each test's whole protocol (set-up, call, tear-down) and sums it per file."""

    def __init__(self, folder: str, worker: str):
        self.path = os.path.join(folder, f"{worker}.jsonl")
        self.worker = worker
        self.files: dict[str, dict] = {}
        os.makedirs(folder, exist_ok=True)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        """Wraps each test: its set-up, call and tear-down, module fixtures built or torn down with it included."""
        start, cpu = time.time(), _cpu_s()
        yield
        end = time.time()
        path = item.nodeid.partition("::")[0]
        rec = self.files.setdefault(path, {"file": path, "worker": self.worker, "start": start, "tests": 0,
                                           "wall_s": 0.0, "cpu_s": 0.0})
        rec["end"] = end
        rec["tests"] += 1
        rec["wall_s"] += end - start
        rec["cpu_s"] += _cpu_s() - cpu
        if nextitem is None or nextitem.nodeid.partition("::")[0] != path:
            self._flush(rec)

    def _flush(self, rec: dict) -> None:
        with open(self.path, "a") as f:  # a line per file, as each ends: a worker that dies keeps what it ran
            f.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}) + "\n")


def install(config) -> None:
    """Register the recorder on this test process when ``SCALETRAIN_TEST_TIMELINE`` names a folder.

    Under xdist only the workers run tests (the controller, which runs none, writes nothing); a plain
    ``pytest`` records as worker ``main``."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    config.pluginmanager.register(TimelineRecorder(folder, worker), "scaletrain-timeline")


def summarize(folder: str, top: int = 40) -> str:
    """The files by CPU seconds, and per worker: files, busy wall, CPU, and when it ended after the first start."""
    recs = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                recs += [json.loads(line) for line in f if line.strip()]
    if not recs:
        return f"no records in {folder}"
    t0 = min(r["start"] for r in recs)
    lines = [f"{'cpu_s':>8} {'wall_s':>8} {'tests':>5}  worker  file"]
    for r in sorted(recs, key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f} {r['tests']:5d}  {r['worker']:6}  {r['file']}")
    per: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        per[r["worker"]].append(r)
    ends = {w: max(r["end"] for r in rs) - t0 for w, rs in per.items()}
    lines.append("")
    for w, rs in sorted(per.items()):
        last = max(rs, key=lambda r: r["end"])
        busy, cpu = sum(r["wall_s"] for r in rs), sum(r["cpu_s"] for r in rs)
        lines.append(f"{w}: {len(rs)} files, {sum(r['tests'] for r in rs)} tests, busy {busy:.0f} s, cpu {cpu:.0f} s, "
                     f"ended at {ends[w]:.0f} s (last: {last['file']})")
    lines.append(f"total cpu {sum(r['cpu_s'] for r in recs):.0f} s; the first worker to end waited "
                 f"{max(ends.values()) - min(ends.values()):.0f} s for the last")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
