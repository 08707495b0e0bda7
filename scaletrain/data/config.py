"""The recipe's ``data`` section: where the data comes from, what kind it is, how it is split.

Why it lives in the data layer: :func:`scaletrain.data.build.build_datasets` takes this
section, and the data layer may not import :mod:`scaletrain.recipe` (imports run
``recipe -> data``, never back). The recipe composes it as ``Recipe.data``, so
validation errors still read ``<file>: data.<key>: ...``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scaletrain.data.kinds import unknown_kind_message

#: the data kinds a mixture can hold: both give packed language-model rows the same objective trains on
MIXABLE_KINDS = ("pretrain", "chat")


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
    # whose row preparation: TRL's DPOTrainer/KTOTrainer (trl_dpo) or its ORPOTrainer/CPOTrainer (trl_orpo);
    # None: the objective's own TRL trainer's (the recipe fills it in: trl_orpo for orpo, cpo and simpo)
    preparation: Literal["trl_dpo", "trl_orpo"] | None = None
    # bad rows and speed
    skip_bad_rows: bool = False
    num_workers: int = Field(0, ge=0)  # tokenizer worker processes (0: in the main process)
    # a weighted (optionally staged) mixture of sources instead of the one above; the keys set beside it
    # are every entry's defaults (see docs/data.md, "Mixtures")
    mixture: list[MixtureSource] | None = None

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

    @model_validator(mode="before")
    @classmethod
    def _defaults_into_mixture(cls, values: Any) -> Any:
        """Keys set beside ``mixture`` are the defaults of every entry (an entry's own keys win)."""
        if isinstance(values, dict) and isinstance(values.get("mixture"), list):
            shared = {k: v for k, v in values.items() if k != "mixture"}
            mixture = [{**shared, **e} if isinstance(e, dict) else e for e in values["mixture"]]
            values = {**values, "mixture": mixture}
        return values

    @model_validator(mode="after")
    def _valid_mixture(self) -> DataSection:
        if self.mixture is None:
            return self
        if not self.mixture:
            raise ValueError("data.mixture: list at least one source (or leave mixture out)")
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.mixture):
            if entry.name in seen:
                raise ValueError(f"data.mixture.{i}.name: {entry.name!r} is also the name of data.mixture."
                                 f"{seen[entry.name]}; give each source its own name")
            seen[entry.name] = i
        stages = [_stages(e.weight) for e in self.mixture]
        for start in sorted({0, *(step for st in stages for step, _ in st)}):
            if not any(_weight_at(st, start) > 0 for st in stages):
                raise ValueError(f"data.mixture: no source has a positive weight at step {start}; every stage "
                                 "needs one (a source's weight is 0 before its first step)")
        return self


def _stages(weight: float | dict[int, float]) -> list[tuple[int, float]]:
    return sorted(weight.items()) if isinstance(weight, dict) else [(0, float(weight))]


def _weight_at(stages: list[tuple[int, float]], step: int) -> float:
    return next((w for first, w in reversed(stages) if first <= step), 0.0)


def _name_of(source: str) -> str:
    """A metric-friendly name for a source: ``bundled:shakespeare`` -> shakespeare, ``a/chat.jsonl.gz`` -> chat."""
    base = os.path.basename(source.rstrip("/").split(":", 1)[-1]) or source
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base.split(".")[0]) or "source"


class MixtureSource(DataSection):
    """One entry of ``data.mixture``: a source like ``data`` itself, plus its name, weight and exhaustion policy.

    ``weight`` is the source's share of the training *tokens* (normalised over the sources): a
    number, or ``{step: weight}`` for a staged mixture (the weight from batch ``step`` on, i.e.
    after ``step`` steps; 0 before the source's first step).
    """

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")  # default: from the source (file name)
    weight: float | dict[int, float]
    on_exhausted: Literal["repeat", "stop"] = "repeat"  # a source read whole: a new shuffled pass, or the data ends

    @field_validator("weight")
    @classmethod
    def _positive(cls, value: float | dict[int, float]) -> float | dict[int, float]:
        if isinstance(value, dict):
            if not value:
                raise ValueError("a staged weight needs at least one {step: weight}")
            if any(step < 0 for step in value):
                raise ValueError(f"the steps of a staged weight must be >= 0, got {sorted(value)}")
            if any(not w >= 0 for w in value.values()) or not any(w > 0 for w in value.values()):
                raise ValueError("weights must be >= 0 in every stage and positive in one")
        elif not value > 0 or value == float("inf"):
            raise ValueError("a weight must be positive")
        return value

    @field_validator("kind")
    @classmethod
    def _mixable(cls, value: str) -> str:
        if value not in MIXABLE_KINDS:
            raise ValueError(f"a mixture holds the kinds {', '.join(MIXABLE_KINDS)} (language-model rows); "
                             f"{value!r} cannot be mixed with them")
        return value

    @field_validator("mixture")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("a mixture's entry cannot itself be a mixture")
        return value

    @model_validator(mode="after")
    def _named(self) -> MixtureSource:
        if self.name is None:
            self.name = _name_of(self.source)
        return self


DataSection.model_rebuild()
