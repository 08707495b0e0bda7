"""A restart right after ``kill -9`` is not refused while the killed run's lock is still being let go; a live
holder is still refused, and the refusal says how long it waited."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from scaletrain.errors import ConfigError
from scaletrain.training.run_lock import LIVE_GRACE_S, acquire_run_lock, holds_run_lock, release_run_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}

# a run that takes the lock with the library's own code and has forked a helper (as a data loader's worker is):
# the helper inherited the lock file, so the lock outlives the run's kill -9 until the helper exits too, as it
# outlives it while the kernel tears a large killed process down; the helper lets go when RELEASE appears
KILLED_RUN = (
    "import os, sys, time\n"
    "from scaletrain.training.run_lock import acquire_run_lock\n"
    "acquire_run_lock(sys.argv[1])\n"
    "if os.fork() == 0:\n"
    "    deadline = time.monotonic() + 120\n"
    "    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:\n"
    "        time.sleep(0.02)\n"
    "    os._exit(0)\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)
# the restarted run: takes the lock (logging what it waits for), says so, lets go
RESTART = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from scaletrain.training.run_lock import acquire_run_lock, release_run_lock\n"
    "release_run_lock(acquire_run_lock(sys.argv[1]))\n"
    "print('restarted', flush=True)\n"
)


def test_a_restart_right_after_kill_9_waits_for_the_dying_run_and_is_not_refused(tmp_path):
    out, release = tmp_path / "run", tmp_path / "release"
    killed = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(out), str(release)], stdout=subprocess.PIPE,
                              text=True, env=ENV)
    try:
        assert killed.stdout.readline().strip() == "locked"
        killed.send_signal(signal.SIGKILL)  # not reaped yet: a zombie, as a supervisor may leave it for a moment
        restart = subprocess.Popen([sys.executable, "-c", RESTART, str(out)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=ENV)
        seen = []
        for line in restart.stderr:  # the restart found the lock still held, by the killed run, and waits
            seen.append(line)
            if "waiting up to" in line:
                break
        assert f"pid {killed.pid}" in seen[-1] and "(dying)" in seen[-1], "".join(seen)
        release.touch()  # what the killed run left behind lets go of the lock
        stdout, stderr = restart.communicate(timeout=120)
    finally:
        killed.kill()
        killed.wait()
    assert restart.returncode == 0, "".join(seen) + stderr
    assert stdout.strip() == "restarted" and re.search(r"let go after waiting \d+\.\d s", stderr), stderr


@pytest.fixture
def live_holder(tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(out), str(tmp_path / "never")],
                             stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield out, child
    finally:
        child.kill()
        child.wait()
        (tmp_path / "never").touch()  # its helper exits


def test_a_live_holder_is_still_refused_and_the_message_says_how_long_it_waited(live_holder):
    out, child = live_holder
    with pytest.raises(ConfigError) as err:
        acquire_run_lock(str(out))
    msg = str(err.value)
    assert f"pid {child.pid}" in msg and "in use by another run" in msg
    waited = float(re.search(r"waited (\d+\.\d) s for it to exit", msg).group(1))
    assert waited >= LIVE_GRACE_S
    assert not holds_run_lock(str(out))
    child.kill()
    child.wait()
    (out.parent / "never").touch()  # the helper lets go too: the folder is free again
    release_run_lock(acquire_run_lock(str(out)))
