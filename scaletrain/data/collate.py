"""Random access to any dataset's examples, and collation into fixed-shape batches.

Accepted datasets: anything random-access with ``len`` and ``[i]`` returning a
dict of token arrays (a list of dicts, a Hugging Face ``datasets.Dataset``, a
``grain.MapDataset``), or a table of ``[N, L]`` columns (a dict of arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from scaletrain.errors import DataError

Example = dict[str, Any]
TOKEN_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask", "attention_mask")


class RandomAccess(Protocol):
    """What the loader needs of a dataset of examples: its length and the example at an index."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Example: ...


class ColumnSource:
    """Random access to rows of a table of equal-length columns."""

    def __init__(self, columns: dict[str, np.ndarray]):
        lengths = {k: len(v) for k, v in columns.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"dataset columns have different lengths: {lengths}")
        self.columns = columns
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Example:
        return {k: v[index] for k, v in self.columns.items()}


def as_source(dataset: Any) -> RandomAccess:
    """A random-access source of example dicts for ``dataset``.

    Idempotent and cheap on a source: a :class:`ColumnSource` or any other object with
    ``len`` and ``[i]`` comes back as it is, so callers may convert once and pass the
    result on to functions that convert again.
    """
    if dataset is None:
        raise DataError("no dataset given")
    if isinstance(dataset, dict):
        return ColumnSource({k: np.asarray(v) for k, v in dataset.items() if k in TOKEN_KEYS})
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return dataset
    raise DataError(
        f"dataset of type {type(dataset).__name__} is not random-access; pass a list of dicts, a "
        "datasets.Dataset, a grain.MapDataset or packed rows"
    )


def collate(
    examples: Sequence[Example],
    max_length: int,
    rows: int,
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end",
    pad_token_id: int = 0,
) -> dict[str, np.ndarray]:
    """Stack examples into ``[rows, max_length]`` arrays, truncating and right-padding.

    Missing ``segment_ids`` come from ``attention_mask`` (or all ones); padding rows
    and positions get segment 0, which the loss and attention ignore. Examples longer
    than ``max_length`` keep their end or their start (``truncation_mode``).
    """
    if not examples:
        raise DataError("empty batch")
    if "input_ids" not in examples[0]:
        raise DataError(f"dataset rows need an 'input_ids' column; found {sorted(examples[0])}")
    has_loss_mask = any("loss_mask" in e for e in examples)
    out = {
        "input_ids": np.full((rows, max_length), pad_token_id, np.int32),
        "segment_ids": np.zeros((rows, max_length), np.int32),
        "positions": np.zeros((rows, max_length), np.int32),
    }
    if has_loss_mask:
        out["loss_mask"] = np.zeros((rows, max_length), np.int32)
    for r, ex in enumerate(examples):
        ids = np.asarray(ex["input_ids"]).reshape(-1)
        n = len(ids)
        seg = ex.get("segment_ids")
        if seg is None:
            am = ex.get("attention_mask")
            seg = np.ones(n, np.int32) if am is None else (np.asarray(am).reshape(-1) != 0).astype(np.int32)
        seg = np.asarray(seg).reshape(-1)
        lm = np.asarray(ex["loss_mask"]).reshape(-1) if "loss_mask" in ex else np.ones(n, np.int32)
        sl = slice(max(n - max_length, 0), n) if truncation_mode == "keep_end" else slice(0, min(n, max_length))
        k = sl.stop - sl.start
        pos = ex.get("positions")
        # positions count from the first kept token unless the example brings its own
        pos = np.maximum(np.cumsum(seg[sl] != 0) - 1, 0) if pos is None else np.asarray(pos).reshape(-1)[sl]
        out["input_ids"][r, :k] = ids[sl]
        out["segment_ids"][r, :k] = seg[sl]
        out["positions"][r, :k] = pos
        if has_loss_mask:
            out["loss_mask"][r, :k] = lm[sl]
    return out


