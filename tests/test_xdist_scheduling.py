"""A test worker that dies does not hang the suite (tests/xdist_scheduling.py).

Each test runs a small inner ``pytest -n 2 --dist loadfile`` (as ``make test`` does) with this suite's
own scheduler hook, over files in which a test SIGKILLs its own worker, as the kernel does to a worker
it kills for memory. With xdist 3.8's own ``LoadFileScheduling`` both layouts below never end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# generous: each inner run takes ~3 s on a quiet machine, ~30 s on a loaded one; a hang never ends
BOUND_S = 300

INNER_CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
"""

DIES = "import os, signal\n\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
PASSES = "def test_{name}():\n    pass\n"


def _run_inner(folder: Path, files: dict[str, str], *extra: str) -> tuple[int, str]:
    """Write ``files`` and a conftest that installs the suite's hooks, run ``pytest -n 2`` there, return
    (exit status, output); fail if it does not end within BOUND_S."""
    (folder / "conftest.py").write_text(INNER_CONFTEST)
    (folder / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (folder / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
           "--no-loadscope-reorder", "-rA", "-q", *extra]
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the controller and every worker it started
        out, _ = proc.communicate()
        pytest.fail(f"the inner run did not end within {BOUND_S} s after a worker died:\n{out[-3000:]}")
    return proc.returncode, out


def _outcomes(out: str) -> dict[str, str]:
    """Each test's last outcome from ``-rA``'s short summary."""
    return {nodeid: outcome for outcome, nodeid in re.findall(r"^(PASSED|FAILED) (\S+)", out, re.M)}


@pytest.mark.parametrize("restarts", ["default", "0"])
def test_a_killed_worker_ends_the_run_failed_and_the_rest_of_its_file_runs_elsewhere(tmp_path, restarts):
    """The worker dies in the first test of a two-test file while it also holds a second file: the run ends,
    fails, names the test the worker died in (once: it is not run again), and every other test passes,
    the one after the kill included, on another worker. With restarts disabled it ends as well."""
    files = {
        "test_1_kill.py": DIES + "\n\n" + PASSES.format(name="after_the_kill"),
        "test_2_ok.py": PASSES.format(name="ok"),
        "test_3_ok.py": PASSES.format(name="ok"),
    }
    extra = () if restarts == "default" else ("--max-worker-restart", "0")
    rc, out = _run_inner(tmp_path, files, *extra)
    assert rc == 1, out
    assert re.search(r"crashed while running 'test_1_kill\.py::test_dies'", out), out
    outcomes = _outcomes(out)
    assert outcomes.pop("test_1_kill.py::test_dies") == "FAILED", out
    assert out.count("FAILED test_1_kill.py::test_dies") == 1, out
    if restarts == "default":
        assert outcomes == {"test_1_kill.py::test_after_the_kill": "PASSED", "test_2_ok.py::test_ok": "PASSED",
                            "test_3_ok.py::test_ok": "PASSED"}, out


def test_workers_that_keep_dying_end_the_run_with_every_death_named(tmp_path):
    """Two files whose single test kills its worker, among passing ones: each death is reported once, the
    passing files all run, and the run ends failed."""
    files = {
        "test_1_kill.py": DIES,
        "test_2_ok.py": PASSES.format(name="ok"),
        "test_3_kill.py": DIES,
        "test_4_ok.py": PASSES.format(name="ok"),
    }
    rc, out = _run_inner(tmp_path, files)
    assert rc == 1, out
    assert _outcomes(out) == {"test_1_kill.py::test_dies": "FAILED", "test_2_ok.py::test_ok": "PASSED",
                              "test_3_kill.py::test_dies": "FAILED", "test_4_ok.py::test_ok": "PASSED"}, out
    assert out.count("FAILED test_") == 2, out
