"""Ray runs end the documented way: signals, restarts and user errors (issue 16: 3, 4, 9, 12, 15).

- SIGINT / SIGTERM to `scaletrain train ... ray.num_workers=2` (the driver): the workers
  save a checkpoint and stop, `summary.json` has the `stop_reason`, exit status 0.
- After a restart of the worker group `metrics.jsonl` marks where the redone steps begin.
- User errors: no cluster at `ray.address=auto`, a recipe the driver can reject
  without a worker, a user error raised on a worker (never retried), and restarts
  that run out — each one message, not a traceback.

Signals are sent when a line appears in a file the run writes (never after a sleep);
every subprocess runs under `timeout -s KILL` or is SIGKILLed in a `finally` (a hung
JAX process ignores SIGTERM).
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from xla_testing import CHEAP_COMPILE

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "sweep.yaml")
TINY = ["model.hidden_size=16", "model.intermediate_size=32", "model.num_hidden_layers=1",
        "data.max_documents=2", "training.max_length=32", "training.total_batch_size=4",
        "training.max_training_steps=100000", "training.log_steps=2", "training.save_steps=100000",
        "training.max_evaluation_steps=1", "training.report_to=[]", "ray.num_workers=2"]
WAIT_S = 240  # ceiling on any wait below; a healthy run takes a fraction of it


def _env(**extra):
    # no fake devices for a real CLI run, the suite's cheap compile setting, which the driver passes to its Ray
    # workers (launch/xla_flags.py); no figure here is compared with another process's
    env = {**os.environ, "XLA_FLAGS": CHEAP_COMPILE}
    env.update(PYTHONPATH=ROOT, RAY_AUTH_MODE="disabled", JAX_PLATFORMS="cpu", **extra)
    return env


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.endswith("\n")]
    except FileNotFoundError:
        return []


def _wait_for(what, predicate, proc=None):
    """Poll a file-backed ``predicate`` until it holds (fails if ``proc`` exits first or after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert proc is None or proc.poll() is None, f"the run ended before {what}: rc {proc.returncode}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _train_steps(run):
    return [r["step"] for r in _records(run / "metrics.jsonl") if r.get("split") == "train"]


def _signal_cli(tmp_path, sig, after_step, *overrides):
    """Start the CLI on 2 Ray workers, send ``sig`` to it once ``after_step`` is logged; (rc, stderr, summary)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "scaletrain", "train", RECIPE, *TINY, f"training.output_dir={run}", *overrides]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(f"step {after_step} in metrics.jsonl", lambda: any(s >= after_step for s in _train_steps(run)), proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    return proc.returncode, out + err, summary


# ---- in-process launches on tests/conftest.py's Ray instance -------------------------------------
# First in the file: they share the instance test_ray_launch.py's tests leave running (it stops
# after the last consecutive test that asks for it, before the CLI tests below need none).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file


@dataclass
class FailingJob:
    """A job whose worker ``rank`` raises: a user error (``DataError``) or a crash (``RuntimeError``)."""

    user_error: bool
    rank: int = 1

    def __call__(self, callbacks):
        import jax

        from scaletrain.errors import DataError

        if jax.process_index() == self.rank:
            if self.user_error:
                raise DataError("data.source 'corpus/*.txt' has no rows (raised on a worker)")
            raise RuntimeError("boom on purpose")
        return {}


def _attempts(folder):
    return _records(folder / "ray_attempts.jsonl")


def test_user_error_on_a_worker_is_not_retried(ray_instance, tmp_path):
    from scaletrain.launch.ray.launcher import launch_on_ray
    from scaletrain.errors import DataError

    with pytest.raises(DataError, match="has no rows"):
        launch_on_ray(FailingJob(user_error=True), num_workers=2, output_dir=str(tmp_path), max_failures=2)
    assert len(_attempts(tmp_path)) == 1  # before: 3 attempts (max_failures=2 retries), then the error


def test_exhausted_restarts_give_one_message(ray_instance, tmp_path):
    from scaletrain.launch.ray.failures import WorkersFailedError
    from scaletrain.launch.ray.launcher import launch_on_ray

    with pytest.raises(WorkersFailedError) as info:
        launch_on_ray(FailingJob(user_error=False), num_workers=2, output_dir=str(tmp_path), max_failures=1)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600, message  # before: ~390 lines of WorkerGroupError
    assert "2 time(s), more than ray.max_failures=1" in message
    assert "rank 1: RuntimeError: boom on purpose" in message and "no checkpoint was saved" in message
    assert [a["attempt"] for a in _attempts(tmp_path)] == [1, 2]


def test_driver_sigint_stops_the_workers_with_a_checkpoint(tmp_path):
    """Before: rc 1, no stop checkpoint (SIGINT printed nothing). After: rc 0, a checkpoint and a stop_reason."""
    rc, text, summary = _signal_cli(tmp_path, signal.SIGINT, 2)
    assert rc == 0, text[-3000:]
    assert "scaletrain: received SIGINT" in text, text[-3000:]
    assert not any(line.startswith("Traceback") for line in text.splitlines())  # none from the driver itself
    first = summary["final_step"]
    assert "SIGINT sent to the Ray driver" in summary["stop_reason"] and first < 100000
    assert summary["checkpoint"].endswith(f"checkpoints/{first}")
    assert (tmp_path / "run" / "checkpoints" / str(first)).is_dir()



def test_driver_signals_write_one_request_and_a_new_launch_clears_it(tmp_path):
    """SIGTERM on the driver's main thread becomes the stop request the workers read (the same
    handler as SIGINT above); a second signal stops at once; an old request never stops a new launch."""
    from scaletrain.launch.ray.driver_stop import DriverSignals, clear_stop_request, stop_request_path

    ray_dir = str(tmp_path / "ray")
    path = clear_stop_request(ray_dir)
    with DriverSignals(path) as signals:
        signal.raise_signal(signal.SIGTERM)
        assert signals.requested == "SIGTERM"
        assert json.loads(open(path).read())["signal"] == "SIGTERM"
        with pytest.raises(SystemExit) as second:
            signal.raise_signal(signal.SIGTERM)
        assert second.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not signals._on_signal  # handlers restored
    assert clear_stop_request(ray_dir) == stop_request_path(ray_dir) and not os.path.exists(path)


def test_user_errors_found_without_a_worker(tmp_path):
    """Before: a traceback (rc 1) for `ray.address=auto` with no cluster; the batch split and a
    missing data file were found on the workers, after Ray's retries."""
    env = _env(RAY_TMPDIR=str(tmp_path / "ray-tmp"))  # no cluster file there: `auto` finds nothing
    env.pop("RAY_ADDRESS", None)
    cmd = ["timeout", "-s", "KILL", str(WAIT_S), sys.executable, "-m", "scaletrain", "train", RECIPE, *TINY,
           "training.output_dir=run", "ray.address=auto"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]  # one line
    assert "ray.address='auto': no Ray cluster could be reached" in res.stderr

    from scaletrain.launch import run_recipe
    from scaletrain.errors import ConfigError, DataError
    from scaletrain.recipe import Recipe

    run = tmp_path / "checked"
    for override, error, text in [("ray.num_workers=3", ConfigError, "total_batch_size=4 cannot be split among "
                                   "ray.num_workers=3"),
                                  ("data.source=/nonexistent/*.txt", DataError, "no files match")]:
        recipe = Recipe.load(RECIPE, [*TINY, f"training.output_dir={run}", override])
        with pytest.raises(error, match=text):
            run_recipe(recipe)
    assert not run.exists()  # refused before Ray started a worker (which creates output_dir/ray)
