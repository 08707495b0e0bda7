"""Key each sweep member by its resolved recipe, so a re-run never reuses a stale member.

A re-run of a sweep skips finished members and resumes unfinished ones; that is
only right if the member folder was trained by the recipe the re-run asks for.
Each member's folder therefore records the digest of its resolved recipe
(``sweep-member.json``). On the next run, a folder whose record differs and
that holds something to reuse (a ``summary.json`` or checkpoints) is refused
with the changed keys named, or moved aside and trained afresh when asked
(``rerun_changed``); it is never silently reused.

Keys that only say where or how a member runs, or when it pauses (the ``sweep``,
``ray``, ``launch`` and ``eval_harness`` sections, paths, progress display, loggers, stop conditions that a
resume continues from bit-identically) are not part of the key: changing them
must not force a retrain.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import yaml

from scaletrain.errors import ConfigError
from scaletrain.folders import write_json_atomic
from scaletrain.training.outputs import read_summary

RECORD_FILE = "sweep-member.json"
IGNORED_SECTIONS = ("sweep", "ray", "launch", "eval_harness")  # eval_harness scores, it never changes what is trained
IGNORED_TRAINING_KEYS = (
    "output_dir", "resume_if_possible", "progress_bar", "compilation_cache_dir", "report_to", "wandb_project",
    "kill_switch_path", "exit_iteration", "exit_iteration_this_run", "training_time_limit",
)
MAX_NAMED_CHANGES = 8


def keyed_recipe(recipe_dict: dict[str, Any]) -> dict[str, Any]:
    """The part of a member's resolved recipe (``Recipe.to_dict()``) that decides what it trains."""
    out = {k: v for k, v in recipe_dict.items() if k not in IGNORED_SECTIONS}
    if isinstance(out.get("training"), dict):
        out["training"] = {k: v for k, v in out["training"].items() if k not in IGNORED_TRAINING_KEYS}
    return out


def recipe_digest(keyed: dict[str, Any]) -> str:
    """sha256 of the keyed recipe as canonical JSON (sorted keys), stable across runs and hosts."""
    text = json.dumps(keyed, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """``key: old → new`` for every dotted key that differs between two keyed recipes.

    A key missing from ``old`` whose new value is its default (``defaults``, a keyed
    ``Recipe().to_dict()``) is not a change: it is a field a newer scaletrain added.
    """
    a, b = _flatten(old), _flatten(new)
    d = _flatten(defaults) if defaults else {}
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a and key in d and _same(b.get(key), d[key]):
            continue
        if key not in a or key not in b or not _same(a[key], b[key]):
            out.append(f"{key}: {_shown(a, key)} -> {_shown(b, key)}")
    return out


def _shown(flat: dict[str, Any], key: str) -> str:
    return repr(flat[key]) if key in flat else "(absent)"


def _same(x: Any, y: Any) -> bool:
    """Equal as JSON would store them (a tuple read back from YAML is a list)."""
    return json.dumps(x, sort_keys=True, default=str) == json.dumps(y, sort_keys=True, default=str)


def recorded_recipe(member_dir: str) -> dict[str, Any] | None:
    """The keyed recipe a member folder was trained with: its record, else (older folders) its recipe.yaml."""
    try:
        with open(os.path.join(member_dir, RECORD_FILE)) as f:
            return json.load(f)["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(os.path.join(member_dir, "recipe.yaml")) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return keyed_recipe(data) if isinstance(data, dict) else None


def has_outputs(member_dir: str) -> bool:
    """Whether the folder holds anything a run would reuse: a summary or a checkpoint."""
    ckpt = os.path.join(member_dir, "checkpoints")
    return read_summary(member_dir) is not None or (os.path.isdir(ckpt) and bool(os.listdir(ckpt)))


def record_member(member_dir: str, index: int, keyed: dict[str, Any]) -> None:
    """Write the member's key before it trains, so its checkpoints are tied to it from the first one."""
    os.makedirs(member_dir, exist_ok=True)
    write_json_atomic(os.path.join(member_dir, RECORD_FILE),
                      {"scaling_index": index, "recipe_sha256": recipe_digest(keyed), "recipe": keyed})


def stale_member(member_dir: str, keyed: dict[str, Any], defaults: dict[str, Any]) -> list[str] | None:
    """The changed keys when ``member_dir`` holds outputs of another recipe; None when it may be reused."""
    if not has_outputs(member_dir):
        return None  # nothing there to reuse: training it afresh mixes nothing
    old = recorded_recipe(member_dir)
    if old is None:
        return [f"(no {RECORD_FILE} or recipe.yaml: the recipe it was trained with is unknown)"]
    if recipe_digest(old) == recipe_digest(keyed):
        return None
    return changed_keys(old, keyed, defaults) or None


def move_aside(member_dir: str) -> str:
    """Rename a stale member folder to ``<folder>.replaced-<n>`` (never deleted: its checkpoints are not ours)."""
    n = 1
    while os.path.exists(f"{member_dir}.replaced-{n}"):
        n += 1
    target = f"{member_dir}.replaced-{n}"
    os.replace(member_dir, target)
    return target


def stale_message(stale: dict[str, list[str]]) -> str:
    """One message for every stale member: which folder, which keys changed, what to do."""
    groups: dict[tuple[str, ...], list[str]] = {}  # folders with the same changes are named together
    for folder, keys in stale.items():
        groups.setdefault(tuple(keys), []).append(folder)
    parts = []
    for keys, folders in groups.items():
        shown = list(keys[:MAX_NAMED_CHANGES]) + ([f"... {len(keys) - MAX_NAMED_CHANGES} more"]
                                                  if len(keys) > MAX_NAMED_CHANGES else [])
        parts.append(f"{', '.join(folders)} ({'; '.join(shown)})")
    return ("sweep: member folder(s) hold a run of a different recipe and would be reused: " + ", ".join(parts)
            + ". Use a new training.output_dir for the changed recipe, or re-run with --rerun-changed "
            "(run_sweep(rerun_changed=True)) to move these folders aside (<folder>.replaced-<n>) and train them again")


def refuse_or_move(stale: dict[str, list[str]], rerun_changed: bool) -> list[str]:
    """Raise for stale members, or move them aside when asked; returns the folders they were moved to."""
    if not stale:
        return []
    if not rerun_changed:
        raise ConfigError(stale_message(stale))
    return [move_aside(folder) for folder in stale]
