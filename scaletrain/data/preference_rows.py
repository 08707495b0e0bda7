"""Preference rows in TRL's dataset formats: read several columns of a source, check each row.

Formats (TRL's names and defaults; the recipe's ``data.*_column`` keys rename them):

- paired (``kind: preference``): ``prompt`` / ``chosen`` / ``rejected``, each plain text or
  a list of ``{role, content}`` messages (conversational). Without a ``prompt`` column the
  prompt is implicit: the shared start of ``chosen`` and ``rejected`` (characters for
  text, whole messages for conversations), split off as TRL's ``extract_prompt`` does;
  An optional ``margin`` column (a number per pair, TRL's ``RewardTrainer``) is read beside them: a reward
  model's loss asks the chosen score to beat the rejected one by at least that much;
- unpaired (``kind: unpaired_preference``, KTO): ``prompt`` / ``completion`` / ``label``
  (true: desirable).

Why the columns are read one by one and zipped: every source reader streams one column
with its row numbers (:func:`scaletrain.data.sources.iter_source`), so the rows line up
by number whatever the format, and a row without a value says which column it lacks.
A row that cannot be used (a missing or empty value, ``chosen == rejected``, text mixed
with messages, a label that is not a boolean) is named with its file and row, or counted
and skipped with ``data.skip_bad_rows`` (:class:`~scaletrain.data.records.BadRows`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

from scaletrain.data.records import BadRows, Messages, check_message_items, describe_value
from scaletrain.data.sources import MissingColumnError, is_unreadable
from scaletrain.errors import DataError

Value = Union[str, Messages]
#: TRL's optional column of a pair's margin (``RewardTrainer``: ``-log σ(r_c - r_r - margin)``)
MARGIN_COLUMN = "margin"


@dataclass(frozen=True)
class PairExample:
    """One checked pair: text (``conversational`` False) or message lists (True) throughout."""

    prompt: Value
    chosen: Value
    rejected: Value
    conversational: bool
    origin: str
    row: int
    margin: float | None = None  # the ``margin`` column's value, when the source has one


@dataclass(frozen=True)
class UnpairedExample:
    """One checked KTO row: a prompt, a completion and whether the completion is desirable."""

    prompt: Value
    completion: Value
    label: bool
    conversational: bool
    origin: str
    row: int


def _messages(value: list[Any], column: str) -> Messages:
    """``value`` as checked messages (roles known, contents strings), or ValueError naming ``column``."""
    try:
        return check_message_items(value)
    except ValueError as err:
        raise ValueError(f"{column}: {err}") from None


def parse_value(value: Any, column: str) -> Value:
    """A cell as text or messages; ValueError naming ``column`` if it is neither.

    A string holding a JSON list of messages (a CSV cell) is read as messages; any other
    string is text.
    """
    problem = is_unreadable(value)
    if problem is not None:
        raise ValueError(problem)
    if value is None:
        raise ValueError(f"{column} has no value (null)")
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                return value
            if isinstance(parsed, list) and parsed and all(isinstance(m, dict) and "role" in m for m in parsed):
                return _messages(parsed, column)
        return value
    if isinstance(value, (list, tuple)):
        return _messages(list(value), column)
    raise ValueError(f"{column} must be text or a list of {{role, content}} messages, got {describe_value(value)}")


def _is_empty(value: Value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not value or all(not m["content"].strip() for m in value)


def split_shared_prompt(chosen: Value, rejected: Value) -> tuple[Value, Value, Value]:
    """``(prompt, chosen, rejected)`` with the prompt the shared start of both, as TRL's ``extract_prompt``.

    The prompt ends at the first character (text) or message (conversations) where they
    differ, before a space there (the space starts the completions). If one is a prefix
    of the other, the prompt is all but the last item of the shorter, as in TRL.
    """
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if cut is None:
        cut = n - 1
    elif cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


def check_pair(prompt: Any, chosen: Any, rejected: Any, columns: tuple[str, str, str], implicit: bool,
               origin: str, row: int) -> PairExample:
    """A :class:`PairExample`, or ValueError saying what is wrong with the row (naming the column)."""
    prompt_col, chosen_col, rejected_col = columns
    chosen, rejected = parse_value(chosen, chosen_col), parse_value(rejected, rejected_col)
    conversational = not isinstance(chosen, str)
    if conversational != (not isinstance(rejected, str)):
        raise ValueError(f"{chosen_col} and {rejected_col} must both be text or both be message lists")
    if chosen == rejected:
        raise ValueError(f"{chosen_col} and {rejected_col} are the same, so the pair prefers nothing")
    if implicit:
        prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
    else:
        prompt = parse_value(prompt, prompt_col)
        if conversational == isinstance(prompt, str):
            form = "message lists" if conversational else "text"
            raise ValueError(f"{prompt_col} must be {form} like {chosen_col} and {rejected_col}")
    for name, value in ((chosen_col, chosen), (rejected_col, rejected)):
        if _is_empty(value):
            raise ValueError(f"{name} is empty: there is no completion to learn from")
    return PairExample(prompt, chosen, rejected, conversational, origin, row)


def parse_margin(value: Any, column: str) -> float:
    """A pair's margin: a finite number (or its text); ValueError naming ``column`` otherwise."""
    problem = is_unreadable(value)
    if problem is not None:
        raise ValueError(problem)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{column} must be a finite number (how much the chosen reward should beat the rejected "
                         f"one by), got {describe_value(value)}")
    return float(value)


_LABELS = {"true": True, "false": False, "1": True, "0": False}


def parse_label(value: Any, column: str) -> bool:
    """A KTO label: a boolean, 0/1, or the text true/false/1/0; ValueError naming ``column`` otherwise."""
    problem = is_unreadable(value)
    if problem is not None:
        raise ValueError(problem)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _LABELS:
        return _LABELS[value.strip().lower()]
    raise ValueError(f"{column} must be true (desirable) or false (undesirable), got {describe_value(value)}")


def check_unpaired(prompt: Any, completion: Any, label: Any, columns: tuple[str, str, str],
                   origin: str, row: int) -> UnpairedExample:
    """An :class:`UnpairedExample`, or ValueError saying what is wrong with the row (naming the column)."""
    prompt_col, completion_col, label_col = columns
    prompt, completion = parse_value(prompt, prompt_col), parse_value(completion, completion_col)
    conversational = not isinstance(completion, str)
    if conversational == isinstance(prompt, str):
        raise ValueError(f"{prompt_col} and {completion_col} must both be text or both be message lists")
    if _is_empty(completion):
        raise ValueError(f"{completion_col} is empty: there is no completion to learn from")
    return UnpairedExample(prompt, completion, parse_label(label, label_col), conversational, origin, row)


def has_column(rows: Any, source: str, split: str, column: str) -> bool:
    """Whether ``source`` has ``column`` (its first row is read; other errors are raised)."""
    try:
        next(iter(rows(source, split, column=column)), None)
    except MissingColumnError:
        return False
    return True


def zip_columns(rows: Any, source: str, split: str, columns: tuple[str, ...], setting: str
                ) -> Iterator[tuple[tuple[Any, ...], str, int]]:
    """``(values, origin, row)`` with one value per column, read column by column in step.

    ``setting`` names the recipe keys that rename the columns, for the missing-column error.
    """
    try:
        readers = [iter(rows(source, split, column=c)) for c in columns]
        for cells in zip(*readers, strict=True):
            origin, row = cells[0].origin, cells[0].row
            if any((c.origin, c.row) != (origin, row) for c in cells):  # a reader skipped a row the others kept
                raise DataError(f"{origin}: row {row}: the columns {list(columns)} do not line up")
            yield tuple(c.value for c in cells), origin, row
    except MissingColumnError as exc:
        raise DataError(f"{str(exc).rsplit(' (', 1)[0]} (set {setting} to the source's column names)") from None
    except ValueError as exc:  # zip(strict=True): one column ended early
        if "zip()" not in str(exc):
            raise
        raise DataError(f"{source}: the columns {list(columns)} have different numbers of rows ({exc})") from None


def iter_pairs(rows: Any, source: str, split: str, data: Any, bad: BadRows, limit: int | None = None
               ) -> Iterator[PairExample]:
    """The checked pairs of ``source`` (implicit prompt when it has no ``data.prompt_column``), each with its
    :data:`MARGIN_COLUMN` value when the source has that column."""
    columns = (data.prompt_column, data.chosen_column, data.rejected_column)
    implicit = not has_column(rows, source, split, data.prompt_column)
    margins = has_column(rows, source, split, MARGIN_COLUMN)
    read = (columns[1:] if implicit else columns) + ((MARGIN_COLUMN,) if margins else ())
    n = 0
    for values, origin, row in zip_columns(rows, source, split, read,
                                           "data.prompt_column / chosen_column / rejected_column"):
        if limit is not None and n >= limit:
            return
        margin, values = (values[-1], values[:-1]) if margins else (None, values)
        prompt, chosen, rejected = (None, *values) if implicit else values
        try:
            example = check_pair(prompt, chosen, rejected, columns, implicit, origin, row)
            if margins:
                example = dataclasses.replace(example, margin=parse_margin(margin, MARGIN_COLUMN))
        except ValueError as exc:
            bad(origin, row, str(exc))
            continue
        n += 1
        yield example


def iter_unpaired(rows: Any, source: str, split: str, data: Any, bad: BadRows, limit: int | None = None
                  ) -> Iterator[UnpairedExample]:
    """The checked KTO rows of ``source``."""
    columns = (data.prompt_column, data.completion_column, data.label_column)
    n = 0
    for values, origin, row in zip_columns(rows, source, split, columns,
                                           "data.prompt_column / completion_column / label_column"):
        if limit is not None and n >= limit:
            return
        try:
            example = check_unpaired(*values, columns, origin, row)
        except ValueError as exc:
            bad(origin, row, str(exc))
            continue
        n += 1
        yield example
