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
    # preference (kind: preference, unpaired_preference): TRL's column names and prompt cut
    prompt_column: str = "prompt"  # absent from a paired source: the prompt is chosen's and rejected's shared start
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    completion_column: str = "completion"  # unpaired_preference (KTO)
    label_column: str = "label"  # unpaired_preference: true (desirable) / false
    max_prompt_length: int | None = None  # tokens of the prompt kept (training.truncation_mode's side); None: all
    # bad rows and speed
    skip_bad_rows: bool = False
    num_workers: int = Field(0, ge=0)  # tokenizer worker processes (0: in the main process)

    @field_validator("prompt_column", "chosen_column", "rejected_column", "completion_column", "label_column")
    @classmethod
    def _column_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a column name cannot be empty")
        return value

    @field_validator("max_prompt_length")
    @classmethod
    def _positive_prompt_length(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be a positive number of tokens (or null for the whole prompt), got {value}")
        return value

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        message = unknown_kind_message(value)
        if message is not None:
            raise ValueError(message)
        return value
