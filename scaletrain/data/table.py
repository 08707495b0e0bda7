"""Rows of fixed-shape arrays under any keys: what preference data is served as.

Why not :class:`~scaletrain.data.packing.PackedRows`: packed rows are one token
sequence per row with segments, which is what the language-model loss reads. A
preference pair is two sequences (chosen and rejected) plus per-row values (a KTO
label, precomputed reference log-probs), so its rows are a table of columns, each
``[num_rows, ...]``, under the keys the objective reads. Like packed rows they live in
memory and are gathered by index, so the loader serves them vectorised and resumes in
O(1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scaletrain.errors import DataError


@dataclass(frozen=True, eq=False)
class FixedRows:
    """A table of ``num_rows`` rows: ``columns[key]`` has shape ``[num_rows, ...]``.

    ``pad_values[key]`` is what an empty padding row holds under ``key`` (0 unless
    given; token-id columns hold the pad token). A padding row is what the loader adds
    to fill the last batch of an evaluation: its ``*segment_ids`` and ``*loss_mask``
    are all 0, so it has no token and no target.
    """

    columns: Mapping[str, np.ndarray]
    pad_values: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.columns:
            raise DataError("FixedRows needs at least one column")
        lengths = {k: int(np.shape(v)[0]) for k, v in self.columns.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"FixedRows columns have different numbers of rows: {lengths}")

    @property
    def num_rows(self) -> int:
        return int(np.shape(next(iter(self.columns.values())))[0])

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """One row (each column's ``[index]``), for inspection and tests."""
        return {k: v[index] for k, v in self.columns.items()}

    def keys(self) -> list[str]:
        return list(self.columns)

    def with_columns(self, columns: Mapping[str, np.ndarray], pad_values: Mapping[str, Any] | None = None
                     ) -> FixedRows:
        """These rows with ``columns`` added (or replaced), e.g. precomputed reference log-probs ``[num_rows]``."""
        return FixedRows({**self.columns, **columns}, {**self.pad_values, **(pad_values or {})}, self.stats)

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at ``index`` as ``{key: [len(index), ...]}``; indices past the end are padding rows."""
        index = np.asarray(index, dtype=np.int64)
        pad = index >= self.num_rows
        safe = np.where(pad, 0, index)
        out = {k: np.asarray(v)[safe] for k, v in self.columns.items()}
        if pad.any():
            for k, v in out.items():
                v[pad] = self.pad_values.get(k, 0)
        return out
