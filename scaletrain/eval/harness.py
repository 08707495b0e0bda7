"""Run lm-evaluation-harness tasks on a scaletrain model, through lm-eval's own evaluator and tracker.

Why lm-eval's pieces rather than our own loop: its tasks, few-shot sampling, filters, metrics
and result files are what users compare across frameworks; only the model is ours
(:class:`~scaletrain.eval.lm_eval_model.ScaletrainLM`). The results and samples files are
the ones ``lm_eval --output_path --log_samples`` writes (its ``EvaluationTracker``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from scaletrain.errors import ConfigError


def require_lm_eval() -> None:
    """ConfigError saying how to install lm-eval when it is missing (it is the ``eval`` extra, not the core)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("lm-evaluation-harness is not installed; `pip install 'scaletrain[eval]'` (or "
                          "`pip install lm-eval`) to run --tasks / eval_harness.tasks") from None


def task_list(tasks: str | Sequence[str]) -> list[str]:
    """``a,b`` or a list of names (or YAML paths), without blanks."""
    items = tasks.split(",") if isinstance(tasks, str) else [t for x in tasks for t in str(x).split(",")]
    names = [t.strip() for t in items if t.strip()]
    if not names:
        raise ConfigError("--tasks: name at least one task")
    return names


def task_manager(tasks: Sequence[str], include_path: str | Sequence[str] | None = None) -> Any:
    """lm-eval's TaskManager over its registry and ``include_path``; one ConfigError naming every task it lacks.

    The manager is a :class:`~scaletrain.eval.task_loading.CheckedTaskManager`: ``preload`` builds the tasks
    ahead of the model, and a task whose data file is missing is one ConfigError naming its YAML.
    """
    require_lm_eval()
    from scaletrain.eval.task_loading import CheckedTaskManager as TaskManager

    paths = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for path in paths:
        if not os.path.exists(path):
            raise ConfigError(f"--include-path {path}: no such file or directory")
    if paths:  # the user's own tasks alone index in milliseconds, lm-eval's registry in seconds
        own = TaskManager(include_path=paths, include_defaults=False)
        if all(t.endswith(".yaml") or own.match_tasks([t]) for t in tasks):
            return own
    manager = TaskManager(include_path=paths or None)
    missing = [t for t in tasks if not t.endswith(".yaml") and not manager.match_tasks([t])]
    missing += [t for t in tasks if t.endswith(".yaml") and not os.path.isfile(t)]
    if missing:
        raise ConfigError(f"--tasks: unknown task(s) {', '.join(missing)}; lm-eval knows none by that name"
                          + ("" if paths else " (give your task YAMLs' folder with --include-path)"))
    return manager


def run_tasks(lm: Any, tasks: str | Sequence[str], *, include_path: str | Sequence[str] | None = None,
              num_fewshot: int | None = None, limit: float | None = None, log_samples: bool = False,
              output_path: str | None = None, model_name: str = "scaletrain",
              gen_kwargs: str | None = None, manager: Any = None, apply_chat_template: bool | str = False,
              fewshot_as_multiturn: bool = False) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on ``lm``; with ``output_path`` its results (and samples) files are written.

    ``apply_chat_template`` / ``fewshot_as_multiturn`` are lm-eval's own options, handed to it as given.

    Returns lm-eval's results dict (``results``, ``configs``, ``versions``, ... and ``samples`` when
    ``log_samples``).
    """
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    names = task_list(tasks)
    manager = manager if manager is not None else task_manager(names, include_path)
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    results = simple_evaluate(
        model=lm, model_args=f"pretrained={model_name}", tasks=names, num_fewshot=num_fewshot, limit=limit,
        log_samples=log_samples, evaluation_tracker=tracker, task_manager=manager, gen_kwargs=gen_kwargs,
        apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
    )
    if results is None:  # a non-zero rank of a multi-process lm-eval run
        return {}
    if tracker is not None:
        samples = results.get("samples") if log_samples else None
        tracker.save_results_aggregated(results={k: v for k, v in results.items() if k != "samples"},
                                        samples=samples)
        if log_samples:
            for name in results["configs"]:
                tracker.save_results_samples(task_name=name, samples=samples[name])
    return results


def flat_metrics(results: dict[str, Any], prefix: str = "harness/") -> dict[str, float]:
    """``{prefix + task/metric: value}`` of every numeric figure (``acc,none`` becomes ``acc``; stderr dropped)."""
    out = {}
    for task, figures in results.get("results", {}).items():
        for key, value in figures.items():
            metric, _, filt = key.partition(",")
            if "stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"{prefix}{task}/{name}"] = float(value)
    return out
