"""``scaletrain launch --nproc N RECIPE``: N processes of one ``jax.distributed`` job on this host.

For one host with several accelerators (one process per GPU, as ``torchrun`` does) and
for trying the multi-process path on a laptop (one CPU device per process). The
launcher checks the recipe and takes ``output_dir``'s run lock before any process
starts (its children's process 0 adopts it), picks a free port for the coordinator, and
starts ``scaletrain train`` N times with ``launch.*`` overrides. Then it:

- prefixes every line of a child's output with its rank (``[1] ...``);
- forwards SIGTERM / SIGINT (Ctrl-C) to every child as SIGTERM, which the processes agree
  on at their next log step: all stop after the same step, with one checkpoint; a second
  signal kills them;
- when a child fails (non-zero exit or killed), says which one in one line and gives the
  others ``kill_after`` seconds to end on their own (a user error every process sees
  ends them all at once) before killing them: a job with a dead process can train no
  further, and its survivors would otherwise wait for it;
- exits with the first failure's status (128 + signal for a killed child), else 0.
"""

from __future__ import annotations

import ctypes
import os

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from scaletrain.errors import ConfigError
from scaletrain.launch.batch_split import check_batch_split
from scaletrain.launch.xla_flags import without_device_count

#: grace given to the other processes after one failed, before they are killed (seconds)
DEFAULT_KILL_AFTER = 30.0
#: how a process says it stops because another was lost (:func:`~scaletrain.launch.jax.lost.lost_message`)
_LOST_LINE = b"scaletrain: error: lost "


def child_env(rank: int, token: str) -> dict[str, str]:
    """A child's environment: this one's, with one CPU device per process (several local CPU devices per
    process can hang later steps on the gloo collectives), and one accelerator per process unless the
    caller already chose (``JAX_LOCAL_DEVICE_IDS``, ``CUDA_VISIBLE_DEVICES``)."""
    from scaletrain.launch.jax.backend import LOCK_TOKEN_ENV

    env = dict(os.environ)
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
    if "JAX_LOCAL_DEVICE_IDS" not in env and "CUDA_VISIBLE_DEVICES" not in env:
        env["JAX_LOCAL_DEVICE_IDS"] = str(rank)  # GPUs: process i drives GPU i; ignored on CPU
    env[LOCK_TOKEN_ENV] = token
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    """A TCP port free on this host now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel kill the child when this launcher dies (Linux ``PR_SET_PDEATHSIG``):
    a launcher killed with SIGKILL cannot stop its children, and they would train on, orphaned."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    except (OSError, AttributeError):  # not Linux
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


@dataclass
class _Said:
    """What a child's output told, as its pumps read it: whether it stops because another process was lost,
    and how many of its streams are still open. A process that JAX ends says the lost line through its
    stderr guard after it died, so its output is read to the end before it is judged."""

    lost: bool = False
    open_streams: int = 2
    exited_at: float | None = None

    def heard(self, now: float) -> bool:
        """Whether its exit can be judged: its output ended, or it exited more than 2 s ago."""
        return self.open_streams == 0 or (self.exited_at is not None and now - self.exited_at > 2.0)


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock, said: _Said) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            said.lost = said.lost or line.startswith(_LOST_LINE)
            out.write(prefix + line)
            out.flush()
    stream.close()
    with lock:
        said.open_streams -= 1


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(rank: int, pid: int, code: int) -> str:
    if code < 0:
        return f"process {rank} (pid {pid}) was killed by {signal.Signals(-code).name}"
    return f"process {rank} (pid {pid}) exited with status {code}"


def launch_processes(recipe_path: str, overrides: Sequence[str], nproc: int, *,
                     kill_after: float = DEFAULT_KILL_AFTER, port: int | None = None) -> int:
    """Run the recipe as ``nproc`` processes of one job; the exit status (the first failure's, else 0)."""
    from scaletrain.recipe import Recipe
    from scaletrain.training.run_lock import acquire_run_lock, release_run_lock

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if kill_after <= 0:
        raise ConfigError(f"--kill-after must be > 0 seconds, got {kill_after}")
    recipe = Recipe.load(recipe_path, list(overrides))  # a bad recipe is one message, before any process starts
    if recipe.ray.num_workers:
        raise ConfigError("scaletrain launch starts its own processes: unset ray.num_workers "
                          "(or use scaletrain train for Ray)")
    check_batch_split(recipe.training.total_batch_size, nproc, "--nproc")
    lock = acquire_run_lock(recipe.training.output_dir)
    try:
        address = f"127.0.0.1:{port or free_port()}"
        base = [sys.executable, "-m", "scaletrain", "train", recipe_path, *overrides, "launch.backend=jax",
                f"launch.coordinator_address='{address}'", f"launch.num_processes={nproc}"]
        sys.stderr.write(f"scaletrain launch: {nproc} processes, coordinator {address}\n")
        return _supervise([[*base, f"launch.process_id={rank}"] for rank in range(nproc)], lock.token, kill_after)
    finally:
        release_run_lock(lock)


def _supervise(commands: list[list[str]], token: str, kill_after: float) -> int:
    out_lock = threading.Lock()
    children: list[subprocess.Popen] = []
    said: list[_Said] = []
    pumps: list[threading.Thread] = []
    signals: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread only
        previous = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
    on_parent_death = _die_with_parent()
    try:
        for rank, command in enumerate(commands):
            # a session of its own: Ctrl-C reaches the children once, through this process
            child = subprocess.Popen(command, env=child_env(rank, token), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, preexec_fn=on_parent_death)
            children.append(child)
            said.append(_Said())
            for stream, out in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)):
                pump = threading.Thread(target=_pump, args=(stream, f"[{rank}] ".encode(), out, out_lock,
                                                            said[rank]), daemon=True)
                pump.start()
                pumps.append(pump)
        status = _watch(children, signals, kill_after, out_lock, said)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for pump in pumps:
            pump.join(5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _watch(children: list[subprocess.Popen], signals: list[int], kill_after: float, out_lock: threading.Lock,
           said: list[_Said]) -> int:
    """Wait for the children; forward signals; after the first failure, kill the rest after ``kill_after`` s."""
    forwarded = 0
    failure: tuple[int, float] | None = None  # (status, when)
    while True:
        running = any(c.poll() is None for c in children)  # read before the checks: none is missed at the end
        if len(signals) > forwarded:
            forwarded = len(signals)
            how = signal.SIGTERM if forwarded == 1 else signal.SIGKILL
            _say(out_lock, f"scaletrain launch: received {signal.Signals(signals[-1]).name}: "
                 + ("the processes save a checkpoint and stop at their next log step (send it again to kill them)"
                    if forwarded == 1 else "killing the processes"))
            for child in children:
                if child.poll() is None:
                    child.send_signal(how)
        if failure is None:
            if (cause := _cause(children, said)) is not None:
                rank, child = cause
                failure = (_status(child.returncode), time.monotonic())
                why = (" after the forwarded signal" if forwarded else
                       "; the job cannot go on without it: the other processes stop")
                _say(out_lock, f"scaletrain launch: {_describe(rank, child.pid, child.returncode)}{why}"
                     + (f" (any still running are killed after {kill_after:g} s)" if running else ""))
        elif time.monotonic() - failure[1] > kill_after:
            for child in children:
                if child.poll() is None:
                    child.kill()
        if not running and all(heard.heard(time.monotonic()) for heard in said):
            break  # every process ended and what it said was read
        time.sleep(0.1)
    return failure[0] if failure is not None else 0


def _cause(children: list[subprocess.Popen], said: list[_Said]) -> tuple[int, subprocess.Popen] | None:
    """The failed child to report, or None: one that did not merely stop because another was lost
    (:data:`~scaletrain.launch.jax.lost.LOST_EXIT`, or ended by JAX after saying so) first, since it is
    the cause; then the lowest rank."""
    from scaletrain.launch.jax.lost import LOST_EXIT

    now = time.monotonic()
    for child, heard in zip(children, said):
        if heard.exited_at is None and child.poll() is not None:
            heard.exited_at = now
    failed = [(rank, c) for rank, c in enumerate(children) if c.poll() not in (None, 0) and said[rank].heard(now)]
    return min(failed, key=lambda rc: (rc[1].returncode == LOST_EXIT or said[rc[0]].lost, rc[0]), default=None)


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
