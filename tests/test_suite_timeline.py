"""The opt-in per-file record of the suite's time (tests/suite_timeline.py): one line per file a test process ran,
with its tests, wall and CPU seconds, and a summary that says how the workers ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from suite_timeline import ENV, summarize

TESTS = Path(__file__).resolve().parent
INNER_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from suite_timeline import install


def pytest_configure(config):
    install(config)
"""
SPIN = "def test_spin():\n    sum(range(3_000_000))\n"  # ~0.1 s of CPU: a figure the record must show
QUICK = "def test_{n}():\n    pass\n"


def test_the_timeline_records_each_file_once_with_its_tests_and_cpu_and_the_summary_names_the_workers_end(tmp_path):
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_a.py").write_text(SPIN)
    (tmp_path / "test_b.py").write_text(QUICK.format(n="one") + "\n\n" + QUICK.format(n="two"))
    record = tmp_path / "timeline"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_a.py", "test_b.py"],
                         cwd=tmp_path, env={**env, ENV: str(record)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(x) for x in (record / "main.jsonl").read_text().splitlines()]
    assert [(r["file"], r["tests"], r["worker"]) for r in lines] == [("test_a.py", 1, "main"), ("test_b.py", 2, "main")]
    spin, quick = lines
    assert spin["cpu_s"] > quick["cpu_s"] and spin["cpu_s"] > 0.01  # the spinning test's CPU is counted
    assert spin["start"] <= spin["end"] <= quick["start"] <= quick["end"]
    text = summarize(str(record))
    assert "main: 2 files, 3 tests" in text and "the first worker to end waited 0 s for the last" in text
