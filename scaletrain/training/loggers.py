"""Where metric records go: ``metrics.jsonl`` always, TensorBoard and (opt-in) wandb.

A record is the flat dict the MetricsLogger builds (``step``, ``split`` and
numbers); each writer turns it into its own format. Writers that need an account
(wandb) are opt-in through ``report_to``; JSON lines and TensorBoard need nothing.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"

_SKIP = {"step", "split", "epoch"}


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    split = record.get("split", "train")
    out = {}
    for k, v in record.items():
        if k in _SKIP or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        name = k.removeprefix("eval_") if split == "eval" else k
        out[f"{split}/{name}"] = float(v)
    return out


class TensorBoardWriter:
    """Scalars under ``<output_dir>/tensorboard`` (tensorboardX event files)."""

    def __init__(self, output_dir: str):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=os.path.join(output_dir, "tensorboard"), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in _scalars(record).items():
            self._writer.add_scalar(tag, value, step)
        if "text" in record:
            self._writer.add_text(f"{record.get('split', 'train')}/text", str(record["text"]), step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbWriter:
    """Weights & Biases run (works offline with ``WANDB_MODE=offline``)."""

    def __init__(self, output_dir: str, project: str, config: dict[str, Any], entity: str | None = None,
                 name: str | None = None):
        try:
            import wandb
        except ImportError:
            from scaletrain.errors import ConfigError

            raise ConfigError("training.report_to includes 'wandb' but wandb is not installed: "
                              "pip install 'scaletrain[wandb]'") from None
        self._run = wandb.init(project=project, entity=entity, name=name, dir=output_dir, config=config,
                               reinit=True)

    def write(self, record: dict[str, Any]) -> None:
        data: dict[str, Any] = _scalars(record)
        if "text" in record:
            data[f"{record.get('split', 'train')}/text"] = str(record["text"])
        self._run.log(data, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class JsonlWriter:
    """Append-only JSON-lines file, flushed per line so a killed run keeps its log."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._f.close()


class RunWriters:
    """The writers ``report_to`` asks for, opened on the first record (so a run that logs nothing
    creates no files) and closed together."""

    def __init__(self, arguments: Any):
        self._arguments = arguments
        self._writers: list[Any] = []

    def write(self, record: dict[str, Any]) -> None:
        if not self._writers:
            self._open()
        for w in self._writers:
            w.write(record)

    def _open(self) -> None:
        a = self._arguments
        out = a.ensure_output_dir()
        self._writers.append(JsonlWriter(os.path.join(out, METRICS_FILE)))
        if "tensorboard" in a.report_to:
            self._writers.append(TensorBoardWriter(out))
        if "wandb" in a.report_to:
            self._writers.append(WandbWriter(out, a.wandb_project, a.model_dump(mode="json"), a.wandb_entity,
                                              a.wandb_name))

    def close(self) -> None:
        for w in self._writers:
            w.close()
        self._writers = []
