"""SIGTERM / SIGINT to the Ray driver: the workers checkpoint and stop, and the driver returns.

Why a file: the driver cannot signal processes on other nodes, but every worker already
reaches ``output_dir`` (checkpoints go there), so the driver writes
``<output_dir>/ray/stop-request.json`` and each worker's :class:`RelayDriverStop`
turns it into :func:`~scaletrain.training.stopping.forward_signal`. From there it is
a signal like any other: the processes agree on it at the next log step, save a
checkpoint, write ``stop_reason`` and return; the launch then ends normally. The file
outlives a restart of the worker group, so workers restarted after the request stop
at once; a new launch removes it before it starts.

A second signal stops the driver without waiting (its Ray instance and workers go with
it; the last periodic checkpoint remains).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from scaletrain.folders import write_atomic
from scaletrain.training.callbacks import Callback, StepOutput
from scaletrain.training.protocol import TrainerView

STOP_FILE = "stop-request.json"  # under <output_dir>/ray (launcher.RAY_DIR)
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_request_path(ray_dir: str) -> str:
    return os.path.join(ray_dir, STOP_FILE)


def clear_stop_request(ray_dir: str) -> str:
    """Remove a request left by an earlier launch (it would stop this one at once); its path."""
    path = stop_request_path(ray_dir)
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    return path


def read_stop_request(path: str) -> str | None:
    """The signal the driver forwarded (``"SIGTERM"``), or None when there is no request."""
    try:
        with open(path) as f:
            return str(json.load(f).get("signal") or "a signal")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being written (the driver renames it into place) or unreadable
        return "a signal"


class DriverSignals:
    """While active (on the main thread), SIGTERM/SIGINT write the stop request instead of killing.

    ``requested`` is the first signal's name. Handlers are restored on exit. Ray
    installs its own SIGTERM handler at ``ray.init`` (exit 1) and Ray Train one for
    SIGINT inside ``fit()`` (abort without a checkpoint): enter this after
    ``ray.init`` and call ``fit()`` off the main thread so that neither replaces it.
    """

    def __init__(self, path: str):
        self.path = path
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> DriverSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            self._restore()
            _say(f"scaletrain: second signal ({name}): stopping now without waiting for the workers\n")
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested = name
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        write_atomic(self.path, json.dumps({"signal": name, "time": time.time(), "pid": os.getpid()}))
        _say(f"scaletrain: received {name}: the Ray workers will save a checkpoint and stop at their next "
             f"log step (send it again to stop at once)\n")


def _say(text: str) -> None:
    """Write to stderr from a signal handler (no logging lock that the interrupted code may hold)."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass


def call_off_main_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a helper thread while this thread waits, so signal handlers stay ours and run promptly."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # re-raised on the calling thread
            box["error"] = err

    worker = threading.Thread(target=target, name="scaletrain-ray-fit", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.5)  # wakes up for signal handlers; a bounded wait, not a timing assumption
    if "error" in box:
        raise box["error"]
    return box.get("result")


class RelayDriverStop(Callback):
    """On a worker: a stop request from the driver becomes a signal stop (agreed by all processes)."""

    def __init__(self, path: str):
        self.path = path

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._relay()

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        self._relay()

    def _relay(self) -> None:
        name = read_stop_request(self.path)
        if name is not None:
            from scaletrain.training.stopping import forward_signal

            forward_signal(f"{name} sent to the Ray driver")
