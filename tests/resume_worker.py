"""A deterministic tiny training run, used as a subprocess by the resume tests.

Usage: python resume_worker.py OUTPUT_DIR GRAD_ACCUM ROWS MAX_STEPS [KILL_AT_STEP]
With KILL_AT_STEP the process sends itself SIGKILL right after that step, wherever
its asynchronous checkpoint writes are.
"""

import os
import signal
import sys
from collections.abc import Callable

import numpy as np

import scaletrain as st
from scaletrain.models import LlamaConfig, LlamaForCausalLM, create_sharded_model


class KillAt(st.Callback):
    def __init__(self, step: int):
        self.step = step

    def post_step(self, trainer, step, metrics):
        if step == self.step:
            metrics.host()  # make sure the step itself ran
            trainer.wait_for_checkpoints()  # "after a checkpoint": the last save is complete
            os.kill(os.getpid(), signal.SIGKILL)


def build_trainer(out: str, accum: int, rows: int, max_steps: int, callbacks=()) -> st.Trainer:
    """The run's trainer (also built by tests/test_chaos.py as the template to load checkpoints into)."""
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 128, rng.integers(6, 20))} for _ in range(rows)]
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, sharding_axis_dims=(1, 2, 1, 4, 1))
    model, _ = create_sharded_model(LlamaForCausalLM, cfg, seed=0)
    args = st.TrainingArguments(
        output_dir=out, total_batch_size=8, gradient_accumulation_steps=accum, max_length=16,
        num_train_epochs=None, max_training_steps=max_steps, learning_rate=1e-2, warmup_steps=2,
        log_steps=1, save_steps=2, resume_if_possible=True, progress_bar=False, do_eval=False,
        report_to=(),
    )
    return st.Trainer(args, model=model, dataset_train=data, callbacks=list(callbacks))


def run_recipe_worker(recipe) -> None:
    """The main of a recipe-run worker (``WORKDIR RUN [KILL_AT_STEP|-] [REFERENCE_FOLDER]``): runs
    ``recipe(workdir, WORKDIR/RUN, reference)`` through ``run_training``, killed after KILL_AT_STEP if given."""
    from scaletrain.run import run_training

    workdir, out = sys.argv[1], os.path.join(sys.argv[1], sys.argv[2])
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    reference = sys.argv[4] if len(sys.argv) > 4 else None
    run_training(recipe(workdir, out, reference), callbacks=[KillAt(kill_at)] if kill_at else [])


def status_as_the_cli(work: Callable[[], object]) -> int:
    """Run ``work()`` and end as ``scaletrain train`` ends: 0, or a user error's one line and its status
    (``report_user_error``); any other exception propagates with its traceback."""
    from scaletrain.cli import report_user_error

    try:
        work()
    except Exception as err:
        status = report_user_error(err)
        if status is None:
            raise
        return status
    return 0


def main() -> None:
    out, accum, rows, max_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    build_trainer(out, accum, rows, max_steps, [KillAt(kill_at)] if kill_at else []).train()


if __name__ == "__main__":
    main()
