"""What a run leaves in its ``output_dir``, written and read through one set of names.

``metrics.jsonl`` (and TensorBoard / wandb where asked for), the run plan printed at
start, and ``summary.json`` at the end. The trainer writes them; the launcher, the
sweep and the CLI read them back with :func:`read_summary`.
"""

from __future__ import annotations

import json
import os
from typing import Any

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON so that a reader sees the old file or the new one, never half."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=float)
    os.replace(tmp, path)


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
