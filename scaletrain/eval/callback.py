"""In-loop evaluation: lm-eval tasks and extra eval data sets every N steps, logged beside the loss.

Why a callback: what it needs of the run (the current state, the tokenizer, the step, the metrics
writers) is on :class:`~scaletrain.training.protocol.TrainerView`, so the loop does not change.
The expensive parts are done once: the task index and each data set's rows at ``pre_train``,
the scorer and eval step compiled at the first evaluation and reused on every later state.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.eval.config import EvalHarnessSection
from scaletrain.training.callbacks import Callback, StepOutput
from scaletrain.training.protocol import TrainerView

logger = logging.getLogger("scaletrain")


class HarnessEvaluation(Callback):
    """Scores ``section``'s tasks and data sets every ``every_steps`` steps (and after the last with ``at_end``).

    One record per evaluation: ``{"step", "split": "harness", "<task>/<metric>", "<data set>/loss",
    "<data set>/accuracy", "<data set>/perplexity", "<data set>/bits_per_byte", "seconds"}``.
    """

    def __init__(self, section: EvalHarnessSection):
        self.section = section
        self._manager: Any = None
        self._rows: dict[str, tuple[Any, float | None]] = {}
        self._evaluator: Any = None
        self._last_step: int | None = None
        self.history: list[dict[str, Any]] = []

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        """Check tasks and build the data sets' rows before the first step (a typo fails now, not at step N)."""
        from scaletrain.eval.data_eval import eval_rows, source_section
        from scaletrain.eval.harness import task_list, task_manager

        s = self.section
        if (s.tasks or s.data) and trainer.tokenizer is None:
            raise ConfigError("eval_harness: tasks and data sets are text; the trainer has no tokenizer")
        if s.tasks:
            import jax

            if jax.process_count() > 1:
                raise ConfigError("eval_harness.tasks: lm-eval tasks run in one process, and this run has "
                                  f"{jax.process_count()}; keep eval_harness.data here and run `scaletrain eval "
                                  "RUN --tasks ...` on its checkpoints")
            self._manager = task_manager(task_list(s.tasks), s.include_path)
            self._manager.preload(task_list(s.tasks))  # their data read now: a missing file fails before step 1
        settings = self._settings(trainer)
        for item in s.data:
            section = source_section(item.source, kind=item.kind, split=item.split, text_column=item.text_column,
                                     messages_column=item.messages_column, format=item.format)
            self._rows[item.name] = eval_rows(section, trainer.tokenizer, settings)

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        every = self.section.every_steps
        if every and step % every == 0:
            self.evaluate(trainer, step)

    def post_train(self, trainer: TrainerView, state: Any) -> None:
        finished = trainer.failed is None and trainer.global_step >= trainer.max_training_steps
        if self.section.at_end and finished and self._last_step != trainer.global_step:
            self.evaluate(trainer, trainer.global_step)

    def evaluate(self, trainer: TrainerView, step: int) -> dict[str, Any]:
        """Score the current state now; the record is written to the run's metrics and returned."""
        from scaletrain.eval.data_eval import RowsEvaluator

        start = time.perf_counter()
        model = trainer.current_state.model
        record: dict[str, Any] = {"step": step, "split": "harness"}
        if self._rows:
            self._evaluator = self._evaluator or RowsEvaluator(model, self._settings(trainer))
            for name, (rows, bytes_per_token) in self._rows.items():
                figures = self._evaluator(model, rows, bytes_per_token)
                record.update({f"{name}/{k.removeprefix('eval_')}": v for k, v in figures.items()
                               if k != "eval_seconds"})
        if self.section.tasks:
            record.update(self._tasks(model, trainer))
        record["seconds"] = time.perf_counter() - start
        self._last_step = step
        trainer.write_metrics(record)
        self.history.append(record)
        if trainer.is_main_process:
            logger.info("eval_harness at step %d (%.1fs): %s", step, record["seconds"],
                        " ".join(f"{k} {v:.4g}" for k, v in record.items() if k not in ("step", "split", "seconds")))
        return record

    def _tasks(self, model: Any, trainer: TrainerView) -> dict[str, float]:
        from scaletrain.eval.harness import flat_metrics, run_tasks
        from scaletrain.eval.lm_eval_model import ScaletrainLM

        s = self.section
        lm = ScaletrainLM(model=model, tokenizer=trainer.tokenizer, batch_size=s.batch_size,
                          max_length=trainer.arguments.max_length)
        results = run_tasks(lm, s.tasks, include_path=s.include_path, num_fewshot=s.num_fewshot,
                            limit=int(s.limit) if s.limit and s.limit >= 1 else s.limit, manager=self._manager)
        return {k: v for k, v in flat_metrics(results, prefix="").items() if not k.endswith("/sample_len")}

    @staticmethod
    def _settings(trainer: TrainerView) -> Any:
        from scaletrain.eval.data_eval import EvalSettings

        a = trainer.arguments
        return EvalSettings(batch_size=a.total_batch_size, max_length=a.max_length, seed=a.seed,
                            truncation_mode=a.truncation_mode, loss_chunk_size=a.loss_chunk_size)
