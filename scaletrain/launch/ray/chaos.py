"""Fault injection for testing fault tolerance: kill or signal one worker, once, mid-run.

Why in the package: Ray workers unpickle the job by importing the classes it names,
so a test-only callback defined in a test file would not import there. Use it to
check that *your* cluster setup restarts and resumes as you expect.
"""

from __future__ import annotations

import os
import signal
import time

from scaletrain.training.callbacks import Callback, StepOutput
from scaletrain.training.protocol import TrainerView


class KillWorkerOnce(Callback):
    """SIGKILL process ``rank`` right after step ``step``, unless ``marker`` exists.

    The marker file is written just before the kill, so the restarted run goes past
    ``step``. With ``wait_for_checkpoint`` the last asynchronous save is finished
    first, so the kill lands "after a checkpoint" rather than inside one.
    """

    def __init__(self, step: int, marker: str, rank: int = 1, wait_for_checkpoint: bool = True):
        self.step, self.marker, self.rank, self.wait_for_checkpoint = step, marker, rank, wait_for_checkpoint

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        import jax

        if step != self.step or jax.process_index() != self.rank or os.path.exists(self.marker):
            return
        metrics.host()  # the step itself has run
        if self.wait_for_checkpoint:
            trainer.wait_for_checkpoints()
        with open(self.marker, "w") as f:
            f.write(f"killed process {self.rank} after step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


class SignalWorkerOnce(Callback):
    """Send ``signum`` (SIGTERM: a preemption) to process ``rank`` itself right after step ``step``.

    The signal goes to the worker's own process, as a cluster scheduler's would;
    ``jax.distributed``'s preemption notifier takes it and tells every process. The
    callback then waits ``settle_s`` so the notice has reached the others before the
    next step: the processes must stop at one agreed step after it, with a checkpoint.
    A resumed run starts past ``step`` and is not signalled again.
    """

    def __init__(self, step: int, rank: int = 1, signum: int = signal.SIGTERM, settle_s: float = 2.0):
        self.step, self.rank, self.signum, self.settle_s = step, rank, signum, settle_s

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        import jax

        if step != self.step or jax.process_index() != self.rank or trainer.start_step >= self.step:
            return
        metrics.host()  # the step itself has run
        os.kill(os.getpid(), self.signum)
        time.sleep(self.settle_s)
