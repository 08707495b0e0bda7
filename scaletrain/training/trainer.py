"""``Trainer``: the loop that drives the pure step functions, and evaluation.

The loop fetches a batch, calls the jitted step and dispatches callbacks. It never
blocks on the device except where a callback reads metrics (log steps), so the
host prepares batch ``n+1`` while the device computes step ``n``. What to build
(``BaseTrainer``) and what a run writes (``outputs``, ``loggers``) live elsewhere.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaletrain.errors import DataError
from scaletrain.training.base import BaseTrainer
from scaletrain.training.callbacks import StepOutput
from scaletrain.training.outputs import format_plan, summary_record, write_summary
from scaletrain.training.protocol import TrainerOutput
from scaletrain.training.state import TrainState, params_sha256
from scaletrain.training.stopping import StepInterrupted

__all__ = ["BaseTrainer", "Trainer"]

logger = logging.getLogger("scaletrain")


class Trainer(BaseTrainer):
    """Causal-LM trainer: ``train()``, ``evaluate()``, ``eval()`` and ``save_pretrained()``."""

    def train(self, model_parameters: Any = None, state: TrainState | None = None) -> TrainerOutput:
        """Resume if the policy says so, step until a stop rule fires, save, evaluate, summarise.

        ``model_parameters`` / ``state`` (EasyDeL's BaseTrainerProtocol's protocol) replace the starting
        parameters / state built at init (:meth:`starting_state`). ``output_dir``'s lock
        is held throughout (taken again if an earlier ``train()`` let go of it) and
        released however the run ends.
        """
        self.hold_run_lock()
        try:
            return self._train(self.starting_state(state, model_parameters))
        finally:
            self.release_run_lock()

    def _train(self, start: TrainState) -> TrainerOutput:
        args = self.arguments
        state = self.maybe_resume(start)
        self.global_step = self.start_step = int(jax.device_get(state.step))
        self.current_state = state
        self.start_time = time.perf_counter()
        self.print_plan()
        self.fire("pre_train", state)
        try:
            state = self._loop(state)
        except BaseException:
            self._teardown(state, failing=True)
            raise
        self._model_state = self.current_state = state
        if self.failed is not None:
            self._teardown(state, failing=True)
            raise self.failed
        if args.save_at_end:
            self.save_checkpoint(state)
        reached_horizon = self.global_step >= self.max_training_steps
        if reached_horizon and args.do_eval and self._dataset_eval is not None:
            if self.last_eval is None or self.last_eval[0] != self.global_step:
                results = self.evaluate(state)
                self.checkpoint_manager.record_eval(self.global_step, results["eval_loss"])
        self._teardown(state)
        self.write_summary(state)
        logger.info("stopped: %s", self.stop_reason)
        return TrainerOutput(
            state=state,
            mesh=self._mesh,
            checkpoint_path=self.last_checkpoint,
            last_save_file_name=None if self.last_checkpoint is None else os.path.basename(self.last_checkpoint),
        )

    def _fetch_batch(self) -> tuple[Any, Any] | None:
        """The next batch, placed where the step reads it (:meth:`place_batch`), and the iterator state after it."""
        try:
            batch = next(self.dataloader_train)
        except StopIteration:
            return None
        return self.place_batch(batch), self.dataloader_train.get_state()

    def place_batch(self, batch: Any) -> Any:
        """A loader batch put where :meth:`run_training_step` reads it, ahead of the step: on the devices
        (:meth:`shard_batch`). A trainer whose step must first compute from it on the host with the current
        state (GRPO samples its prompts' completions) returns it as it is."""
        return self.shard_batch(batch)

    def run_training_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step of the loop: the jitted ``sharded_training_step_function`` on the placed batch.

        A trainer whose step has host work between device programs (GRPO: rewards are Python
        callables over the sampled text) overrides this and keeps ``sharded_training_step_function``
        the jitted device program it calls; raising :class:`StepInterrupted` gives the step up
        before its update.
        """
        return self.sharded_training_step_function(state, batch)

    def _loop(self, state: TrainState) -> TrainState:
        """Step until a callback asks to stop; batch ``n+1`` is fetched and placed while step ``n`` runs.

        The step is dispatched asynchronously, so reading and placing the next batch
        right after the dispatch overlaps it with the device's work, and a callback
        that syncs on step ``n`` (a log step) finds step ``n+1``'s input already there.
        The horizon is a stop rule like the others (``TrainingHorizon``).
        """
        epoch = None
        self._consumed_data_state = self.dataloader_train.get_state()  # no step yet: where the iterator stands
        self._last_step_output: tuple[int, StepOutput] | None = None
        with jax.set_mesh(self._mesh):
            ahead = self._fetch_batch() if self.stop_reason is None else None
            while self.stop_reason is None:
                self.checkpoint_manager.raise_if_failed()  # a failed background save ends the run now
                self.epoch = self.global_step // self.steps_per_epoch
                if self.epoch != epoch:
                    if epoch is not None:
                        self.fire("post_epoch", epoch)
                    epoch = self.epoch
                    self.fire("pre_epoch", epoch)
                if ahead is None:
                    self.request_stop(f"the training data ran out after step {self.global_step}")
                    break
                batch, data_state = ahead
                step = self.global_step + 1
                self.fire("pre_step", step)
                state = self.on_step_start(state, step)
                try:
                    state, metrics = self.run_training_step(state, batch)
                except StepInterrupted as stop:  # the state is still the last step's: checkpointed as is
                    self.request_stop(f"{stop} at step {step}, before its update (a resumed run takes it again)")
                    break
                self._consumed_data_state = data_state
                ahead = self._fetch_batch() if step < self.max_training_steps else None
                state, metrics = self.on_step_end(state, metrics, step)
                if figures := self.data_metrics(step):  # "data/<source>/tokens", ...: logged beside the loss
                    metrics = {**metrics, **figures}
                self.global_step = step
                self.current_state = state
                self._last_step_output = (step, StepOutput(metrics))  # kept on device for the summary
                self.fire("post_step", step, self._last_step_output[1])
            if epoch is not None:
                self.fire("post_epoch", epoch)
        return state

    def data_metrics(self, step: int) -> dict[str, float]:
        """Host figures of the data step ``step`` trained on (a mixture's tokens per source); ``{}`` for plain data.

        Computed from the batch index alone (the iterator's schedule), so a resumed run logs the
        same figures as an uninterrupted one.
        """
        figures = getattr(self.dataloader_train, "data_metrics", None)
        return figures(step) if figures is not None else {}

    def _teardown(self, state: TrainState, failing: bool = False) -> None:
        """Finish pending checkpoint writes and close loggers, whatever ended the run.

        A failed save (the final wait) is raised over an error that was already ending the
        run: on a full disk it says more (which checkpoints are complete) than a refused
        metrics line. The loggers are closed last, always; once the run is failing, an error
        closing them (most often the same full disk) never hides the one that ended it.
        """
        try:
            try:
                self.fire("post_train", state)
            finally:
                self.checkpoint_manager.wait()
        except BaseException:
            self._close_after_failure()
            raise
        if failing:
            self._close_after_failure()
        else:
            self.close()

    def _close_after_failure(self) -> None:
        try:
            self.close()
        except Exception as err:  # the error that ends the run is already on its way to the user
            logger.debug("closing the loggers of a failed run: %s", err)

    # ---- evaluation -----------------------------------------------------------------
    def _eval_batches(self, rows: Any = None) -> Iterator[dict[str, jax.Array]]:
        rows = self._eval_source if rows is None else rows
        it = self.make_iterator(rows, shuffle=False, num_epochs=1, drop_remainder=False)
        for i, batch in enumerate(it):
            if self.max_evaluation_steps is not None and i >= self.max_evaluation_steps:
                break
            yield self.shard_batch(batch)

    def _eval_parts(self) -> list[tuple[str | None, Any, float | None]]:
        """``(name, rows, bytes per token)`` to evaluate: the eval set, or each named part of a mixture's
        (``max_evaluation_steps`` then bounds each part)."""
        named = getattr(self._eval_source, "named_parts", None)
        return named() if named is not None else [(None, self._eval_source, self.eval_bytes_per_token)]

    def eval(self, model_state: TrainState | None = None) -> Iterator[dict[str, float]]:
        """Yield running evaluation metrics after every eval batch (EasyDeL's ``Trainer.eval``).

        The objective's sums are added on the host in float64 and reduced by the objective
        (:meth:`~scaletrain.objectives.Objective.eval_metrics`)."""
        state = model_state if model_state is not None else self.current_state
        total: Any = None
        i = 0
        with jax.set_mesh(self._mesh):
            for _, rows, _ in self._eval_parts():
                for batch in self._eval_batches(rows):
                    i += 1
                    sums = jax.tree.map(lambda x: np.asarray(x, np.float64),
                                        jax.device_get(self.sharded_evaluation_step_function(state, batch)))
                    total = sums if total is None else jax.tree.map(np.add, total, sums)
                    yield {"eval_step": i, **self.objective.eval_metrics(total, self.eval_bytes_per_token)}

    def evaluate(self, state: TrainState | None = None, metric_calculator: Callable | None = None) -> dict[str, float]:
        """Full evaluation, reduced by the objective: for the language-model loss ``eval_loss``,
        ``eval_accuracy``, ``eval_perplexity``, ``eval_tokens`` (and ``eval_bits_per_byte``).

        A mixture's eval set is evaluated source by source: the same figures per source as
        ``eval_<name>_loss``, ``eval_<name>_accuracy``, ..., and their sums give the overall ones."""
        if self._dataset_eval is None:
            raise DataError("evaluate() needs dataset_eval")
        state = state if state is not None else self.current_state
        self.fire("pre_evaluate", self.global_step)
        acc: Any = None
        named: dict[str, tuple[Any, float | None]] = {}
        with jax.set_mesh(self._mesh):
            for name, rows, bytes_per_token in self._eval_parts():
                part: Any = None
                for batch in self._eval_batches(rows):
                    sums = self.sharded_evaluation_step_function(state, batch)
                    part = sums if part is None else jax.tree.map(jnp.add, part, sums)
                if part is None:
                    continue
                if name is not None:
                    named[name] = (part, bytes_per_token)
                acc = part if acc is None else jax.tree.map(jnp.add, acc, part)
        results = self.objective.eval_metrics(jax.device_get(acc), self.eval_bytes_per_token)
        for name, (sums, bytes_per_token) in named.items():
            figures = self.objective.eval_metrics(jax.device_get(sums), bytes_per_token)
            results.update({f"eval_{name}_{k.removeprefix('eval_')}": v for k, v in figures.items()})
        if metric_calculator is not None:
            results.update(metric_calculator(state, results))
        self.last_eval = (self.global_step, results)
        self.fire("post_evaluate", self.global_step, results)
        return results

    # ---- outputs ---------------------------------------------------------------------
    def save_pretrained(self, ckpt_path: str, state: TrainState | None = None) -> str:
        """Save ``state`` (default: the current one) so it can be used and trained on (EasyDeL's protocol); returns ``ckpt_path``.

        ``ckpt_path`` becomes a Hugging Face folder (config.json, safetensors, the
        tokenizer) that transformers loads, and ``ckpt_path/checkpoints/<step>`` holds
        the full train state in our checkpoint format: parameters, optimizer state,
        step and RNG, with the arguments, model config and (for the current state) the
        data position, so ``resume_from=ckpt_path`` continues it and ``scaletrain
        export`` / ``bucket_path`` read it. A previous save_pretrained at the same path
        is replaced; any other non-empty folder is refused.
        """
        from scaletrain.models.hf import save_hf_checkpoint
        from scaletrain.training.checkpoint import CHECKPOINT_DIR, Checkpointer

        current = state is None or state is self.current_state
        state = self.current_state if state is None else state
        path = save_hf_checkpoint(state.model, ckpt_path, tokenizer=self.tokenizer)
        saver = Checkpointer(os.path.join(path, CHECKPOINT_DIR), async_save=False)
        try:
            data = {"train": self.consumed_data_state()} if current else {}
            saver.save(int(jax.device_get(state.step)), state, data, self.checkpoint_metadata(state))
        finally:
            saver.close()
        return path

    def print_plan(self) -> None:
        """Log the resolved run plan: nothing that shapes the schedule stays hidden."""
        if self.is_main_process:
            _announce(format_plan(
                self.arguments, model_config=self._model.config, parameter_counts=self.parameter_counts,
                param_dtype=self.param_dtype, dtype=self.dtype, mesh=self._mesh, start_step=self.start_step,
                max_training_steps=self.max_training_steps, steps_per_epoch=self.steps_per_epoch,
                num_epochs=self.num_epochs, batch_lines=self.plan_batch_lines(),
            ))
            cfg = self._model.config
            if getattr(cfg, "scan_layers", False) and cfg.gradient_checkpointing == "none":
                logger.warning("model.scan_layers with gradient_checkpointing=none keeps every intermediate of every "
                               "layer for the backward (Llama-3.2-1B: twice the unrolled step's temporaries); 'dots' "
                               "or 'dots_and_attention' keep the matmuls and recompute only elementwise work")

    @property
    def logged_metrics(self) -> tuple[str, ...]:
        """The objective's own figures (named without a ``/``) the train log keeps: for callbacks (``TrainerView``)."""
        return tuple(self.objective.logged_metrics)

    @property
    def sequences_per_row(self) -> int:
        """Sequences one batch row forwards (a preference pair: 2): what tokens/s counts (``TrainerView``)."""
        return int(self.objective.sequences_per_row)

    @property
    def reference_record(self) -> dict[str, Any] | None:
        """The reference this run reads, as checkpoints record it (``{"reference", "reference_sha256"}``; None
        without one, or with LoRA adapters off: nothing to digest)."""
        return self.frozen_models.records.get("reference")

    def plan_batch_lines(self) -> list[str] | None:
        """The plan's lines about the batch where a trainer's batch is not ``total_batch_size x max_length``
        (GRPO's rollouts and updates); None: the usual ``batch`` line."""
        return None

    def _final_loss(self) -> tuple[int, float] | None:
        """``(step, loss)`` of the last step this invocation trained, or None if it trained none.

        A stop between log steps (a signal, the kill switch) ends after a step that was
        never logged; its metrics are still on the device, so one small fetch gives the
        summary the loss of the step it reports as ``final_step``.
        """
        last = getattr(self, "_last_step_output", None)
        return None if last is None else (last[0], last[1].host()["loss"])

    def write_summary(self, state: TrainState) -> dict[str, Any]:
        """``summary.json``: final losses, steady throughput, MFU, the parameter digest, the objective's name and the
        frozen models it read (``training/frozen.py``)."""
        trainable, total = self.parameter_counts
        summary = summary_record(
            self.arguments,
            final_step=self.global_step,
            stop_reason=self.stop_reason,
            last_train=self.metrics_logger.last_train,
            final_loss=self._final_loss(),
            last_eval=self.metrics_logger.last_eval,
            steady=self.metrics_logger.steady_throughput(),
            max_training_steps=self.max_training_steps,
            flops_per_token=self._flops_per_token,
            num_params=total,
            num_trainable_params=trainable,
            params_sha256=params_sha256(state.params),  # all processes: the gather is a collective
            elapsed_s=time.perf_counter() - self.start_time,
            checkpoint=self.last_checkpoint,
            resumed_from=self.resumed_from,
            skipped_nonfinite_steps=self.nan_guard.skipped_count(),
            objective=self.objective.name,
            **self.frozen_models.records,  # each frozen model read (name, digest): recorded here, once
        )
        if self.is_main_process:
            write_summary(self.arguments.ensure_output_dir(), summary)
        self.summary = summary
        return summary


def _announce(text: str) -> None:
    """Log ``text`` at INFO; where logging is not set up at all (a notebook, a script), print it.

    Why: the CLI configures logging, a notebook or script usually does not, and the plan
    (which budget ends the run) must reach both users alike. Logging that is set up decides
    (a level above INFO hides the plan, as it hides every INFO line).
    """
    if logger.hasHandlers():
        logger.info(text)
    else:
        print(text, file=sys.stderr, flush=True)
