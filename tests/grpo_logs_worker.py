"""A tiny GRPO recipe run that logs completions on steps 2, 4 and 6, used as a subprocess by tests/test_log_appends.py.

Usage: python grpo_logs_worker.py WORKDIR RUN [- | kill STEP | limit STEP]
WORKDIR holds prompts.jsonl and tok/ (written by the test); the run goes to WORKDIR/RUN.
``kill STEP``: SIGKILL right after STEP, once its checkpoint writes are complete.
``limit STEP``: just before STEP, with every checkpoint written, the kernel's file-size limit
(``RLIMIT_FSIZE``, SIGXFSZ ignored) is set to 64 bytes beyond ``completions.jsonl``'s size, so
STEP's completions are written part-way and then refused (EFBIG), as a disk that fills up
refuses them; the run ends as ``scaletrain train`` ends it (``report_user_error``: one line).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
from typing import Any

import scaletrain as st

from grpo_testing import tiny_grpo_recipe
from resume_worker import KillAt, status_as_the_cli

LOG_EVERY, SAVE_STEPS, MAX_STEPS = 2, 3, 6
ROOM = 64  # bytes the limited file may still grow: less than one completion record


def recipe(workdir: str, out: str) -> st.Recipe:
    return st.Recipe.from_dict(tiny_grpo_recipe(
        workdir, {"output_dir": out, "total_batch_size": 16, "max_training_steps": MAX_STEPS, "save_steps": SAVE_STEPS,
                  "resume_if_possible": True},
        {"reward_funcs": [{"function": "format_regex", "pattern": r"(?s).*\b(yes|no|maybe|one|two)\b.*"}],
         "log_completions_steps": LOG_EVERY}))


class LimitFileSizeAt(st.Callback):
    """Before ``step``: the checkpoints finished, then no file may grow past ``completions.jsonl`` + ROOM bytes."""

    def __init__(self, step: int, out: str):
        self.step, self.path = step, os.path.join(out, "completions.jsonl")

    def pre_step(self, trainer: Any, step: int) -> None:
        if step != self.step:
            return
        trainer.wait_for_checkpoints()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of refusing
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(self.path) + ROOM, hard))


def main() -> int:
    from scaletrain.run import run_training

    workdir, out = sys.argv[1], os.path.join(sys.argv[1], sys.argv[2])
    mode, at = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else ("-", 0)
    callbacks = {"-": [], "kill": [KillAt(at)], "limit": [LimitFileSizeAt(at, out)]}[mode]
    return status_as_the_cli(lambda: run_training(recipe(workdir, out), callbacks=callbacks))


if __name__ == "__main__":
    sys.exit(main())
