"""The ``prompt`` data kind: prompts to sample completions from, with the columns rewards read.

Why its own rows: a GRPO step samples its completions, so its data is not token sequences
to pack but prompts, each with whatever the reward functions need (the expected answer, a
format rule) kept as Python values. As TRL's ``GRPOTrainer`` does, a ``prompt`` that is text is
tokenized as text (the tokenizer's special tokens included) and one that is a list of messages
through the chat template with the generation prompt; every other column of the row is
handed to the reward functions under its own name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any

from scaletrain.data.sources import detect_format, resolve_paths
from scaletrain.errors import DataError


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One prompt: its ``prompt_ids``, the ``prompt`` as given (text or messages) and the other ``columns``."""

    prompt_ids: tuple[int, ...]
    prompt: Any
    columns: dict[str, Any]


def is_messages(value: Any) -> bool:
    """A list of ``{"role", "content"}`` messages (TRL's conversational format)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _records(source: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """``(record, where)`` of every row of ``source``: Python dicts, a Hugging Face dataset, JSONL, Parquet or CSV."""
    if isinstance(source, str):
        for path in resolve_paths(source):
            fmt = detect_format(path)
            if fmt == "jsonl":
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, start=1):
                        if line.strip():
                            try:
                                yield json.loads(line), f"{path} (line {number})"
                            except json.JSONDecodeError as exc:
                                raise DataError(f"{path} (line {number}): not valid JSON ({exc})") from None
            elif fmt in ("parquet", "csv"):
                import pyarrow.csv as pc
                import pyarrow.parquet as pq

                table = pq.read_table(path) if fmt == "parquet" else pc.read_csv(path)
                for number, record in enumerate(table.to_pylist(), start=1):
                    yield record, f"{path} (row {number})"
            else:
                raise DataError(f"data.source {path!r}: the prompt kind reads JSONL, Parquet or CSV rows, not {fmt}")
        return
    if hasattr(source, "column_names") and hasattr(source, "__getitem__"):  # a datasets.Dataset: its rows as dicts
        dataset = source
        source = (dataset[i] for i in range(len(dataset)))
    for number, record in enumerate(source, start=1):
        yield record, f"row {number}"


def tokenize_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """The ids of ``prompt`` as TRL's GRPO trainer makes them (chat template with the generation prompt
    for messages, plain tokenization for text)."""
    if is_messages(prompt):
        from scaletrain.data.chat_templates import apply_chat_template

        ids = apply_chat_template(tokenizer, prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def load_prompts(source: Any, tokenizer: Any, *, prompt_column: str = "prompt",
                 max_prompt_length: int | None = None, max_rows: int | None = None,
                 column_option: str | None = "data.prompt_column") -> list[PromptRow]:
    """Every row of ``source`` as a :class:`PromptRow`; a row without a usable ``prompt_column`` is a DataError
    naming where it is. ``max_prompt_length`` keeps a prompt's last tokens (TRL truncates on the left).
    ``column_option``: the setting that names the column, told to a user whose rows carry ``messages`` instead
    (None where there is none: then the message says to rename the column)."""
    out: list[PromptRow] = []
    rows: Iterable[tuple[dict[str, Any], str]] = _records(source)
    for record, where in rows:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a prompt row must be an object with a {prompt_column!r} column")
        prompt = record.get(prompt_column)
        if prompt is None and prompt_column != "messages" and is_messages(record.get("messages")):
            fix = (f"set {column_option}: messages to read them as the prompt" if column_option else
                   f"rename the column to {prompt_column!r}")
            raise DataError(f"{where}: no {prompt_column!r} column, but a 'messages' list (chat rows): {fix}; "
                            f"the chat template then adds the generation prompt after the last message")
        if not (isinstance(prompt, str) and prompt) and not is_messages(prompt):
            raise DataError(f"{where}: column {prompt_column!r} must be text or a list of messages, "
                            f"got {type(prompt).__name__} (the row has {sorted(record)})")
        ids = tokenize_prompt(tokenizer, prompt)
        if max_prompt_length is not None:
            ids = ids[-max_prompt_length:]
        out.append(PromptRow(tuple(ids), prompt, {k: v for k, v in record.items() if k != prompt_column}))
        if max_rows is not None and len(out) >= max_rows:
            break
    if not out:
        raise DataError(f"data.source {source if isinstance(source, str) else '(rows)'!r} holds no prompt rows")
    return out
