"""Turn a dataset into per-process batches with grain.

Accepted datasets: anything random-access with ``len`` and ``[i]`` returning a
dict of token arrays (a list of dicts, a Hugging Face ``datasets.Dataset``, a
``grain.MapDataset``), or a column table such as ``PackedRows`` (an object or dict
of ``[N, L]`` arrays). The loader is ``source -> shuffle(seed) -> repeat(epochs) ->
this process's stride -> batch -> collate``: each epoch gets its own permutation,
every process reads a disjoint part of each global batch, and the iterator state is
a single index, so resuming costs O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import grain
import numpy as np

from scaletrain.errors import DataError

Example = dict[str, Any]
TOKEN_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask", "attention_mask")


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


def as_source(dataset: Any) -> Any:
    """A random-access source of example dicts for ``dataset``."""
    if dataset is None:
        raise DataError("no dataset given")
    if isinstance(dataset, dict):
        return ColumnSource({k: np.asarray(v) for k, v in dataset.items() if k in TOKEN_KEYS})
    if hasattr(dataset, "input_ids") and isinstance(getattr(dataset, "input_ids"), np.ndarray):
        return ColumnSource({k: getattr(dataset, k) for k in TOKEN_KEYS if isinstance(getattr(dataset, k, None), np.ndarray)})
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


def make_iterator(
    dataset: Any,
    global_batch_size: int,
    *,
    max_length: int,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    process_index: int = 0,
    process_count: int = 1,
    drop_remainder: bool = True,
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end",
    collate_fn: Callable[[list[Example]], dict[str, np.ndarray]] | None = None,
) -> grain.DatasetIterator:
    """A resumable iterator of this process's share of each global batch."""
    if global_batch_size % process_count:
        raise DataError(f"global batch {global_batch_size} is not divisible by {process_count} processes")
    local = global_batch_size // process_count
    source = as_source(dataset)
    if len(source) == 0:
        raise DataError("the dataset is empty")
    if drop_remainder and len(source) < global_batch_size:
        raise DataError(f"the dataset has {len(source)} rows, fewer than one batch of {global_batch_size}")
    ds = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    if process_count > 1:
        ds = ds[process_index::process_count]
    if collate_fn is None:
        def collate_fn(batch: list[Example]) -> dict[str, np.ndarray]:
            return collate(batch, max_length, local, truncation_mode)
    ds = ds.batch(local, drop_remainder=drop_remainder, batch_fn=collate_fn)
    return iter(ds.to_iter_dataset())


def steps_per_epoch(dataset: Any, global_batch_size: int) -> int:
    """Full global batches in one pass over ``dataset``."""
    return len(as_source(dataset)) // global_batch_size
