"""A tiny training run whose disk fills up, ended as ``scaletrain train`` ends a run (tests/test_disk_full.py).

Usage: python disk_full_worker.py OUTPUT_DIR REPORT_TO refuse STEP FAILED_AT_FILE
       python disk_full_worker.py OUTPUT_DIR REPORT_TO pause READY_FILE GO_FILE

REPORT_TO is comma-separated (``none`` for no side logger). ``refuse``: every array
write of the save at STEP fails in orbax's writer thread with TensorStore's own ENOSPC
error, as on a full disk; the time of the first refused write goes to FAILED_AT_FILE.
``pause``: after the first checkpoint is complete the run creates READY_FILE and waits
for GO_FILE, so the test can fill OUTPUT_DIR's (real, small) filesystem at that moment.
Logging is the CLI's (``setup_logging``) with INFO off, so stderr holds only what
a user must read; errors end the process through the CLI's own ``report_user_error``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model

from resume_worker import status_as_the_cli

SAVE_STEPS, MAX_STEPS = 20, 60
# TensorStore's words for a full disk, as orbax's writer thread raises them
ENOSPC_TEXT = ('RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database: Failed to write 9360 bytes to '
               "file 6: No space left on device [os_error_code='28']")


def build_trainer(out: str, report_to: tuple[str, ...], callbacks: Sequence[st.Callback] = ()) -> st.Trainer:
    """The run (also built in the test's process for the uninterrupted reference and the resume)."""
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 128, rng.integers(6, 20))} for _ in range(64)]
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, sharding_axis_dims=(1, -1, 1, 1, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    args = st.TrainingArguments(
        output_dir=out, total_batch_size=8, max_length=16, num_train_epochs=None, max_training_steps=MAX_STEPS,
        learning_rate=1e-2, warmup_steps=2, log_steps=1, save_steps=SAVE_STEPS, resume_if_possible=True,
        progress_bar=False, do_eval=False, report_to=report_to,
    )
    return st.Trainer(args, model=model, dataset_train=data, callbacks=list(callbacks))


def refuse_writes_of_save(step: int, failed_at: str) -> None:
    """Every array write of the save at ``step`` fails as TensorStore fails on a full disk."""
    from orbax.checkpoint._src.serialization import serialization

    real = serialization.async_serialize_from_host
    marker = f"/{step}.orbax-checkpoint-tmp/"

    async def write(rslices: Any, tensorstore_spec: dict[str, Any], **kw: Any) -> Any:
        if marker not in json.dumps(tensorstore_spec, default=str):
            return await real(rslices, tensorstore_spec, **kw)
        with open(failed_at, "a") as f:
            f.write(f"{time.time()}\n")
        raise ValueError(ENOSPC_TEXT)

    serialization.async_serialize_from_host = write


class PauseAfterFirstSave(st.Callback):
    """At the step after the first save: finish it, say so (READY), wait for the test's GO."""

    def __init__(self, ready: str, go: str):
        self.ready, self.go = ready, go

    def post_step(self, trainer: Any, step: int, metrics: Any) -> None:
        if step != SAVE_STEPS + 1:
            return
        trainer.wait_for_checkpoints()
        open(self.ready, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.go) and time.monotonic() < deadline:
            time.sleep(0.01)  # the test fills the disk meanwhile; no assertion depends on this interval


def main() -> int:
    from scaletrain.logs import setup_logging

    out, report = sys.argv[1], tuple(r for r in sys.argv[2].split(",") if r != "none")
    setup_logging()
    logging.getLogger().setLevel(logging.WARNING)  # the plan and step lines: not what this test reads
    mode, callbacks = sys.argv[3], []
    if mode == "refuse":
        refuse_writes_of_save(int(sys.argv[4]), sys.argv[5])
    else:
        callbacks.append(PauseAfterFirstSave(sys.argv[4], sys.argv[5]))
    return status_as_the_cli(lambda: build_trainer(out, report, callbacks).train())


if __name__ == "__main__":
    sys.exit(main())
