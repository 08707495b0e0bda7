"""What a run tells its user: the plan printed at start and ``summary.json`` at the end.

The trainer gathers the facts; this module turns them into the printed plan and
the summary record, and owns the summary's file name, its atomic write and its
read-back (used by the launcher, the sweep and the CLI). Metric records go through
:mod:`scaletrain.training.loggers`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from scaletrain.folders import write_json_atomic
from scaletrain.training.optim import resolved_learning_rate_end

SUMMARY_FILE = "summary.json"

# How this process was started, for the plan: set by a launch backend before training (process-wide,
# as the process's place in its job is); None when nothing said (a library user's own process).
_launch_description: list[str | None] = [None]


def set_launch_description(text: str | None) -> None:
    """Name the backend, process count and coordinator in the plan of the runs this process starts."""
    _launch_description[0] = text


def write_summary(output_dir: str, summary: dict[str, Any]) -> str:
    """``summary.json`` under ``output_dir`` (atomically); returns its path."""
    path = os.path.join(output_dir, SUMMARY_FILE)
    write_json_atomic(path, summary)
    return path


def read_summary(output_dir: str) -> dict[str, Any] | None:
    """The run's ``summary.json``, or None when it is missing or unreadable (a run still going)."""
    try:
        with open(os.path.join(output_dir, SUMMARY_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def format_plan(arguments: Any, *, model_config: Any, parameter_counts: tuple[int, int], param_dtype: Any,
                dtype: Any, mesh: Any,
                start_step: int, max_training_steps: int, steps_per_epoch: int, num_epochs: int | None,
                batch_lines: list[str] | None = None) -> str:
    """The resolved run plan: nothing that shapes the schedule stays hidden (printed at start). ``batch_lines``
    replace the ``batch`` line for a trainer whose batch is not ``total_batch_size`` rows of ``max_length``."""
    a, cfg = arguments, model_config
    tokens = max_training_steps * a.total_batch_size * a.max_length
    lines = [
        f"output_dir      {os.path.abspath(a.output_dir)}",
        f"model           {cfg.model_type}: {format_parameter_counts(*parameter_counts)}, "
        f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        f"precision       params {jnp.dtype(param_dtype).name}, compute {jnp.dtype(dtype).name}, "
        f"softmax/loss float32",
        *([f"launch          {_launch_description[0]}"] if _launch_description[0] else []),
        f"mesh            {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), {jax.process_count()} process(es)",
        f"steps           {start_step} -> {max_training_steps} ({horizon_reason(a, steps_per_epoch, num_epochs)})",
        *(batch_lines if batch_lines is not None else [
            f"batch           {a.total_batch_size} x {a.max_length} tokens "
            f"({a.gradient_accumulation_steps} micro-batches), {tokens / 1e6:.2f}M tokens in all"]),
        f"schedule        {a.optimizer}, {a.scheduler} lr {a.learning_rate:g} -> "
        f"{resolved_learning_rate_end(a):g}, warmup {a.warmup_steps}, clip {a.clip_grad}, "
        f"weight decay {a.weight_decay}",
    ]
    return "run plan\n  " + "\n  ".join(lines)


def format_parameter_counts(trainable: int, total: int) -> str:
    """``9.78M parameters``, or with a frozen base ``9,216 trainable of 9.78M parameters (0.09%)``."""
    if trainable == total:
        return f"{total / 1e6:.2f}M parameters"
    return f"{trainable:,} trainable of {total / 1e6:.2f}M parameters ({100 * trainable / total:.2g}%)"


def horizon_reason(arguments: Any, steps_per_epoch: int, num_epochs: int | None) -> str:
    """Which budget set the last step: the step budget, the epochs, or the smaller of both (said, never silent)."""
    steps, per_epoch = arguments.max_training_steps, f"{steps_per_epoch} steps per epoch"
    if num_epochs is None:
        return f"max_training_steps={steps}; {per_epoch}, epochs not limited"
    if steps is None:
        return f"num_train_epochs={num_epochs} x {per_epoch}"
    return (f"the smaller of max_training_steps={steps} and num_train_epochs={num_epochs} x {per_epoch} = "
            f"{num_epochs * steps_per_epoch}; set num_train_epochs: null for the step budget alone")


def summary_record(arguments: Any, *, final_step: int, stop_reason: str | None, last_train: dict[str, Any],
                   last_eval: dict[str, Any], steady: dict[str, float], final_loss: tuple[int, float] | None = None,
                   **facts: Any) -> dict[str, Any]:
    """``summary.json``'s content: final losses, steady throughput (else the last logged) and ``facts``.

    ``final_loss`` is ``(step, loss)`` of the last step trained; without it the last
    logged loss stands in. ``final_train_loss_step`` says which step the loss is from.
    """
    loss_step, loss = final_loss if final_loss is not None else (last_train.get("step"), last_train.get("loss"))
    return {
        "final_step": final_step,
        "stop_reason": stop_reason,
        "final_train_loss": loss,
        "final_train_loss_step": loss_step,
        "final_eval_loss": last_eval.get("eval_loss"),
        "final_eval_accuracy": last_eval.get("eval_accuracy"),
        "final_eval_bits_per_byte": last_eval.get("eval_bits_per_byte"),
        "tokens_per_s": steady.get("tokens_per_s", last_train.get("tokens_per_s")),
        "tflops": steady.get("tflops", last_train.get("tflops")),
        "mfu": steady.get("mfu", last_train.get("mfu")),
        "train_tokens": final_step * arguments.total_batch_size * arguments.max_length,
        "process_count": jax.process_count(),
        **facts,
    }
