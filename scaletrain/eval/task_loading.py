"""lm-eval's ``TaskManager`` with its tasks loaded before the model, and a missing data file named as a user error.

Why: lm-eval reads a task's data (``dataset_kwargs.data_files``) when it builds the task, inside
``simple_evaluate``, after the model has loaded; a path that does not exist ended the command with
``datasets``' ``FileNotFoundError`` traceback that named neither the task nor its YAML. Here the
tasks are built first (:meth:`CheckedTaskManager.preload`, before the model loads), that one load
is handed to ``simple_evaluate``'s own call (no second read of the data), and a missing file
becomes one :class:`~scaletrain.errors.ConfigError` naming the task YAML and the file.

This module imports ``lm_eval``; :mod:`scaletrain.eval.harness` imports it only when tasks are asked for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from lm_eval.tasks import TaskManager

from scaletrain.errors import ConfigError


class CheckedTaskManager(TaskManager):
    """``TaskManager`` whose ``load`` turns a missing data file into one ConfigError, and can load ahead."""

    _preloaded: tuple[list[str], Any] | None = None

    def preload(self, tasks: Sequence[str]) -> None:
        """Build ``tasks`` now (their data read); the next ``load`` of the same list returns this load."""
        names = list(tasks)
        self._preloaded = (names, self.load(names))

    def load(self, task_list: Any) -> Any:  # type: ignore[override]
        ahead, self._preloaded = self._preloaded, None  # used once: a later evaluation builds fresh tasks
        if ahead is not None and ahead[0] == task_list:
            return ahead[1]
        try:
            return super().load(task_list)
        except FileNotFoundError as err:
            raise ConfigError(missing_data_message(self, task_list, err)) from None


def missing_data_message(manager: TaskManager, tasks: Any, err: FileNotFoundError) -> str:
    """One line: which task YAML names the file that is missing, and what to do."""
    missing = err.filename or _quoted(str(err)) or str(err)
    where = _yaml_naming(manager, missing, tasks)
    task = f"task YAML {where}" if where else f"lm-eval task(s) {_names(tasks)}"
    return (f"{task}: the file it reads, {missing}, does not exist; fix the path in the YAML (dataset_kwargs."
            f"data_files: a relative path is read from the working directory, {os.getcwd()})")


def _quoted(text: str) -> str | None:
    found = re.search(r"'([^']+)'", text)
    return found.group(1) if found else None


def _names(tasks: Any) -> str:
    return ",".join(map(str, tasks)) if isinstance(tasks, (list, tuple)) else str(tasks)


def _yaml_naming(manager: TaskManager, missing: str, tasks: Any) -> str | None:
    """The task YAML whose text names ``missing`` (as written, else by its file name): the requested tasks' own
    first, then every indexed one (a group's members); None if none does."""
    requested = [tasks] if isinstance(tasks, str) else [t for t in tasks if isinstance(t, str)]
    index = manager.task_index
    entries = [index[t] for t in requested if t in index] + list(index.values())
    paths = [str(t) for t in requested if t.endswith(".yaml")] + [str(e.yaml_path) for e in entries if e.yaml_path]
    texts: dict[str, str] = {}
    for path in dict.fromkeys(paths):
        try:
            with open(path, encoding="utf-8") as f:
                texts[path] = f.read()
        except OSError:
            continue
    for needle in (missing, os.path.basename(missing)):
        for path, text in texts.items():
            if needle and needle in text:
                return path
    return None
