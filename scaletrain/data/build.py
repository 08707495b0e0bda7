"""From a recipe's ``data`` section to packed train/eval rows, for pre-training or chat SFT.

Why a separate step: ``scaletrain.run`` should only wire sections together. This
function reads the source (streamed), applies the bad-row policy, tokenizes and
packs, and returns :class:`~scaletrain.data.splits.LMSplits` whose ``train`` and
``eval`` are :class:`~scaletrain.data.packing.PackedRows` (with a ``loss_mask`` for
chat). Every process of a multi-host run builds the same rows (deterministic) and
the batch iterator gives each its share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaletrain.data.kinds import data_kind, load_chat_template
from scaletrain.data.records import BadRows
from scaletrain.data.sources import iter_source, source_format
from scaletrain.data.splits import LMSplits
from scaletrain.errors import DataError

if TYPE_CHECKING:
    from scaletrain.data.config import DataSection

__all__ = ["build_datasets", "load_chat_template"]


def build_datasets(
    data: DataSection,
    tokenizer: Any,
    *,
    max_length: int,
    seed: int = 0,
    truncation_mode: str = "keep_end",
) -> LMSplits:
    """Read ``data.source`` (and ``data.eval_source``), tokenize, split and pack, as ``data.kind`` says.

    ``kind: pretrain`` reads ``text_column`` (or whole text files / lines) and packs
    documents with eos; ``kind: chat`` reads ``messages_column`` and packs one
    conversation per segment with a loss mask over the assistant turns
    (:mod:`scaletrain.data.kinds` holds the kinds). Stats (including
    ``bad_rows_skipped``) are in the result's ``stats``. With ``data.mixture`` each entry is
    built so and the results mixed (:func:`scaletrain.data.mixture.build_mixture`).
    """
    if data.mixture:
        from scaletrain.data.mixture import build_mixture

        return build_mixture(data, tokenizer, max_length=max_length, seed=seed, truncation_mode=truncation_mode,
                             build=build_datasets)
    kind = data_kind(data.kind)
    column = kind.column(data)
    bad = BadRows(skip=data.skip_bad_rows)
    fmt = source_format(data.source, data.format)
    if not kind.text_files and fmt == "text":
        raise DataError(
            f"data.kind is {kind.name} but {data.source!r} is read as plain text; {kind.name} data needs a "
            f"{column!r} column in JSONL, Parquet, CSV or a Hugging Face dataset"
        )

    def rows(source: str, split: str, column: str = column) -> Any:  # a kind reading several columns names each
        return iter_source(source, column, format=data.format, per_line=data.per_line, split=split)

    splits = kind.build(data, rows, tokenizer, bad, max_length=max_length, seed=seed, truncation_mode=truncation_mode)
    bad.report()
    splits.stats["bad_rows_skipped"] = bad.count
    return splits
