"""Scaling ladders: one training per ``scaling_index``, run in parallel as Ray tasks.

``scaletrain sweep RECIPE --scaling-indices 1,2,4,8`` builds one member recipe per
index (the ``sweep.scaled_keys`` of ``model`` multiplied by the index, as EasyDeL's
``CONFIG_SCALING_VARIABLES``), runs each as its own Ray task in a fresh process
(``max_calls=1``: JAX state and memory go with it) with ``sweep.cpus_per_member``
CPUs, so Ray runs as many at once as the cluster has room for. Each member trains
in ``<training.output_dir>/member-<index>``.

Re-running is cheap and safe: members are keyed by their resolved recipe
(:mod:`scaletrain.sweep.keys`), so a folder trained by another recipe is refused (or moved aside
with ``rerun_changed``); a member of the same recipe whose ``summary.json`` shows it
reached its horizon is skipped; an unfinished one resumes from its newest
checkpoint; a failed one is reported and does not stop the others. The results
(parameters, tokens, FLOPs = ``flops_per_token(max_length) * tokens``, final eval
loss) go to ``sweep.json``, ``sweep.csv`` and ``sweep.png`` with a fit of
``L = a * C**(-b) + c``, called ok only with more members than its 3 parameters.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time
import warnings
from typing import Any

from scaletrain.errors import ConfigError
from scaletrain.recipe import Recipe, apply_overrides
from scaletrain.sweep.keys import keyed_recipe, record_member, refuse_or_move, stale_member
from scaletrain.folders import write_json_atomic
from scaletrain.training.outputs import read_summary

logger = logging.getLogger("scaletrain")

MEMBER_DIR = "member-{index}"
COLUMNS = ("scaling_index", "status", "num_params", "train_tokens", "flops", "final_eval_loss",
           "final_train_loss", "final_step", "elapsed_s", "output_dir", "error")


def member_recipe(recipe: Recipe, index: int) -> Recipe:
    """The recipe of member ``index``: scaled model keys, its own output_dir, resume on."""
    if recipe.model.pretrained:
        raise ConfigError("sweep: model.pretrained is set; a sweep scales a new model, remove model.pretrained")
    data = recipe.to_dict()
    for key in recipe.sweep.scaled_keys:
        base = recipe.model.config_overrides.get(key)
        if not isinstance(base, int):
            raise ConfigError(f"sweep.scaled_keys names model.{key}, which the recipe does not set to an int; "
                              f"set model.{key} (its value at scaling index 1)")
        data["model"][key] = base * index
    root = os.path.abspath(recipe.training.output_dir)
    data["training"]["output_dir"] = os.path.join(root, MEMBER_DIR.format(index=index))
    data["training"]["resume_if_possible"] = True
    data["ray"]["num_workers"] = None
    data = apply_overrides(data, recipe.sweep.member_overrides.get(index, []))
    return Recipe.from_dict(data, where=f"sweep member {index}")


def is_finished(summary: dict[str, Any] | None) -> bool:
    """A member that reached its training horizon (not one stopped early or killed)."""
    if not summary or summary.get("max_training_steps") is None:
        return False
    return summary.get("final_step", 0) >= summary["max_training_steps"]


def train_member(recipe: Recipe, cwd: str) -> dict[str, Any]:
    """Body of one member's Ray task (a fresh process)."""
    from scaletrain.logs import setup_logging
    from scaletrain.run import run_training

    if os.path.isdir(cwd):
        os.chdir(cwd)
    setup_logging()
    return run_training(recipe)


def _error_text(err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err
    first = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {first[0] if first else ''}"


def run_sweep(
    recipe: Recipe,
    scaling_indices: list[int] | tuple[int, ...] | None = None,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    rerun_changed: bool = False,
) -> dict[str, Any]:
    """Train every member not yet finished, then write ``sweep.json``/``.csv``/``.png``; returns the report.

    A member folder trained by a different resolved recipe (:mod:`scaletrain.sweep.keys`) is refused
    before anything runs, or with ``rerun_changed`` moved aside and trained again.
    """
    indices = tuple(scaling_indices or recipe.sweep.scaling_indices)
    if not indices or any(not isinstance(i, int) or i < 1 for i in indices):
        raise ConfigError(f"sweep: scaling indices must be positive ints, got {list(indices)}")
    if len(set(indices)) != len(indices):
        raise ConfigError(f"sweep: scaling indices repeat: {list(indices)}")
    root = os.path.abspath(recipe.training.output_dir)
    os.makedirs(root, exist_ok=True)
    rows: dict[int, dict[str, Any]] = {}
    todo: dict[int, Recipe] = {}
    members: dict[int, Recipe] = {}
    for index in indices:
        out = os.path.join(root, MEMBER_DIR.format(index=index))
        row: dict[str, Any] = {"scaling_index": index, "output_dir": out, "error": None}
        try:
            member = member_recipe(recipe, index)
            from scaletrain.models.registry import get_modules_by_type

            config_class, _ = get_modules_by_type(member.model.type)
            config_class(**member.model.config_overrides)  # e.g. heads that no longer divide hidden_size
        except (ConfigError, ValueError) as err:
            rows[index] = {**row, "status": "failed", "error": _error_text(err)}
            continue
        members[index] = member
        rows[index] = row
    keyed = {index: keyed_recipe(member.to_dict()) for index, member in members.items()}
    defaults = keyed_recipe(Recipe().to_dict())
    stale = {rows[i]["output_dir"]: keys for i in members
             if (keys := stale_member(rows[i]["output_dir"], keyed[i], defaults))}
    for moved in refuse_or_move(stale, rerun_changed):
        logger.warning("sweep: the recipe of a member changed; its old folder is now %s", moved)
    for index, member in members.items():
        row, out = rows[index], rows[index]["output_dir"]
        record_member(out, index, keyed[index])
        if is_finished(read_summary(out)):
            rows[index] = {**row, "status": "skipped (finished earlier)"}
        else:
            todo[index] = member
            rows[index] = {**row, "status": "pending"}
    if todo:
        _run_members(todo, rows, ray_address, num_cpus, recipe.sweep.cpus_per_member)
    for index, row in rows.items():
        summary = read_summary(row["output_dir"])
        if summary is not None and row["status"] != "failed":
            row.update(_measures(summary))
    report = {
        "sweep_dir": root,
        "scaled_keys": list(recipe.sweep.scaled_keys),
        "members": [rows[i] for i in indices],
        "fit": fit_power_law([r.get("flops") for r in rows.values() if _usable(r)],
                             [r.get("final_eval_loss") for r in rows.values() if _usable(r)]),
    }
    write_report(report, root)
    return report


def _usable(row: dict[str, Any]) -> bool:
    return row["status"] != "failed" and is_finite(row.get("flops")) and is_finite(row.get("final_eval_loss"))


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _measures(summary: dict[str, Any]) -> dict[str, Any]:
    tokens = summary.get("train_tokens")
    fpt = summary.get("flops_per_token")
    return {
        "num_params": summary.get("num_params"),
        "train_tokens": tokens,
        "flops": fpt * tokens if is_finite(fpt) and is_finite(tokens) else None,
        "final_eval_loss": summary.get("final_eval_loss"),
        "final_train_loss": summary.get("final_train_loss"),
        "final_step": summary.get("final_step"),
        "elapsed_s": summary.get("elapsed_s"),
        "finished": is_finished(summary),
    }


def _run_members(todo: dict[int, Recipe], rows: dict[int, dict[str, Any]], ray_address: str | None,
                 num_cpus: int | None, cpus_per_member: float) -> None:
    from scaletrain.launch.ray.cluster import ensure_ray, import_ray, make_worker_env

    ray = import_ray()
    started_ray = ensure_ray(ray_address, num_cpus)
    try:
        task = ray.remote(num_cpus=cpus_per_member, max_calls=1, max_retries=0,
                          runtime_env={"env_vars": make_worker_env(use_gpu=False, use_tpu=False)})(train_member)
        cwd = os.getcwd()
        pending = {task.remote(member, cwd): index for index, member in todo.items()}
        started = {index: time.time() for index in todo}
        logger.info("sweep: %d member(s) submitted: %s", len(pending), sorted(todo))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(done[0])
            try:
                summary = ray.get(done[0])
                rows[index]["status"] = "finished" if is_finished(summary) else "stopped early"
                logger.info("sweep: member %d %s in %.0fs", index, rows[index]["status"], time.time() - started[index])
            except Exception as err:  # one failed member must not stop the others
                rows[index]["status"] = "failed"
                rows[index]["error"] = _error_text(err)
                logger.error("sweep: member %d failed: %s", index, rows[index]["error"])
    finally:
        if started_ray:
            ray.shutdown()


FIT_PARAMETERS = 3  # a, b, c


def fit_power_law(compute: list[float], loss: list[float]) -> dict[str, Any]:
    """Fit ``L = a * C**(-b) + c`` (a, b >= 0; 0 <= c <= min L); ``ok`` needs 4 points.

    Compute is scaled by its smallest value for the optimiser's sake and ``a`` is
    reported in the original units. ``status`` is ``ok``, ``too_few_points``,
    ``exactly_determined`` or ``no_convergence``; every status but ``ok`` comes with
    ``ok: False`` and a ``reason`` instead of an exception. With as many points as
    parameters the curve passes through every point whatever the data, so it is no
    evidence for a power law: its values are reported but it is not called ok.
    """
    points = [(c, l) for c, l in zip(compute, loss) if is_finite(c) and is_finite(l) and c > 0]
    if len(points) < FIT_PARAMETERS:
        return {"ok": False, "status": "too_few_points", "points": len(points),
                "reason": f"{len(points)} member(s) with FLOPs and an eval loss: a fit needs at least "
                          f"{FIT_PARAMETERS} to be determined and at least {FIT_PARAMETERS + 1} to be tested"}
    import numpy as np
    from scipy.optimize import curve_fit

    c = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    c0 = c.min()
    x = c / c0

    def law(x: np.ndarray, a: float, b: float, k: float) -> np.ndarray:
        return a * np.power(x, -b) + k

    k0 = 0.5 * y.min()
    try:
        with warnings.catch_warnings():  # an exact 3-point fit has no covariance: not a problem here
            warnings.simplefilter("ignore")
            (a, b, k), _ = curve_fit(law, x, y, p0=(max(y.max() - k0, 1e-3), 0.3, k0),
                                     bounds=([0.0, 0.0, 0.0], [np.inf, 5.0, y.min()]), maxfev=20000)
    except (RuntimeError, ValueError) as err:
        return {"ok": False, "status": "no_convergence", "reason": f"the fit did not converge: {err}",
                "points": len(points)}
    pred = law(x, a, b, k)
    out = {"ok": True, "status": "ok", "a": float(a * c0**b), "b": float(b), "c": float(k), "points": len(points),
           "rmse": float(np.sqrt(np.mean((pred - y) ** 2))), "formula": "L = a * C**(-b) + c (C in FLOPs)"}
    if len(points) == FIT_PARAMETERS:
        out.update(ok=False, status="exactly_determined",
                   reason=f"exactly determined: {len(points)} members for the {FIT_PARAMETERS} parameters of "
                          f"L = a*C^-b + c, so the curve passes through every point and is no evidence for a "
                          f"power law (a={out['a']:.4g}, b={out['b']:.4g}, c={out['c']:.4g}); "
                          f"add members (at least {FIT_PARAMETERS + 1}) for a fit that can be tested")
    return out


def write_report(report: dict[str, Any], root: str) -> None:
    """``sweep.json`` (atomically: a re-run or another reader never sees half), ``sweep.csv``, ``sweep.png``."""
    write_json_atomic(os.path.join(root, "sweep.json"), report)
    with open(os.path.join(root, "sweep.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in report["members"]:
            writer.writerow({k: row.get(k) for k in COLUMNS})
    plot_sweep(report, os.path.join(root, "sweep.png"))


def plot_sweep(report: dict[str, Any], path: str) -> str:
    """Final eval loss against training FLOPs (log x), one labelled point per member, and the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in report["members"] if _usable(r)]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for r in rows:
        ax.scatter(r["flops"], r["final_eval_loss"], color="C0")
        ax.annotate(f"x{r['scaling_index']} ({r['num_params'] / 1e6:.2g}M)", (r["flops"], r["final_eval_loss"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    fit = report["fit"]
    if "a" in fit and rows:  # an exactly determined curve is drawn dashed and labelled as such
        exact = fit.get("status") == "exactly_determined"
        xs = np.geomspace(min(r["flops"] for r in rows), max(r["flops"] for r in rows), 100)
        ax.plot(xs, fit["a"] * xs ** (-fit["b"]) + fit["c"], color="C1", linestyle="--" if exact else "-",
                label=f"L = {fit['a']:.3g}·C^-{fit['b']:.3g} + {fit['c']:.3g}"
                      + (" (exactly determined: not evidence)" if exact else ""))
        ax.legend(fontsize=8)
    elif not rows:
        ax.text(0.5, 0.5, "no finished member with an eval loss", ha="center", transform=ax.transAxes)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final eval loss")
    ax.set_title("scaling sweep: eval loss against compute", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
