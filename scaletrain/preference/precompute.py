"""``precompute_ref_log_probs``: the reference's log-probabilities of every row, computed once and stored.

Why: a reference model costs a forward per step and a copy of the weights in memory; its
log-probabilities of a fixed dataset never change. One pass before training scores every
row (in order), the values are stored in ``output_dir/reference_logps/<split>.npz`` with the
reference's digest and the row count, and the rows are served with them as extra columns
(``ref_chosen_logps`` / ``ref_rejected_logps``, KTO's ``ref_logps`` / ``ref_kl_logps``). A
resumed run finds the file and reuses it (the digest and row count must match); the
reference is dropped once the pass is done.
"""

from __future__ import annotations

import io
import logging
import os
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from scaletrain.data.table import FixedRows
from scaletrain.errors import CheckpointError, DataError
from scaletrain.folders import write_atomic

logger = logging.getLogger("scaletrain")
FOLDER = "reference_logps"


class WithColumns:
    """A random-access source whose rows carry extra per-row values (the stored log-probabilities)."""

    def __init__(self, source: Any, columns: Mapping[str, np.ndarray]):
        for name, values in columns.items():
            if len(values) != len(source):
                raise DataError(f"{name} holds {len(values)} values for {len(source)} rows")
        self.source, self.columns = source, dict(columns)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.source[index], **{k: v[index] for k, v in self.columns.items()}}


def with_columns(rows: Any, values: Mapping[str, np.ndarray]) -> Any:
    """``rows`` serving ``values`` as extra columns: a wider table for the preference kinds' fixed rows (padding
    rows hold 0 there), a wrapping source for any other dataset."""
    if isinstance(rows, FixedRows):
        return FixedRows({**rows.columns, **values}, rows.pad_values, rows.stats)
    return WithColumns(rows, values)


def stored_path(output_dir: str, split: str) -> str:
    return os.path.join(output_dir, FOLDER, f"{split}.npz")


def load_stored(path: str, rows: int, digest: str, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The stored values when ``path`` holds them for these rows and this reference, else None."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as f:
            if int(f["rows"]) != rows or str(f["reference_sha256"]) != digest or not all(n in f for n in names):
                logger.warning("%s was computed for other rows or another reference; computing it again", path)
                return None
            return {n: np.asarray(f[n], np.float32) for n in names}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:  # cut short, overwritten, not ours
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {err}): the reference's stored log-probabilities are "
            "damaged (a write cut short?); delete that file and start the run again, which computes them again "
            "from the reference (one pass over the rows)") from None


def store(path: str, values: Mapping[str, np.ndarray], rows: int, digest: str) -> None:
    """Write atomically (a reader sees the old file or the new one); process 0 only."""
    if jax.process_index() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, rows=np.int64(rows), reference_sha256=np.str_(digest), **values)
    write_atomic(path, buffer.getvalue())


def compute(batches: Any, score: Callable[[dict[str, Any]], dict[str, Any]], place: Callable[[dict], dict],
            rows: int, local_rows: int) -> dict[str, np.ndarray]:
    """Score ``batches`` (this process's rows of each global batch, in order) and return ``rows`` values per name.

    A short last batch is padded to ``local_rows`` with copies of its first row (the jitted
    scorer keeps one shape) and the padding's values are dropped (they come last: one process;
    with several, the trainer asks for a row count the global batch divides).
    """
    out: dict[str, list[np.ndarray]] = {}
    done = 0
    for batch in batches:
        n = len(next(iter(batch.values())))
        if n < local_rows:
            batch = {k: np.concatenate([np.asarray(v), np.repeat(np.asarray(v)[:1], local_rows - n, axis=0)])
                     for k, v in batch.items()}
        values = jax.device_get(score(place(batch)))
        keep = min(len(next(iter(values.values()))), rows - done)
        for name, v in values.items():
            out.setdefault(name, []).append(np.asarray(v, np.float32)[:keep])
        done += keep
    if done != rows:
        raise DataError(f"the reference pass scored {done} rows of {rows}")
    return {name: np.concatenate(parts) for name, parts in out.items()}
