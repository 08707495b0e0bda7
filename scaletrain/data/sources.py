"""Reading one column of rows from files, Hugging Face datasets or Python iterables.

Why one row iterator for every format: the tokenizing code downstream should not
care where text comes from, and every error must say *where* the bad row is. So
each source yields :class:`SourceRow` ``(value, origin, row)``: the raw cell, the
file (or dataset) it came from and its 1-based row number (the line number for
line-based formats: text per line and JSONL).

Everything streams: text and JSONL line by line, Parquet and CSV in Arrow record
batches of the one column needed, Hugging Face datasets in batches of that column.
Only the current batch of raw values is alive at any time, so memory does not grow
with the size of the input (the caller keeps token arrays, not text).

``pyarrow`` and ``datasets`` are imported only when a Parquet/CSV file or a
Hugging Face dataset is actually read.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

from scaletrain.errors import DataError

Format = Literal["auto", "text", "jsonl", "parquet", "csv", "hf_disk"]
FORMATS: tuple[str, ...] = ("auto", "text", "jsonl", "parquet", "csv", "hf_disk")

_EXTENSIONS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".tsv": "csv",
}
_ASSETS = Path(__file__).resolve().parent.parent / "assets"


class SourceRow(NamedTuple):
    """One cell of the requested column and where it came from (for error messages)."""

    value: Any
    origin: str
    row: int


def detect_format(path: str) -> str:
    """The format of ``path`` from its extension (``.gz`` is looked through) or folder layout."""
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf_disk"
        raise DataError(
            f"{path} is a folder but not a Hugging Face dataset saved with save_to_disk "
            "(no dataset_info.json, state.json or dataset_dict.json); point data.source at files or a glob"
        )
    name = path[:-3] if path.endswith(".gz") else path
    fmt = _EXTENSIONS.get(os.path.splitext(name)[1].lower())
    if fmt is None:
        raise DataError(
            f"cannot tell the format of {path} from its extension; set data.format to one of "
            f"{', '.join(FORMATS[1:])}"
        )
    return fmt


def resolve_paths(source: str) -> list[str]:
    """The files (or dataset folders) named by ``source``: a path or a glob (``**`` recurses), sorted."""
    expanded = os.path.expanduser(source)
    if os.path.exists(expanded):
        return [expanded]
    if not glob.has_magic(expanded):
        raise DataError(f"data file not found: {source}")
    paths = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    if not paths:
        raise DataError(f"no files match {source!r}: check the path or glob")
    return paths


def _bundled_path(source: str) -> str:
    name = source.split(":", 1)[1]
    path = _ASSETS / f"{name}.jsonl.gz"
    if not path.is_file():
        names = sorted(p.name.removesuffix(".jsonl.gz") for p in _ASSETS.glob("*.jsonl.gz"))
        raise DataError(f"no bundled corpus named {name!r}; available: {', '.join(names) or 'none'}")
    return str(path)


def _open_binary(path: str) -> IO[bytes]:
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror or exc}") from None


class MissingColumnError(DataError):
    """A source has no column of the requested name (a caller may treat an optional column's absence as a form)."""


def _missing_column(column: str, origin: str, present: Iterable[str]) -> DataError:
    present = sorted(present)
    chat = [c for c in present if c in ("messages", "conversations")]
    hint = (f"these look like conversations: set data.kind: chat (and data.messages_column: {chat[0]})" if chat
            and column not in ("messages", "conversations") else "set data.text_column / data.messages_column")
    return MissingColumnError(f"{origin}: no column {column!r}; the columns present are {present} ({hint})")


class _BadRowValue:
    """A cell that could not even be read (bad UTF-8, bad JSON, not an object); checked downstream."""

    __slots__ = ("problem",)

    def __init__(self, problem: str):
        self.problem = problem

    def __repr__(self) -> str:
        return f"<unreadable row: {self.problem}>"


def is_unreadable(value: Any) -> str | None:
    """The problem text if ``value`` is a placeholder for a row that could not be read."""
    return value.problem if isinstance(value, _BadRowValue) else None


def _read_text(path: str, per_line: bool) -> Iterator[SourceRow]:
    with _open_binary(path) as f:
        if not per_line:
            data = f.read()
            try:
                yield SourceRow(data.decode("utf-8"), path, 1)
            except UnicodeDecodeError as exc:
                yield SourceRow(_BadRowValue(f"not UTF-8 text ({exc.reason} at byte {exc.start})"), path, 1)
            return
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield SourceRow(_BadRowValue(f"not UTF-8 text ({exc.reason})"), path, number)
                continue
            if line.strip():
                yield SourceRow(line, path, number)


def _read_jsonl(path: str, column: str) -> Iterator[SourceRow]:
    seen_column = False
    with _open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield SourceRow(_BadRowValue(f"not valid JSON ({exc}); JSONL needs one object per line"), path, number)
                continue
            if not isinstance(record, dict):
                yield SourceRow(_BadRowValue(f"a JSON {type(record).__name__}, not an object"), path, number)
                continue
            if column not in record:
                if not seen_column:  # the very first object lacks it: the column name is wrong
                    raise _missing_column(column, f"{path} (line {number})", record)
                yield SourceRow(_BadRowValue(f"no column {column!r} (it has {sorted(record)})"), path, number)
                continue
            seen_column = True
            yield SourceRow(record[column], path, number)


def _read_parquet(path: str, column: str, batch_size: int) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for non-Parquet files
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise _missing_column(column, path, names)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=[column]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield SourceRow(value, path, row)


def _read_csv(path: str, column: str, batch_size: int) -> Iterator[SourceRow]:
    import pyarrow as pa
    import pyarrow.csv as pc

    delimiter = "\t" if path.removesuffix(".gz").endswith(".tsv") else ","
    parse = pc.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    read = pc.ReadOptions(block_size=max(1 << 16, batch_size * 256))
    try:
        header = pc.open_csv(path, read_options=read, parse_options=parse)
        names = header.schema.names
        header.close()
        if column not in names:
            raise _missing_column(column, path, names)
        reader = pc.open_csv(
            path, read_options=read, parse_options=parse,
            convert_options=pc.ConvertOptions(include_columns=[column], column_types={column: pa.string()}),
        )
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError) as exc:
        raise DataError(f"{path} is not a readable CSV file: {exc}") from None
    row = 0
    with reader:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                raise DataError(f"{path}: CSV parse error after row {row}: {exc}") from None
            for value in batch.column(0).to_pylist():
                row += 1
                yield SourceRow(value, path, row)


def _load_hf_disk(path: str, split: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a Hugging Face dataset folder; reading it needs `pip install datasets`") from None
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"cannot load the Hugging Face dataset in {path}: {exc}") from None
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in loaded:
            raise DataError(f"{path} holds the splits {sorted(loaded)}, not {split!r}; set data.split")
        return loaded[split]
    return loaded


def _read_hf(dataset: Any, column: str, origin: str, batch_size: int) -> Iterator[SourceRow]:
    """Rows of a ``datasets.Dataset`` (in batches of one column) or ``IterableDataset``."""
    names = getattr(dataset, "column_names", None)
    if names is not None and column not in names:
        raise _missing_column(column, origin, names)
    if hasattr(dataset, "select_columns") and names is not None:
        dataset = dataset.select_columns([column])
    if hasattr(dataset, "iter") and hasattr(dataset, "__len__"):  # map-style: Arrow batches
        row = 0
        for batch in dataset.iter(batch_size=batch_size):
            for value in batch[column]:
                row += 1
                yield SourceRow(value, origin, row)
        return
    yield from _read_python(dataset, column, origin)


def _read_python(rows: Iterable[Any], column: str, origin: str) -> Iterator[SourceRow]:
    """Rows of an iterable of dicts (a bare string counts as the text itself)."""
    seen_column = False
    for number, record in enumerate(rows, start=1):
        if isinstance(record, str):
            yield SourceRow(record, origin, number)
            continue
        if not isinstance(record, dict):
            yield SourceRow(_BadRowValue(f"a {type(record).__name__}, not a dict"), origin, number)
            continue
        if column not in record:
            if not seen_column:
                raise _missing_column(column, f"{origin} (row {number})", record)
            yield SourceRow(_BadRowValue(f"no column {column!r} (it has {sorted(record)})"), origin, number)
            continue
        seen_column = True
        yield SourceRow(record[column], origin, number)


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.")


def iter_source(
    source: Any,
    column: str,
    *,
    format: Format = "auto",
    per_line: bool = False,
    split: str = "train",
    batch_size: int = 1024,
) -> Iterator[SourceRow]:
    """Stream ``column`` of every row of ``source``.

    ``source`` is ``bundled:NAME``, a file, a glob of files, a ``save_to_disk``
    folder (a ``DatasetDict`` folder is read at ``split``), a ``datasets.Dataset`` /
    ``IterableDataset``, or any Python iterable of dicts. Plain text files have no
    columns: each file is one row (or each non-blank line, with ``per_line``).

    Raises :class:`DataError` naming the path for a missing file and naming the
    column, the file and the columns present for a missing column. Rows that cannot
    be read (bad UTF-8 or JSON) are yielded as placeholders recognised by
    :func:`is_unreadable`, so the caller's bad-row policy decides.
    """
    if not isinstance(source, (str, os.PathLike)):
        if _is_hf_dataset(source):
            if hasattr(source, "keys") and not hasattr(source, "column_names"):
                raise DataError("got a DatasetDict; pass one split, e.g. dataset['train']")
            yield from _read_hf(source, column, f"<{type(source).__name__}>", batch_size)
        elif isinstance(source, Iterable):
            yield from _read_python(source, column, f"<{type(source).__name__}>")
        else:
            raise DataError(f"cannot read rows from a {type(source).__name__}; pass a path, a dataset or an iterable")
        return
    source = str(source)
    if source.startswith("bundled:"):
        yield from _read_jsonl(_bundled_path(source), column)
        return
    if format not in FORMATS:
        raise DataError(f"unknown data format {format!r}; use one of {', '.join(FORMATS)}")
    for path in resolve_paths(source):
        fmt = detect_format(path) if format == "auto" else format
        if fmt == "text":
            yield from _read_text(path, per_line)
        elif fmt == "jsonl":
            yield from _read_jsonl(path, column)
        elif fmt == "parquet":
            yield from _read_parquet(path, column, batch_size)
        elif fmt == "csv":
            yield from _read_csv(path, column, batch_size)
        else:
            yield from _read_hf(_load_hf_disk(path, split), column, f"{path}[{split}]", batch_size)


def source_format(source: Any, format: Format = "auto") -> str:
    """The format ``source`` will be read as (``python`` / ``hf`` for in-memory objects)."""
    if not isinstance(source, (str, os.PathLike)):
        return "hf" if _is_hf_dataset(source) else "python"
    source = str(source)
    if source.startswith("bundled:"):
        return "jsonl"
    if format != "auto":
        return format
    return detect_format(resolve_paths(source)[0])


__all__ = ["FORMATS", "MissingColumnError", "SourceRow", "detect_format", "is_unreadable", "iter_source",
           "resolve_paths", "source_format"]
