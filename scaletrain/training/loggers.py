"""Where metric records go: ``metrics.jsonl`` always, TensorBoard and (opt-in) wandb.

A record is the flat dict the MetricsLogger builds (``step``, ``split`` and
numbers); each writer turns it into its own format. Writers that need an account
(wandb) are opt-in through ``report_to``; JSON lines and TensorBoard need nothing.

``metrics.jsonl`` is the run's record: a line it cannot write ends the run. TensorBoard
and wandb are side loggers: one that cannot write is turned off with one warning and
training goes on; none of them ever blocks the loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from scaletrain.log_files import AppendLog, repair_last_line

logger = logging.getLogger("scaletrain")

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
    """Scalars under ``<output_dir>/tensorboard``, written by the calling thread.

    Why not tensorboardX's ``SummaryWriter``: it hands events to a writer thread through
    a queue of ten; a write that thread cannot make (a full disk) ends it, the queue
    fills, and the next ``add_event`` blocks the training loop forever. Here the events
    go through tensorboardX's own file format (``EventsWriter``) in this thread, so a
    refused write is an ``OSError`` at the caller (:class:`SideLogger` turns TensorBoard
    off on it). Flushed (and fsynced) at most every ``FLUSH_SECONDS``, as before.
    """

    FLUSH_SECONDS = 10.0

    def __init__(self, output_dir: str):
        from tensorboardX.event_file_writer import EventsWriter

        logdir = os.path.join(output_dir, "tensorboard")
        os.makedirs(logdir, exist_ok=True)
        self._events = EventsWriter(os.path.join(logdir, "events"))
        self._flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar, text

        step, now = int(record["step"]), time.time()
        summaries = [scalar(tag, value) for tag, value in _scalars(record).items()]
        if "text" in record:
            summaries.append(text(f"{record.get('split', 'train')}/text", str(record["text"])))
        for summary in summaries:
            self._events.write_event(Event(summary=summary, step=step, wall_time=now))
        if time.monotonic() - self._flushed >= self.FLUSH_SECONDS:
            self._events.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._events.close()


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
    """Append-only JSON-lines file, one whole line per record (``scaletrain/log_files.py``), so a killed run
    keeps its log and a refused write leaves no half line.

    The run's record: a line it cannot write (a full disk) ends the run, as an
    ``OSError`` naming the file (the CLI turns a lack of room into one line).
    """

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        repair_last_line(path)
        self._log = AppendLog(path)

    def write(self, record: dict[str, Any]) -> None:
        self._log.append(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._log.close()


class SideLogger:
    """A logger the run can do without (TensorBoard, wandb): the first write it cannot make
    turns it off, with one warning.

    Why: ``metrics.jsonl`` holds every record; a side logger that cannot write (a full
    disk, a lost mount) must neither stop nor block training. Opening is deferred to
    the first record so a logger that cannot even open is turned off the same way.
    """

    def __init__(self, name: str, open_writer: Callable[[], Any]):
        self.name = name
        self._open = open_writer
        self._writer: Any = None
        self.off = False

    def write(self, record: dict[str, Any]) -> None:
        if self.off:
            return
        try:
            if self._writer is None:
                self._writer = self._open()
            self._writer.write(record)
        except OSError as err:
            self._turn_off(err)

    def close(self) -> None:
        if self._writer is not None and not self.off:
            try:
                self._writer.close()
            except OSError as err:
                self._turn_off(err)
        self._writer = None

    def _turn_off(self, err: OSError) -> None:
        self.off = True
        logger.warning("%s cannot write (%s): it is off from here on; metrics.jsonl keeps every record",
                       self.name, err.strerror or err)
        if self._writer is not None:
            with contextlib.suppress(OSError):
                self._writer.close()  # releases the file (what it still buffered cannot be written)


class RunWriters:
    """The writers ``report_to`` asks for, opened on the first record (so a run that logs nothing
    creates no files) and closed together: ``metrics.jsonl`` last, as the others never raise."""

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
            self._writers.append(SideLogger("TensorBoard", lambda: TensorBoardWriter(out)))
        if "wandb" in a.report_to:
            self._writers.append(SideLogger("wandb", lambda: WandbWriter(
                out, a.wandb_project, a.model_dump(mode="json"), a.wandb_entity, a.wandb_name)))

    def close(self) -> None:
        writers, self._writers = self._writers, []
        for w in reversed(writers):
            w.close()
