"""``scaletrain eval TARGET``: the work behind the command (the CLI only parses).

Data evaluation (``--data``, or a run's own eval data when neither ``--data`` nor ``--tasks``
is given) and lm-eval tasks (``--tasks``) on one loaded target; a table on the terminal and,
with ``--output``, the same figures as JSON.

Why outside :mod:`scaletrain.eval`: the command rebuilds a run's model and reference as ``run`` does
(:mod:`scaletrain.eval_preference`), while ``run`` reads the in-loop evaluation from that package; the
library sits below ``run`` and the command above it, so no import runs back up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from scaletrain.errors import ConfigError


def parse_mesh(text: str | None) -> tuple[int, ...] | None:
    """``1,-1,1,1,1`` as mesh axis sizes (dp, fsdp, ep, tp, sp); None for the default."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--mesh {text!r}: give comma-separated axis sizes (dp,fsdp,ep,tp,sp), e.g. 1,-1,1,1,1") \
            from None


def run_eval(target: str, *, data: str | None = None, kind: str = "pretrain", split: str = "train",
             data_keys: dict[str, Any] | None = None, tasks: str | None = None, include_path: str | None = None,
             output_path: str | None = None, log_samples: bool = False, limit: float | None = None,
             num_fewshot: int | None = None, apply_chat_template: bool | str = False,
             fewshot_as_multiturn: bool | None = None, batch_size: int | None = None, max_length: int | None = None,
             max_batches: int | None = None, checkpoint: int | None = None, adapter: str | None = None,
             mesh: tuple[int, ...] | None = None, progress: bool = True,
             preference: Any = None) -> dict[str, Any]:
    """Evaluate ``target`` as the command line says; returns ``{"target", "step", "data"?, "tasks"?}``.

    ``preference``: the :class:`~scaletrain.eval_preference.PreferenceOptions` (objective, β,
    reference) that score preference data; None keeps the run's or the defaults.

    ``apply_chat_template`` (True or a template name) and ``fewshot_as_multiturn`` (None: on with a
    chat template) mean what lm-eval's flags of those names mean.

    Bad input is refused before the model loads where it can be (a missing target or data file, an
    unknown task), each as one ConfigError.
    """
    from scaletrain.eval.harness import task_list, task_manager

    if not os.path.exists(target):
        raise ConfigError(f"{target}: no such file or directory; pass a run folder, a checkpoint folder, "
                          "or a Hugging Face model folder")
    if data is not None and not data.startswith(("bundled:", "prepared:")) and not _glob_exists(data):
        raise ConfigError(f"--data {data}: no such file, folder or glob match")
    folder = any(os.path.isfile(os.path.join(target, f)) for f in ("config.json", "adapter_config.json"))
    if data is None and not tasks and folder:
        raise ConfigError(f"{target}: give --data SOURCE or --tasks (only a run folder written by "
                          "`scaletrain train` knows its own eval data)")
    fewshot_as_multiturn = chat_options(tasks, apply_chat_template, fewshot_as_multiturn)
    manager = task_manager(task_list(tasks), include_path) if tasks else None
    if manager is not None:  # the tasks' data read now: a missing file is refused before the model loads
        manager.preload(task_list(tasks))
    from scaletrain.eval.data_eval import source_section
    from scaletrain.eval_preference import PreferenceOptions, check_options

    preference = preference or PreferenceOptions()
    if data is not None:
        check_options(kind, preference)
    section = None if data is None else source_section(  # a bad kind or format is refused before loading
        data, kind=kind, split=split, **{k: v for k, v in (data_keys or {}).items() if v is not None})
    from scaletrain.eval.targets import load_target

    loaded = load_target(target, step=checkpoint, adapter=adapter, mesh=mesh)
    report: dict[str, Any] = {"target": target, "step": loaded.step}
    if data is not None or tasks is None:
        report["data"] = _data_figures(loaded, section, batch_size, max_length, max_batches, progress, preference)
    if tasks:
        from scaletrain.eval.harness import flat_metrics, run_tasks
        from scaletrain.eval.lm_eval_model import ScaletrainLM

        if apply_chat_template and not getattr(loaded.tokenizer, "chat_template", None):
            raise ConfigError(f"--apply_chat_template: the tokenizer of {target} has no chat template; drop the "
                              "flag, or save a tokenizer with one (tokenizer_config.json's chat_template) beside it")
        lm = ScaletrainLM(model=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size or 8,
                          max_length=max_length,
                          template_name=apply_chat_template if isinstance(apply_chat_template, str) else None)
        results = run_tasks(lm, tasks, include_path=include_path, num_fewshot=num_fewshot, limit=limit,
                            log_samples=log_samples, output_path=output_path, model_name=target, manager=manager,
                            apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn)
        report["tasks"] = flat_metrics(results, prefix="")
        report["lm_eval_results"] = results
    return report


def chat_options(tasks: str | None, apply_chat_template: bool | str, fewshot_as_multiturn: bool | None) -> bool:
    """``fewshot_as_multiturn`` resolved as lm-eval 0.4.13's command line resolves it (on with a chat template
    unless given; on without one is refused); the two flags only with ``--tasks``."""
    if not tasks and (apply_chat_template or fewshot_as_multiturn):
        given = "--apply_chat_template" if apply_chat_template else "--fewshot_as_multiturn"
        raise ConfigError(f"{given}: only with --tasks (lm-eval tasks); --data is scored as the data kind renders it")
    if fewshot_as_multiturn is None:
        return bool(apply_chat_template)
    if fewshot_as_multiturn and not apply_chat_template:
        raise ConfigError("--fewshot_as_multiturn needs --apply_chat_template (few-shot turns are turns of a chat)")
    return fewshot_as_multiturn


def _glob_exists(pattern: str) -> bool:
    import glob

    return os.path.exists(pattern) or bool(glob.glob(os.path.expanduser(pattern)))


def _data_figures(loaded: Any, section: Any, batch_size: int | None, max_length: int | None,
                  max_batches: int | None, progress: bool, preference: Any = None) -> dict[str, Any]:
    """Figures of ``section`` (the ``--data`` source), or of the run's own eval data when it is None."""
    from scaletrain.data.config import DataSection
    from scaletrain.eval.data_eval import EvalSettings, eval_rows, evaluate_rows

    recipe = (loaded.meta or {}).get("recipe")
    own = section is None  # the run's own eval data, evaluated as the run evaluated it
    if own and not recipe:
        raise ConfigError(f"{loaded.name}: give --data SOURCE or --tasks (only a run folder written by "
                          "`scaletrain train` knows its own eval data)")
    if loaded.kind == "run":  # the run's batch, length and loss settings; its eval-step cap for its own data
        settings = EvalSettings.of_run(loaded.meta.get("arguments", {}), batch_size=batch_size, max_length=max_length)
        if not own or max_batches is not None:
            settings = dataclasses.replace(settings, max_batches=max_batches)
    else:
        positions = getattr(loaded.model.config, "max_position_embeddings", 2048)
        settings = EvalSettings(batch_size=batch_size or 8, max_length=max_length or min(positions, 2048),
                                max_batches=max_batches)
    section = DataSection(**recipe["data"]) if own else section
    if section.kind == "preference" and section.preparation is None:  # pairs prepared for the scoring objective
        section = section.model_copy(update={"preparation": _pair_preparation(loaded, preference)})
    rows, bytes_per_token = eval_rows(section, loaded.tokenizer, settings)
    head = {"source": section.eval_source or section.source, "kind": section.kind, "rows": len(rows),
            "batch_size": settings.batch_size, "max_length": settings.max_length}
    from scaletrain.eval_preference import PREFERENCE_KINDS, PreferenceOptions, check_options, preference_scoring

    preference = preference or PreferenceOptions()
    if own:  # the kind was known only now
        check_options(section.kind, preference)
    if section.kind not in PREFERENCE_KINDS:
        return {**head, **evaluate_rows(loaded.model, rows, settings, bytes_per_token, progress=progress)}
    from scaletrain.models.factory import place_model

    loaded.model, mesh = place_model(loaded.model)
    scoring = preference_scoring(loaded, section.kind, preference, mesh)
    figures = evaluate_rows(loaded.model, rows, settings, None, progress=progress, objective=scoring.objective,
                            frozen_models=scoring.frozen_models)
    beta = None if scoring.objective.name == "reward" else scoring.objective.beta  # a reward model's scores have none
    head.update(objective=scoring.objective.name, beta=beta, reference=scoring.reference)
    return {**head, **figures}


def _pair_preparation(loaded: Any, preference: Any) -> str | None:
    """How ``--data`` pairs are prepared: as the run prepared its own (its recorded ``data.preparation``) when its
    objective scores them, else as a recipe of the scoring objective would (ORPO/SimPO: TRL's ORPO/CPO trainers')."""
    from scaletrain.objectives.registry import get_objective_type, objective_types

    meta = loaded.meta or {}
    name = preference.objective if preference is not None else None
    if loaded.kind == "run" and name is None:
        recorded = ((meta.get("recipe") or {}).get("data") or {})
        if recorded.get("kind") == "preference" and recorded.get("preparation"):
            return recorded["preparation"]
        name = (meta.get("objective") or {}).get("name")
    name = name if name in objective_types() else "dpo"
    return get_objective_type(name).preparation


def format_table(report: dict[str, Any]) -> str:
    """The report as aligned ``name value`` lines (data figures, then each task's metrics)."""
    lines = [f"target {report['target']}" + (f" (step {report['step']})" if report.get("step") is not None else "")]
    for name, value in (report.get("data") or {}).items():
        lines.append(f"  {name:24s} {_fmt(value)}")
    for name, value in (report.get("tasks") or {}).items():
        lines.append(f"  {name:24s} {_fmt(value)}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return f"{value:.6g}"
    return str(value)


def write_json(report: dict[str, Any], path: str) -> str:
    """``report`` (without lm-eval's own results, which ``--output-path`` writes) as JSON at ``path``."""
    body = {k: v for k, v in report.items() if k != "lm_eval_results"}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(body, f, indent=2, sort_keys=True, default=float)
    return path
