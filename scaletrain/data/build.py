"""From a recipe's ``data`` section to packed train/eval rows, for pre-training or chat SFT.

Why a separate step: ``scaletrain.run`` should only wire sections together. This
function reads the source (streamed), applies the bad-row policy, tokenizes and
packs, and returns :class:`~scaletrain.data.splits.LMSplits` whose ``train`` and
``eval`` are :class:`~scaletrain.data.packing.PackedRows` (with a ``loss_mask`` for
chat). Every process of a multi-host run builds the same rows (deterministic) and
the batch iterator gives each its share.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from scaletrain.data.records import BadRows, iter_conversations, iter_texts
from scaletrain.data.sources import iter_source, source_format
from scaletrain.data.splits import LMSplits
from scaletrain.errors import DataError

if TYPE_CHECKING:
    from scaletrain.data.config import DataSection


def load_chat_template(value: str) -> str:
    """``data.chat_template``: the template text itself, or the path of a file holding it."""
    path = os.path.expanduser(value)
    if "{" not in value and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise DataError(f"data.chat_template: {value!r} is neither a Jinja template nor an existing file")
    return value


def build_datasets(
    data: DataSection,
    tokenizer: Any,
    *,
    max_length: int,
    seed: int = 0,
    truncation_mode: str = "keep_end",
) -> LMSplits:
    """Read ``data.source`` (and ``data.eval_source``), tokenize, split and pack.

    ``kind: pretrain`` reads ``text_column`` (or whole text files / lines) and packs
    documents with eos; ``kind: chat`` reads ``messages_column`` and packs one
    conversation per segment with a loss mask over the assistant turns. Stats
    (including ``bad_rows_skipped``) are in the result's ``stats``.
    """
    column = data.text_column if data.kind == "pretrain" else data.messages_column
    bad = BadRows(skip=data.skip_bad_rows)
    fmt = source_format(data.source, data.format)
    if data.kind == "chat" and fmt == "text":
        raise DataError(
            f"data.kind is chat but {data.source!r} is read as plain text; chat data needs a "
            f"{data.messages_column!r} column in JSONL, Parquet, CSV or a Hugging Face dataset"
        )

    def rows(source: str, split: str) -> Any:
        return iter_source(source, column, format=data.format, per_line=data.per_line, split=split)

    eval_rows = rows(data.eval_source, data.eval_split) if data.eval_source else None
    name = f"data.source {data.source!r}"
    if data.kind == "pretrain":
        from scaletrain.data.splits import build_lm_splits

        splits = build_lm_splits(
            iter_texts(rows(data.source, data.split), bad, data.max_documents),
            tokenizer, max_length, eval_fraction=data.eval_fraction, seed=seed,
            eval_texts=None if eval_rows is None else iter_texts(eval_rows, bad),
            name=name, num_workers=data.num_workers,
        )
    else:
        from scaletrain.data.chat import build_chat_splits

        template = load_chat_template(data.chat_template) if data.chat_template else None
        if template is not None:
            tokenizer.chat_template = template  # so a saved checkpoint carries the template it was trained with
        splits = build_chat_splits(
            iter_conversations(rows(data.source, data.split), bad, data.max_documents),
            tokenizer, max_length, eval_fraction=data.eval_fraction, seed=seed,
            eval_conversations=None if eval_rows is None else iter_conversations(eval_rows, bad),
            assistant_only_loss=data.assistant_only_loss, truncation_mode=truncation_mode,  # type: ignore[arg-type]
            allow_split=data.allow_split, name=name, num_workers=data.num_workers,
        )
    bad.report()
    splits.stats["bad_rows_skipped"] = bad.count
    return splits
