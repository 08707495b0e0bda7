"""Real multi-process training without Ray: `scaletrain launch --nproc 2`, processes started by hand
from Slurm's variables, a killed process, and resumes on another process count.

Each process has one CPU device (the launcher and these tests strip the test session's 8 fake devices
from the children's XLA_FLAGS, and keep its compile setting: tests/xla_testing.py) and they meet through
jax.distributed on localhost. The main recipe is shrunk to a 1-layer model, 6 steps, a checkpoint every
2 steps, every step logged with its data
fingerprint (a hash of the global batch's token ids). Every child runs under a hard time limit and
nothing outlives its test (_kill_leftovers).

Tolerance for losses across process counts: rtol = atol = 2e-5. The same global batch gives the same
sums, but added in another order (two processes' partial sums all-reduced over gloo against eight
devices' partial sums in one process), so float32 rounding differs by a few ulps (~1e-7 relative) per
reduction; six Adam steps carry that into the losses at ~1e-6 (measured: see the printed maximum).
The tokens seen at each step (the fingerprints) and the step numbers must be equal exactly, and the
same process count must give bitwise the same parameters (params_sha256).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from scaletrain.recipe import Recipe
from scaletrain.run import run_training
from xla_testing import CHEAP_COMPILE

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "shakespeare.yaml")
TINY = ["training.max_training_steps=6", "training.save_steps=2", "training.log_steps=1", "training.warmup_steps=1",
        "training.evaluation_steps=null", "data.max_documents=3", "data.eval_fraction=0", "model.num_hidden_layers=1",
        "model.hidden_size=64", "model.intermediate_size=128", "sample.max_new_tokens=0",
        "training.progress_bar=false", "training.log_data_fingerprint=true"]
LIMIT_S = 300  # hard limit of one multi-process run (a few times its usual length on a loaded 2-core machine)
RTOL = ATOL = 2e-5


def _env(**extra) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": CHEAP_COMPILE, **extra}  # one device, this process's compile
    return {k: v for k, v in env.items() if not k.startswith(("SLURM_", "JAX_COORDINATOR", "JAX_PROCESS",
                                                               "JAX_NUM_PROCESSES")) or k in extra}


def _kill_leftovers(out) -> None:
    """Kill any process still running for this output folder (a failed assertion must not leave one)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if f"training.output_dir={out}\0" in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _launch(out, *extra, kill_after: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scaletrain", "launch", "--nproc", "2", "--kill-after",
                             str(kill_after), RECIPE, f"training.output_dir={out}", *TINY, *extra],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(child: subprocess.Popen, out) -> tuple[int, str]:
    try:
        text, _ = child.communicate(timeout=LIMIT_S)
    finally:
        _kill_leftovers(out)
    return child.returncode, text


def _train_steps(out) -> dict[int, dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r for r in lines if r.get("split") == "train"}


def _summary(out) -> dict:
    return json.loads(open(os.path.join(out, "summary.json")).read())


def _copy_checkpoint(source, step: int, dest) -> None:
    os.makedirs(dest / "checkpoints")
    shutil.copytree(os.path.join(source, "checkpoints", str(step)), dest / "checkpoints" / str(step))


def _in_this_process(out, *extra) -> dict:
    """One process with the test session's 8 CPU devices: the same global batch of 16 rows."""
    return run_training(Recipe.load(RECIPE, [f"training.output_dir={out}", *TINY, *extra]))


def _same_tokens_and_close_losses(ours: dict[int, dict], ref: dict[int, dict], steps) -> float:
    assert sorted(ours) == list(steps)
    assert [ours[s]["data/fingerprint"] for s in steps] == [ref[s]["data/fingerprint"] for s in steps]
    np.testing.assert_allclose([ours[s]["loss"] for s in steps], [ref[s]["loss"] for s in steps],
                               rtol=RTOL, atol=ATOL)
    return max(abs(ours[s]["loss"] - ref[s]["loss"]) for s in steps)


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory):
    """Two processes started as srun starts them (SLURM_* on localhost; JAX finds coordinator, count and id)."""
    out = tmp_path_factory.mktemp("slurm") / "run"
    port = _free_port()
    children = []
    try:
        for rank in range(2):
            env = _env(SLURM_JOB_ID="77", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                       SLURM_LOCALID=str(rank), SLURM_STEP_NUM_NODES="1", JAX_COORDINATOR_PORT=str(port))
            children.append(subprocess.Popen(
                [sys.executable, "-m", "scaletrain", "train", RECIPE, f"training.output_dir={out}", *TINY],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        texts = [c.communicate(timeout=LIMIT_S)[0] for c in children]
    finally:
        _kill_leftovers(out)
    assert [c.returncode for c in children] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    assert f"launch          jax.distributed: process 0 of 2, coordinator localhost:{port} (slurm detected by " \
           "JAX)" in texts[0]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    _in_this_process(out)
    return out


def test_two_processes_by_hand_match_one_process(by_hand, one_process):
    summary = _summary(by_hand)
    assert summary["process_count"] == 2 and summary["final_step"] == 6
    worst = _same_tokens_and_close_losses(_train_steps(by_hand), _train_steps(one_process), range(1, 7))
    print(f"\nmax |loss(2 processes) - loss(1 process)| over 6 steps = {worst:.3g}")
    # process 0 alone wrote the run's files, and the lock is free again
    assert sorted(p.name for p in by_hand.iterdir() if not p.name.startswith(".")) == [
        "checkpoints", "data_stats.json", "metrics.jsonl", "recipe.yaml", "summary.json", "tensorboard"]


def test_two_to_one_process_resume_sees_the_same_tokens(by_hand, tmp_path):
    out = tmp_path / "two-to-one"
    _copy_checkpoint(by_hand, 2, out)
    summary = _in_this_process(out, "training.resume_if_possible=true")
    assert summary["final_step"] == 6 and summary["resumed_from"].endswith(os.path.join("checkpoints", "2"))
    _same_tokens_and_close_losses(_train_steps(out), _train_steps(by_hand), range(3, 7))


def test_one_to_two_processes_resume_sees_the_same_tokens(one_process, by_hand, tmp_path):
    out = tmp_path / "one-to-two"
    _copy_checkpoint(one_process, 2, out)
    code, text = _finish(_launch(out, "training.resume_if_possible=true"), out)
    assert code == 0, text[-4000:]
    _same_tokens_and_close_losses(_train_steps(out), _train_steps(by_hand), range(3, 7))


def test_a_killed_process_stops_the_job_and_a_restart_ends_identical(by_hand, tmp_path):
    """kill -9 of process 1 after the step-2 checkpoint: the launcher names it in one line, process 0 stops
    within its heartbeat timeout (by its own error naming process 1 when it was in a step's collective, by
    JAX's when it was in a checkpoint's barrier: which one is a matter of timing, so not asserted), and the
    launcher exits with the killed process's status; launched again, the run resumes and ends with the
    parameters of the uninterrupted run."""
    out = tmp_path / "killed"
    launcher = _launch(out, "launch.heartbeat_timeout=5", kill_after=60)
    try:
        victim = _wait_for_checkpoint_then_find(out, rank=1, launcher=launcher)
        os.kill(victim, signal.SIGSTOP)  # frozen at once: it cannot finish the run before the kill lands
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        code, text = _finish(launcher, out)
        took = time.monotonic() - killed_at
    finally:
        _kill_leftovers(out)
    assert code == 128 + signal.SIGKILL, text[-4000:]
    assert f"scaletrain launch: process 1 (pid {victim}) was killed by SIGKILL" in text
    assert took < 5 + 15, took  # process 0's heartbeat timeout, and a margin for a loaded machine
    assert not (out / "summary.json").exists()
    print(f"\nprocess 1 killed: the launcher exited {took:.1f} s later; process 0 said:\n"
          + "\n".join(x for x in text.splitlines() if x.startswith("[0]") and "rror" in x)[-2000:])
    code, text = _finish(_launch(out, "training.resume_if_possible=true"), out)
    assert code == 0, text[-4000:]
    summary = _summary(out)
    assert int(os.path.basename(summary["resumed_from"])) >= 2 and summary["final_step"] == 6
    assert summary["params_sha256"] == _summary(by_hand)["params_sha256"]


def _wait_for_checkpoint_then_find(out, rank: int, launcher: subprocess.Popen) -> int:
    """The pid of process ``rank`` of the launch, once the step-2 checkpoint is complete."""
    deadline = time.monotonic() + LIMIT_S
    while not (out / "checkpoints" / "2").is_dir():
        assert launcher.poll() is None and time.monotonic() < deadline, "the launch ended before its checkpoint"
        time.sleep(0.05)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"training.output_dir={out}" in args and f"launch.process_id={rank}" in args:
            return int(pid)
    raise AssertionError(f"process {rank} of the launch is not running")


def test_sigterm_to_the_launcher_stops_every_process_at_one_step_with_one_checkpoint(tmp_path):
    """Ctrl-C / SIGTERM reach every process as SIGTERM; they agree on it at a log step and stop there.
    A long horizon (200 steps) so the signal always lands mid-run: where it lands is not asserted."""
    out = tmp_path / "stopped"
    launcher = _launch(out, "training.max_training_steps=200", "training.save_steps=null", "training.log_steps=2")
    lines = []
    try:
        for line in launcher.stdout:  # read until the run has taken its first logged step
            lines.append(line)
            if "INFO scaletrain: step 2/200" in line:
                launcher.send_signal(signal.SIGTERM)
                break
        code, text = _finish(launcher, out)
    finally:
        _kill_leftovers(out)
    text = "".join(lines) + text
    assert code == 0, text[-4000:]
    stops = [x.split("INFO scaletrain: ")[1] for x in text.splitlines() if "INFO scaletrain: stopped:" in x]
    assert len(stops) == 2 and stops[0] == stops[1], stops  # both processes, the same step
    step = int(stops[0].rsplit(" ", 1)[1])
    assert stops[0] == f"stopped: received SIGTERM at step {step}" and 2 < step < 200
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [str(step)]
    assert _summary(out)["stop_reason"] == f"received SIGTERM at step {step}"


LOOP = """
import sys, time
import numpy as np
from scaletrain.launch.jax import rendezvous
from scaletrain.launch.jax.backend import initialize
from scaletrain.launch.jax.lost import run_naming_a_lost_process
from scaletrain.launch.jax.settings import JaxJob

job = JaxJob(f"127.0.0.1:{sys.argv[1]}", 2, int(sys.argv[2]), 120, 60, "test")
rendezvous.host(job, lambda: None) if job.process_id == 0 else rendezvous.join(job)
initialize(job)
from jax.experimental import multihost_utils

def steps():  # a collective every 50 ms, as a training's steps
    for i in range(100_000):
        multihost_utils.process_allgather(np.array([i]))
        if i == 3:
            print("steady", flush=True)
        time.sleep(0.05)

run_naming_a_lost_process(job, steps)
"""


def test_a_process_started_by_hand_names_the_lost_one_at_once():
    """Two processes started by hand on one host, in a loop of collectives; kill -9 of process 1: process 0's
    next collective fails, it finds process 1's pid gone, says so in one line and exits 3, long before the
    heartbeat timeout (60 s) would have ended it."""
    port = _free_port()
    children = [subprocess.Popen([sys.executable, "-c", LOOP, str(port), str(rank)], env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        assert "steady" in (line.strip() for line in iter(children[0].stdout.readline, ""))  # gloo prints too
        children[1].kill()
        killed_at = time.monotonic()
        children[0].wait(timeout=60)
        took = time.monotonic() - killed_at
        errors = [x for x in children[0].stderr.read().splitlines() if x.startswith("scaletrain: error:")]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert children[0].returncode == 3, errors
    assert errors == ["scaletrain: error: lost process 1 of 2 (it stopped answering: killed, crashed or its host "
                      "is unreachable); process 0 stops too. Start every process again with "
                      "training.resume_if_possible=true to continue from the newest checkpoint"]
    assert took < 20, took
    print(f"\nprocess 0 named the lost process {took:.1f} s after the kill")


def test_losing_process_0_is_one_line_on_the_survivor_and_the_job_listened_on_the_loopback_only():
    """Two processes by hand on 127.0.0.1; while they run, nothing of the job listens on another interface
    (JAX's coordination service binds the coordinator's address, not every interface; gloo's own listeners
    are on the loopback too). kill -9 of process 0,
    which hosts that service: the survivor says the documented line and nothing else on stderr, with no native
    stack trace, whether our code sees the loss first (exit 3) or JAX ends it from C++ (SIGABRT)."""
    from launch_net_testing import listening_addresses
    from scaletrain.launch.jax.lost import lost_message

    port = _free_port()
    children = [subprocess.Popen([sys.executable, "-c", LOOP, str(port), str(rank)], env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        assert "steady" in (line.strip() for line in iter(children[0].stdout.readline, ""))
        listening = listening_addresses(pids=[child.pid for child in children])  # coordinator, gloo
        children[0].kill()
        children[1].wait(timeout=60)
        err = children[1].stderr.read()
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert len(listening) >= 2 and all(ip.is_loopback for ip in listening), listening
    assert children[1].returncode in (3, -6), err
    assert err.splitlines() == [lost_message(1, 2, [0])], err
