"""Callbacks: the side effects around the training loop.

Events come in ``pre_``/``post_`` pairs for init, train, epoch, step, evaluate and
checkpoint (ArcticTraining's events). Logging, progress, evaluation scheduling and
stopping rules are callbacks themselves, so the loop in ``Trainer.train`` only
steps and dispatches. A callback sees the trainer as a
:class:`~scaletrain.training.protocol.TrainerView`: what it may read and do is
listed there. It asks the loop to stop by calling ``trainer.request_stop(reason)``;
an exception raised in a callback propagates with its traceback (it never ends a
run silently).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any

from scaletrain.training.protocol import TrainerView

logger = logging.getLogger("scaletrain")

EVENTS = ("init", "train", "epoch", "step", "evaluate", "checkpoint")


#: figures shown in the progress line beside the loss, when the step logs them: a preference objective's, and
#: GRPO's mean reward (its loss, a policy-gradient surrogate, says little about progress; the reward does)
PROGRESS_FIGURES = ("reward", "rewards/accuracies", "rewards/margins")

class Callback:
    """Base class: override any ``pre_<event>`` / ``post_<event>`` method.

    Signatures: ``pre_init(trainer)``, ``post_init(trainer)``,
    ``pre_train(trainer, state)``, ``post_train(trainer, state)``,
    ``pre_epoch(trainer, epoch)``, ``post_epoch(trainer, epoch)``,
    ``pre_step(trainer, step)``, ``post_step(trainer, step, metrics)``,
    ``pre_evaluate(trainer, step)``, ``post_evaluate(trainer, step, results)``,
    ``pre_checkpoint(trainer, step)``, ``post_checkpoint(trainer, step, path)``.
    ``metrics`` in ``post_step`` is a :class:`StepOutput` whose values are fetched
    from the device only when read.
    """

    def pre_init(self, trainer: TrainerView) -> None: ...
    def post_init(self, trainer: TrainerView) -> None: ...
    def pre_train(self, trainer: TrainerView, state: Any) -> None: ...
    def post_train(self, trainer: TrainerView, state: Any) -> None: ...
    def pre_epoch(self, trainer: TrainerView, epoch: int) -> None: ...
    def post_epoch(self, trainer: TrainerView, epoch: int) -> None: ...
    def pre_step(self, trainer: TrainerView, step: int) -> None: ...
    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None: ...
    def pre_evaluate(self, trainer: TrainerView, step: int) -> None: ...
    def post_evaluate(self, trainer: TrainerView, step: int, results: dict[str, float]) -> None: ...
    def pre_checkpoint(self, trainer: TrainerView, step: int) -> None: ...
    def post_checkpoint(self, trainer: TrainerView, step: int, path: str) -> None: ...


class StepOutput:
    """Device metrics of one step; ``.host()`` fetches them (a sync) once."""

    def __init__(self, device_metrics: dict[str, Any]):
        self._device = device_metrics
        self._host: dict[str, float] | None = None

    def device(self, key: str) -> Any:
        """One metric, still on device (no sync)."""
        return self._device[key]

    def host(self) -> dict[str, float]:
        if self._host is None:
            import jax

            self._host = {k: float(v) for k, v in jax.device_get(self._device).items()}
        return self._host


class MetricsLogger(Callback):
    """Every ``log_steps`` steps: fetch metrics, add throughput and MFU, write them out.

    Lines go to ``<output_dir>/metrics.jsonl`` (one JSON object per line) and to
    the trainer's loggers (TensorBoard, ...). Throughput is measured between log
    steps, after the fetch, so it covers exactly the steps in between.
    """

    def __init__(self) -> None:
        self._last_time: float | None = None
        self._last_step = 0
        self.throughputs: list[dict[str, float]] = []
        self.last_train: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._last_time = time.perf_counter()
        self._last_step = trainer.global_step

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        if step % trainer.arguments.log_steps and step != trainer.max_training_steps:
            return
        values = metrics.host()  # waits for this step: the only sync in the loop
        now = time.perf_counter()
        steps = step - self._last_step
        # a preference row holds two sequences (chosen and rejected, or KTO's row and its KL row): both are forwarded
        tokens = steps * trainer.arguments.total_batch_size * trainer.arguments.max_length * trainer.sequences_per_row
        perf = trainer.throughput(tokens, now - (self._last_time or now))
        first_interval = self._last_step == trainer.start_step
        self._last_time, self._last_step = now, step
        if not first_interval:  # the first interval includes compilation
            self.throughputs.append(perf)
        # every objective reports loss (and the step grad_norm); a token-level one accuracy and target tokens;
        # any objective's own figures are namespaced ("moe/...", "grad_norm/...", "rewards/...")
        record: dict[str, Any] = {"step": step, "split": "train", "epoch": trainer.epoch, "loss": values["loss"]}
        if "accuracy" in values:
            record.update(accuracy=values["accuracy"], perplexity=math.exp(min(values["loss"], 50.0)))
        record.update(learning_rate=trainer.learning_rate_at(step - 1), grad_norm=values["grad_norm"])
        if "tokens" in values:
            record["target_tokens"] = values["tokens"]
        record.update(**perf, elapsed_s=time.perf_counter() - trainer.start_time)
        if trainer.arguments.z_loss and "z_loss" in values:
            record["z_loss"] = values["z_loss"]
        record.update({k: v for k, v in values.items() if "/" in k})
        # an objective's own figures named without a "/" (TRL's nll_loss, entropy, kl, ...)
        record.update({k: values[k] for k in trainer.logged_metrics if k in values})
        record.update(memory_stats())
        self.last_train = record
        trainer.write_metrics(record)
        if not trainer.arguments.progress_bar and trainer.is_main_process:
            logger.info("step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f mfu %.3f%s", step,
                        trainer.max_training_steps, record["loss"], record["learning_rate"], record["grad_norm"],
                        record["tokens_per_s"], record["mfu"],
                        "".join(f" {k} {record[k]:.3f}" for k in PROGRESS_FIGURES if k in record))

    def post_evaluate(self, trainer: TrainerView, step: int, results: dict[str, float]) -> None:
        self.last_eval = {"step": step, "split": "eval", **results}
        trainer.write_metrics(self.last_eval)
        if trainer.is_main_process:
            logger.info("eval at step %d: %s", step, " ".join(f"{k} {v:.4g}" for k, v in results.items()))

    def steady_throughput(self) -> dict[str, float]:
        """Medians over log intervals after the first (which pays for compilation)."""
        if not self.throughputs:
            return {}
        return {k: statistics.median(p[k] for p in self.throughputs) for k in self.throughputs[0]}


def memory_stats() -> dict[str, float]:
    """Device memory where the backend reports it, and the host's peak RSS."""
    import resource

    import jax

    out = {"host_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    stats = jax.local_devices()[0].memory_stats() or {}
    for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        if key in stats:
            out[f"device_{key}"] = float(stats[key])
    return out


class PreviewGeneration(Callback):
    """Every ``generate_steps`` steps, continue ``generate_prompts`` and log the text."""

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        a = trainer.arguments
        if not a.generate_steps or step % a.generate_steps or trainer.tokenizer is None:
            return
        from scaletrain.generation import generate, stop_token_ids, until_stop

        tok = trainer.tokenizer
        model = trainer.current_state.model
        stop = stop_token_ids(tok, model.config.eos_token_id)  # a reply ends at eos or the end of its turn
        for prompt in a.generate_prompts:
            ids = tok(prompt)["input_ids"] or [tok.eos_token_id]
            new = generate(model, [ids], max_new_tokens=a.generate_max_new_tokens, temperature=0.8, top_k=40,
                           seed=step, eos_token_id=stop)
            text = prompt + tok.decode(until_stop(new[0], stop), skip_special_tokens=True)
            trainer.write_metrics({"step": step, "split": "sample", "prompt": prompt, "text": text})


class ProgressBar(Callback):
    """tqdm bar with loss, learning rate, tokens/s and ETA (on process 0 only)."""

    def __init__(self) -> None:
        self.bar: Any = None
        # the last value of each progress figure: GRPO logs its reward only on the steps that sample
        # (every num_iterations steps), and the bar keeps showing it on the steps between
        self.figures: dict[str, str] = {}

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        if not trainer.arguments.progress_bar or not trainer.is_main_process:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=trainer.max_training_steps, initial=trainer.global_step, desc="train",
                        dynamic_ncols=True, leave=True)

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        logged = trainer.last_train_metrics
        if logged.get("step") == step:
            self.figures.update({k.split("/")[-1]: f"{logged[k]:.3f}" for k in PROGRESS_FIGURES if k in logged})
            self.bar.set_postfix(
                loss=f"{logged['loss']:.3f}", lr=f"{logged['learning_rate']:.2e}",
                tok_s=f"{logged['tokens_per_s']:.0f}", refresh=False, **self.figures,
            )

    def post_train(self, trainer: TrainerView, state: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PeriodicEvaluation(Callback):
    """Evaluate every ``evaluation_steps`` steps (when ``do_eval`` and an eval set exist)."""

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        every = trainer.arguments.evaluation_steps
        if trainer.arguments.do_eval and trainer.dataset_eval is not None and every and step % every == 0:
            if step != trainer.max_training_steps:  # the final evaluation runs after the loop
                trainer.evaluate(trainer.current_state)


class TrainingHorizon(Callback):
    """Stop at ``max_training_steps`` (the resolved horizon of steps and epochs).

    The only place the horizon stops a run: the loop runs until a stop is requested.
    A run resumed at or past its horizon stops before its first step.
    """

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._check(trainer, trainer.global_step)

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        self._check(trainer, step)

    @staticmethod
    def _check(trainer: TrainerView, step: int) -> None:
        if step >= trainer.max_training_steps:
            trainer.request_stop(f"reached the training horizon of {trainer.max_training_steps} steps")


class CheckpointSaver(Callback):
    """Save every ``save_steps`` steps and/or every ``save_interval_minutes``."""

    def pre_train(self, trainer: TrainerView, state: Any) -> None:
        self._last = time.monotonic()

    def post_step(self, trainer: TrainerView, step: int, metrics: StepOutput) -> None:
        a = trainer.arguments
        due = bool(a.save_steps) and step % a.save_steps == 0
        if a.save_interval_minutes and time.monotonic() - self._last >= 60 * a.save_interval_minutes:
            due = True
        if due and trainer.stop_reason is None and not trainer.failed:
            trainer.save_checkpoint(trainer.current_state)
            self._last = time.monotonic()

