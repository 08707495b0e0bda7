"""Data kinds: what a recipe's ``data.kind`` names, each a way from source rows to training rows.

Why a registry rather than a ``Literal`` and branches: each new objective brings data of
its own shape (preference pairs, prompts for rollouts), and adding one should be one
:func:`register_data_kind` call beside its builder, not an edit of the config, the
builder and the pre-launch checks. ``data.kind`` is validated against this table, so an
unknown kind is one error naming the field and the known kinds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from scaletrain.data.records import BadRows, iter_conversations, iter_texts
from scaletrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from scaletrain.data.splits import LMSplits

#: the recipe's data section (:class:`scaletrain.data.config.DataSection`, which validates ``kind``
#: against this registry, so it is not imported here)
DataSection = Any

#: ``rows(source, split[, column])``: the kind's column (or another named one) of a source's rows, streamed
Rows = Callable[..., Iterator[Any]]


@dataclasses.dataclass(frozen=True)
class DataKind:
    """One ``data.kind``: the column it reads, whether plain-text files can hold it, and its builder.

    ``build(data, rows, tokenizer, bad, max_length=, seed=, truncation_mode=)`` reads
    ``data.source`` (and ``data.eval_source``) through ``rows``, applies the bad-row
    policy ``bad``, and returns the packed train and eval rows.
    """

    name: str
    column: Callable[[DataSection], str]
    build: Callable[..., LMSplits]
    text_files: bool = True
    #: the ``training.truncation_mode`` a recipe that leaves it unset gets for this kind (None: the training
    #: default, ``keep_end``): the preference kinds keep the start, as TRL 1.16's trainers do
    truncation_mode: str | None = None


DATA_KINDS: dict[str, DataKind] = {}


def register_data_kind(kind: DataKind) -> DataKind:
    """Make ``kind`` a valid ``data.kind`` (a name registered twice is a programming error)."""
    if kind.name in DATA_KINDS:
        raise ValueError(f"data kind {kind.name!r} is already registered")
    DATA_KINDS[kind.name] = kind
    return kind


def unknown_kind_message(name: str) -> str | None:
    """None if ``name`` is a registered kind, else the message that names the known kinds."""
    if name in DATA_KINDS:
        return None
    return f"unknown data kind {name!r}; the known kinds are {', '.join(sorted(DATA_KINDS))}"


def data_kind(name: str) -> DataKind:
    """The registered kind ``name``; DataError naming ``data.kind`` and the known kinds otherwise."""
    message = unknown_kind_message(name)
    if message is not None:
        raise DataError(f"data.kind: {message}")
    return DATA_KINDS[name]


def load_chat_template(value: str) -> str:
    """``data.chat_template``: the template text itself, or the path of a file holding it."""
    path = os.path.expanduser(value)
    if "{" not in value and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise DataError(f"data.chat_template: {value!r} is neither a Jinja template nor an existing file")
    return value


def _eval_rows(data: DataSection, rows: Rows) -> Iterator[Any] | None:
    return rows(data.eval_source, data.eval_split) if data.eval_source else None


def _build_pretrain(data: DataSection, rows: Rows, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                    truncation_mode: str) -> LMSplits:
    """Documents packed with eos (``truncation_mode`` is the chat kind's)."""
    from scaletrain.data.splits import build_lm_splits

    held = _eval_rows(data, rows)
    return build_lm_splits(
        iter_texts(rows(data.source, data.split), bad, data.max_documents),
        tokenizer, max_length, eval_fraction=data.eval_fraction, seed=seed,
        eval_texts=None if held is None else iter_texts(held, bad),
        name=f"data.source {data.source!r}", num_workers=data.num_workers,
    )


def _build_chat(data: DataSection, rows: Rows, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                truncation_mode: str) -> LMSplits:
    """One conversation per segment, with a loss mask over the assistant turns."""
    from scaletrain.data.chat import build_chat_splits

    _set_chat_template(data, tokenizer)  # so a saved checkpoint carries the template it was trained with
    held = _eval_rows(data, rows)
    return build_chat_splits(
        iter_conversations(rows(data.source, data.split), bad, data.max_documents),
        tokenizer, max_length, eval_fraction=data.eval_fraction, seed=seed,
        eval_conversations=None if held is None else iter_conversations(held, bad),
        assistant_only_loss=data.assistant_only_loss, truncation_mode=truncation_mode,  # type: ignore[arg-type]
        allow_split=data.allow_split, name=f"data.source {data.source!r}", num_workers=data.num_workers,
    )


def _set_chat_template(data: DataSection, tokenizer: Any) -> None:
    """``data.chat_template`` on the tokenizer, so a saved checkpoint carries the template it was trained with."""
    from scaletrain.data.chat_templates import origin_of_setting, set_chat_template

    if data.chat_template:
        set_chat_template(tokenizer, load_chat_template(data.chat_template), origin_of_setting(data.chat_template))


def _build_preference(data: DataSection, rows: Rows, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                      truncation_mode: str) -> LMSplits:
    """Pairs (prompt / chosen / rejected) as TRL's DPOTrainer prepares them (or its ORPO/CPO trainers, with
    ``data.preparation: trl_orpo``, which a recipe of those objectives gets by default), one pair per row."""
    from scaletrain.data.preference import build_preference
    from scaletrain.data.preference_legacy import OrpoPairEncoder

    _set_chat_template(data, tokenizer)
    encoder = None
    if data.preparation == "trl_orpo":  # None (no objective said): DPOTrainer's
        encoder = OrpoPairEncoder(tokenizer, max_length, "keep_start", data.max_prompt_length)
    return build_preference(data, rows, tokenizer, bad, max_length=max_length, seed=seed,
                            truncation_mode=truncation_mode, paired=True, encoder=encoder)


def _build_unpaired(data: DataSection, rows: Rows, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                    truncation_mode: str) -> LMSplits:
    """KTO rows (prompt / completion / label) as TRL's KTOTrainer prepares them, with their KL rows."""
    from scaletrain.data.preference import build_preference

    if data.preparation not in (None, "trl_dpo"):
        raise ConfigError(f"data.preparation: {data.preparation} is for kind: preference; KTO rows are prepared as "
                          "TRL's KTOTrainer does (data.preparation: trl_dpo)")

    _set_chat_template(data, tokenizer)
    return build_preference(data, rows, tokenizer, bad, max_length=max_length, seed=seed,
                            truncation_mode=truncation_mode, paired=False)


register_data_kind(DataKind("pretrain", column=lambda d: d.text_column, build=_build_pretrain))
register_data_kind(DataKind("chat", column=lambda d: d.messages_column, build=_build_chat, text_files=False))
register_data_kind(DataKind("preference", column=lambda d: d.chosen_column, build=_build_preference,
                            text_files=False, truncation_mode="keep_start"))
register_data_kind(DataKind("unpaired_preference", column=lambda d: d.completion_column, build=_build_unpaired,
                            text_files=False, truncation_mode="keep_start"))


def _build_prompt(data: DataSection, rows: Rows, tokenizer: Any, bad: BadRows, *, max_length: int, seed: int,
                  truncation_mode: str) -> LMSplits:
    """Prompts to sample from (``scaletrain.data.prompts``): ``train`` holds :class:`PromptRow` s, not token rows;
    only a sampling objective (``objective.type: grpo``) reads them."""
    from scaletrain.data.prompts import load_prompts
    from scaletrain.data.splits import LMSplits
    from scaletrain.data.table import FixedRows

    if data.eval_source:
        raise DataError("data.eval_source: the prompt kind has no evaluation split (GRPO logs its reward figures "
                        "every step); drop eval_source")
    _set_chat_template(data, tokenizer)
    prompts = load_prompts(data.source, tokenizer, prompt_column=data.prompt_column,
                           max_prompt_length=data.max_prompt_length, max_rows=data.max_documents)
    empty = FixedRows({"input_ids": np.zeros((0, 1), np.int32)})
    return LMSplits(train=prompts, eval=empty, eval_bytes_per_token=float("nan"),  # type: ignore[arg-type]
                    stats={"prompts": len(prompts), "prompt_tokens_max": max(len(p.prompt_ids) for p in prompts)})


register_data_kind(DataKind("prompt", column=lambda d: d.prompt_column, build=_build_prompt, text_files=False))
