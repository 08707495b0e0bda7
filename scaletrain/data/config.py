"""The recipe's ``data`` section: where the data comes from, what kind it is, how it is split.

Why it lives in the data layer: :func:`scaletrain.data.build.build_datasets` takes this
section, and the data layer may not import :mod:`scaletrain.recipe` (imports run
``recipe -> data``, never back). The recipe composes it as ``Recipe.data``, so
validation errors still read ``<file>: data.<key>: ...``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scaletrain.data.kinds import unknown_kind_message


class DataSection(BaseModel):
    """Where the data comes from, what kind it is, and how it is split (see docs/data.md)."""

    model_config = ConfigDict(extra="forbid")

    # where: bundled:NAME, a file, a glob, or a Hugging Face save_to_disk folder
    source: str = "bundled:shakespeare"
    format: Literal["auto", "text", "jsonl", "parquet", "csv", "hf_disk"] = "auto"
    split: str = "train"  # the split of a DatasetDict folder
    # what: a registered data kind (scaletrain.data.kinds): plain text to pre-train on, or conversations for chat SFT
    kind: str = "pretrain"
    text_column: str = "text"
    messages_column: str = "messages"
    per_line: bool = False  # text files: one document per non-blank line instead of per file
    max_documents: int | None = Field(None, ge=1)
    # evaluation: a held-out fraction of the source, or a separate source
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    eval_source: str | None = None
    eval_split: str = "validation"  # the split of eval_source when it is a DatasetDict folder
    # chat
    assistant_only_loss: bool = True
    allow_split: bool = False  # split conversations longer than max_length instead of truncating
    chat_template: str | None = None  # Jinja text or a file; overrides the tokenizer's
    # bad rows and speed
    skip_bad_rows: bool = False
    num_workers: int = Field(0, ge=0)  # tokenizer worker processes (0: in the main process)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        message = unknown_kind_message(value)
        if message is not None:
            raise ValueError(message)
        return value
