"""Online stage: serving packed rows (or any random-access dataset) as sharded, resumable batches.

:func:`make_batch_iterator` serves the rows with grain. Everything is index arithmetic
on a ``MapDataset``, so the iterator's state is a single integer and resuming is O(1):
no batches are replayed, unlike EasyDeL's loader.

Sharding contract: global batch ``b`` of epoch ``e`` is the fixed set of rows
``perm_e[b*G:(b+1)*G]``; process ``p`` of ``P`` receives the contiguous slice
``[p*G/P, (p+1)*G/P)`` of it. Hence the processes see disjoint rows, and their union
is the global batch a single process would see with ``process_count=1``.

A caller that needs a dataset's length, its steps per epoch and its iterator (the
trainer) converts it once with :func:`as_source_or_rows` and passes the result to the
others: converting an already-converted dataset returns it unchanged.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from scaletrain.data.collate import RandomAccess, as_source, collate
from scaletrain.data.packing import PackedRows
from scaletrain.data.table import FixedRows
from scaletrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import grain


def as_source_or_rows(dataset: Any) -> PackedRows | FixedRows | RandomAccess:
    """Packed rows and tables of fixed rows as they are, any other dataset as a random-access source.

    A no-op (the same object back) on packed rows, fixed rows and on anything already
    converted, so it is safe to call again on its own result.
    """
    return dataset if isinstance(dataset, (PackedRows, FixedRows)) else as_source(dataset)


def steps_per_epoch(rows: Any, global_batch_size: int, *, drop_remainder: bool = True) -> int:
    """Global batches in one pass over ``rows`` (the last partial one counts if not dropped).

    ``rows`` is anything :func:`make_batch_iterator` accepts; pass the result of
    :func:`as_source_or_rows` to count without converting again.
    """
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
    n = len(as_source_or_rows(rows))
    return n // global_batch_size if drop_remainder else math.ceil(n / global_batch_size)


class _GatherRows:
    """Turns a batch of row indices into arrays; indices past the end are empty padding rows.

    ``tokens_only``: the batches hold no ``segment_ids``/``positions`` (rows that are
    each one unpadded sequence, and an iterator that never pads: see
    :attr:`PackedRows.single_segment`).
    """

    def __init__(self, rows: PackedRows, tokens_only: bool = False):
        self._rows = rows
        self._tokens_only = tokens_only

    def __call__(self, index: np.ndarray) -> dict[str, np.ndarray]:
        rows = self._rows
        index = np.asarray(index, dtype=np.int64)
        pad = index >= rows.num_rows
        take = np.where(pad, 0, index)
        out = {"input_ids": rows.input_ids[take]}
        if not self._tokens_only:
            out["segment_ids"] = rows.segment_ids[take]
            out["positions"] = rows.positions[take]
        if rows.loss_mask is not None:
            out["loss_mask"] = rows.loss_mask[take]
        if pad.any():
            out["input_ids"][pad] = rows.pad_id
            for key in out.keys() - {"input_ids"}:
                out[key][pad] = 0
        return out


class _GatherTable:
    """A batch of row indices as the table's columns (any keys; indices past the end are padding rows)."""

    def __init__(self, rows: FixedRows):
        self._rows = rows

    def __call__(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return self._rows.take(index)


class _GatherExamples:
    """Fetches examples by index from any random-access source and collates them.

    Indices past the end become empty rows (``segment_ids == 0``, no loss).
    """

    def __init__(self, source: RandomAccess, max_length: int, truncation_mode: str, collate_fn: Any):
        self._source = source
        self._max_length = max_length
        self._truncation_mode = truncation_mode
        self._collate_fn = collate_fn

    def __call__(self, index: np.ndarray) -> dict[str, np.ndarray]:
        n = len(self._source)
        examples = [self._source[int(i)] for i in index if i < n]
        if self._collate_fn is not None:
            return self._collate_fn(examples)
        return collate(examples, self._max_length, len(index), self._truncation_mode)  # type: ignore[arg-type]


def _gather_for(
    rows: PackedRows | FixedRows | RandomAccess, max_length: int | None, truncation_mode: str, collate_fn: Any
) -> _GatherRows | _GatherTable | _GatherExamples:
    """The batch builder: vectorised for packed and fixed rows, collation for examples (needs a length)."""
    if isinstance(rows, PackedRows):
        return _GatherRows(rows)  # tokens-only is decided once the padding is known
    if isinstance(rows, FixedRows):
        return _GatherTable(rows)  # its own keys and shapes: preference pairs, KTO rows
    if max_length is None and collate_fn is None:
        raise ConfigError("max_length is required to collate a dataset of examples")
    return _GatherExamples(rows, max_length or 0, truncation_mode, collate_fn)


def _check_layout(
    num_rows: int, global_batch_size: int, seed: int, num_epochs: int | None, process_index: int, process_count: int
) -> None:
    """Reject what cannot be served: no rows, a bad process slot, an unshardable batch, a bad seed."""
    if num_rows == 0:
        raise DataError("no rows to iterate over: the dataset is empty")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ConfigError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"number of processes ({process_count})"
        )
    if num_epochs is not None and num_epochs < 1:
        raise ConfigError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be in [0, 2**32), got {seed}")


def _batch_indices(num_rows: int, steps: int, global_batch_size: int, seed: int, shuffle: bool) -> Any:
    """One epoch of row indices as a ``MapDataset``, cut or padded to ``steps`` whole global batches.

    Indices ``>= num_rows`` are padding rows. Every transformation keeps grain's epoch in
    its index (index = epoch * len + i), so ``shuffle`` draws a new permutation per epoch.
    """
    import grain

    ds = grain.MapDataset.source(range(num_rows))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    used = steps * global_batch_size
    if used < num_rows:
        ds = ds[:used]
    elif used > num_rows:  # pad the last global batch with empty rows
        padding = grain.MapDataset.source(range(num_rows, used))
        ds = grain.MapDataset.concatenate([ds, padding])
    return ds


def make_batch_iterator(
    rows: Any,
    global_batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    drop_remainder: bool = True,
    max_length: int | None = None,
    truncation_mode: str = "keep_end",
    collate_fn: Any = None,
) -> grain.DatasetIterator:
    """Iterator over this process's share of each global batch, as int32 numpy dicts.

    ``rows`` is :class:`PackedRows` or :class:`FixedRows` (gathered vectorised) or any random-access
    dataset of example dicts (a list, a ``datasets.Dataset``, a ``grain.MapDataset``,
    a dict of columns, or the result of :func:`as_source_or_rows`, used as it is),
    which is collated to ``max_length`` with ``truncation_mode``
    (or by ``collate_fn``). Each element is ``{"input_ids", "segment_ids",
    "positions"[, "loss_mask"]}`` of shape ``[global_batch_size // process_count, L]``;
    packed rows that are each one unpadded sequence (:attr:`PackedRows.single_segment`)
    give ``input_ids`` alone (plus ``loss_mask``) unless the iterator pads, and the model
    treats missing segments as plain causal attention. :class:`FixedRows` (preference
    pairs, KTO rows) are served under their own keys, each ``[rows, ...]`` as stored.
    Epoch ``e`` uses its own permutation (grain reseeds its index shuffle with
    ``seed + e``); ``num_epochs=None`` repeats forever. With ``drop_remainder=False``
    the last global batch of an epoch is filled with padding rows (``segment_ids ==
    0``, no loss), so every process always gets the same shape; use that for
    evaluation.

    ``get_state()`` is ``{"next_index": k}`` after ``k`` batches and ``set_state``
    jumps there directly. A state is only meaningful for an iterator built with the
    same rows and arguments. Rows with a ``batch_iterator`` method (a mixture's
    :class:`~scaletrain.data.mixture.MixtureRows`) are served by it instead.
    """
    import grain

    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    serve = getattr(rows, "batch_iterator", None)
    if serve is not None:  # rows that lay out their own batches (a data.mixture: scaletrain.data.mixture)
        return serve(global_batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                     process_index=process_index, process_count=process_count)
    rows = as_source_or_rows(rows)
    gather = _gather_for(rows, max_length, truncation_mode, collate_fn)
    num_rows = len(rows)
    _check_layout(num_rows, global_batch_size, seed, num_epochs, process_index, process_count)
    steps = steps_per_epoch(rows, global_batch_size, drop_remainder=drop_remainder)
    if steps == 0:
        raise DataError(
            f"the dataset has {num_rows} rows, fewer than one global batch of "
            f"{global_batch_size}; lower the batch size, add data, or use drop_remainder=False"
        )
    ds = _batch_indices(num_rows, steps, global_batch_size, seed, shuffle)
    pads = steps * global_batch_size > num_rows
    if isinstance(rows, PackedRows) and not pads and rows.single_segment:
        gather = _GatherRows(rows, tokens_only=True)  # every batch has the same keys
    ds = ds.batch(global_batch_size // process_count, drop_remainder=True)  # P chunks form one global batch
    ds = ds[process_index::process_count]
    ds = ds.repeat(num_epochs)
    ds = ds.map(gather)
    # The rows are in memory: threads would only contend for the GIL.
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(ds.to_iter_dataset(read_options=read))
