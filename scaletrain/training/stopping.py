"""Stopping rules as callbacks (ArcticTraining's early exit and kill switch), and the NaN guard.

Each rule asks the loop to stop with a reason; the trainer then saves a
checkpoint and writes the reason to summary.json, so resuming continues exactly.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import numpy as np

from scaletrain.errors import ScaletrainError
from scaletrain.training.callbacks import Callback, StepOutput
from scaletrain.training.protocol import TrainerView

logger = logging.getLogger("scaletrain")

# Stops forwarded to this process from outside its main thread (e.g. the Ray driver's
# SIGTERM, relayed by the launcher): a Ray worker runs the loop in a thread that may not
# install signal handlers, so the relay calls forward_signal instead. Process-wide, like
# the signals themselves; cleared when a training starts.
_forwarded: list[str] = []
# Signals this process received during the running training (the handler's record, read by
# pending_signal while a step waits on user code); cleared when a training starts.
_received: list[str] = []


def forward_signal(description: str) -> None:
    """Stop the running training as if this process had received a signal (any thread).

    ``description`` goes into the stop reason (``"SIGTERM sent to the Ray driver"``).
    In a multi-process run the stop is agreed like a signal: every process stops
    after the same log step, with a checkpoint.
    """
    if description not in _forwarded:
        _forwarded.append(description)


def pending_signal() -> str | None:
    """The signal (or forwarded stop) this process has received during the running training, if any.

    Why: a step that waits on user code (a reward function) checks it while it waits, so a signal
    stops the run within seconds instead of after a call that may never return (it then raises
    :class:`StepInterrupted`).
    """
    return _received[0] if _received else (_forwarded[0] if _forwarded else None)


class StepInterrupted(Exception):
    """Raised by a step, before it changed the state, when a stop arrived while it waited (for user code).

    The loop stops as for a signal after a step, but at the step before: the final checkpoint holds the
    state and data position from before this step, so a resumed run takes this step again, whole.
    """


def _preemption_notice(step: int) -> bool:
    """Whether JAX's preemption service has seen a SIGTERM on any process (multi-process runs).

    Why: ``jax.distributed.initialize`` installs JAX's preemption notifier, which takes
    SIGTERM before any Python handler could (and a Ray worker's loop thread may not
    install one at all). The notice reaches every process through the coordination
    service; JAX names the step at which all have it, which must be asked at every step.
    """
    from jax._src import distributed

    manager = distributed.global_state.preemption_sync_manager
    return manager is not None and bool(manager.reached_sync_point(step))


class NonFiniteLossError(ScaletrainError):
    """A step produced a non-finite loss or gradient and ``break_on_nan`` is set."""


class StoppingRules(Callback):
    """``exit_iteration``, ``exit_iteration_this_run``, kill switch, time limit, SIGTERM/SIGINT."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._signal: str | None = None

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._signal = None
        _forwarded.clear()
        _received.clear()
        self._deadline = (
            None if trainer.arguments.time_limit_seconds is None
            else time.monotonic() + trainer.arguments.time_limit_seconds
        )
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._check(trainer, trainer.global_step)  # a resumed run may already be past a limit

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signal.Signals(signum).name
        _received.append(self._signal)

    def post_train(self, trainer: TrainerView, state: Any) -> None:
        for sig, handler in self._previous.items():  # None: the handler was set outside Python (JAX's)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        self._check(trainer, step)

    def _check(self, trainer: TrainerView, step: int) -> None:
        import jax

        a = trainer.arguments
        multi = jax.process_count() > 1
        if self._signal is None or multi:  # step counts are the same on every process: no agreement needed
            if a.exit_iteration is not None and step >= a.exit_iteration:
                trainer.request_stop(f"reached exit_iteration {a.exit_iteration}")
                return
            if a.exit_iteration_this_run is not None and step - trainer.start_step >= a.exit_iteration_this_run:
                trainer.request_stop(f"reached exit_iteration_this_run {a.exit_iteration_this_run} (step {step})")
                return
        if multi and self._signal is None and _preemption_notice(step):
            self._signal = "SIGTERM (JAX preemption notice)"
        code = self._local_code(trainer)
        if multi:
            # Signals, the kill switch and the clock are seen by each process on its own; all
            # must stop after the same step or their collectives hang. They agree at log steps
            # (the same steps everywhere, where the loop waits for the device anyway).
            if step % a.log_steps and step < trainer.max_training_steps:
                return
            code, signal_name = _agree(code, self._signal)
        else:
            signal_name = self._signal
        if code == 1:
            trainer.request_stop(f"received {signal_name or 'a signal (on another process)'} at step {step}")
        elif code == 2:
            trainer.request_stop(f"found kill switch {a.kill_switch_path} at step {step}")
        elif code == 3:
            trainer.request_stop(f"reached training_time_limit {a.training_time_limit} at step {step}")

    def _local_code(self, trainer: TrainerView) -> int:
        """What this process sees: 1 a signal, 2 the kill switch, 3 the time limit, 0 nothing."""
        a = trainer.arguments
        if self._signal is None and _forwarded:
            self._signal = _forwarded[0]
        if self._signal is not None:
            return 1
        if a.kill_switch_path and os.path.exists(a.kill_switch_path):
            return 2
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return 3
        return 0


class NanGuard(Callback):
    """Watch ``nonfinite`` from the step (whose update was already withheld on device).

    ``break_on_nan``: stop the run with an error naming the step (checked one step
    late, so the host never waits for the step it just launched). Otherwise count
    the skipped updates on device and report the count at log steps.
    """

    def __init__(self) -> None:
        self._pending: tuple[int, StepOutput] | None = None
        self.skipped: Any = 0.0

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._pending = None

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        if trainer.arguments.break_on_nan:
            self._check_pending(trainer)
            self._pending = (step, metrics)
        else:
            self.skipped = self.skipped + metrics.device("nonfinite")

    def _check_pending(self, trainer: TrainerView) -> None:
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            if metrics.host()["nonfinite"]:
                trainer.fail(NonFiniteLossError(
                    f"non-finite loss or gradient at step {step}; the update was not applied and nothing "
                    "after the last checkpoint was saved (set training.break_on_nan=false to skip such "
                    "updates instead)"
                ))

    def post_epoch(self, trainer: TrainerView, epoch: int) -> None:
        if trainer.arguments.break_on_nan:
            self._check_pending(trainer)

    def skipped_count(self) -> int:
        import jax

        return int(jax.device_get(self.skipped))


#: bytes of a signal's name sent along with the stop code (``SIGINT sent to the Ray driver`` fits)
_NAME_BYTES = 63


def _agree(code: int, signal_name: str | None) -> tuple[int, str | None]:
    """The stop code all processes agree on (the lowest nonzero one, as in one process) and the name
    of the signal behind it, as the first process that saw one names it.

    Why the name travels too: a driver's stop request is read by each process on its own, so at a
    log step one process may have read it and another not yet; without the name the others would
    say only "a signal (on another process)".
    """
    from jax.experimental import multihost_utils

    row = np.zeros(1 + _NAME_BYTES, np.int32)
    row[0] = code
    name = (signal_name or "").encode()[:_NAME_BYTES]
    row[1:1 + len(name)] = np.frombuffer(name, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, 1 + _NAME_BYTES)
    seen = [int(c) for c in rows[:, 0] if c]
    agreed = min(seen) if seen else 0
    names = [bytes(r[1:][r[1:] > 0].astype(np.uint8)).decode(errors="replace") for r in rows if r[1] > 0]
    return agreed, signal_name or (names[0] if names else None)
