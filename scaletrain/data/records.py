"""Checking rows: what a text row and a conversation must look like, and the bad-row policy.

Why separate from reading: a source only knows where a cell came from; whether the
cell is usable depends on the kind of training. Every rejection names the file and
row, and either stops the run (the default: bad data should be fixed, not silently
trained around) or, with ``data.skip_bad_rows: true``, is counted and reported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from scaletrain.data.sources import SourceRow, is_unreadable
from scaletrain.errors import DataError

logger = logging.getLogger(__name__)

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
Messages = list[dict[str, Any]]


class BadRows:
    """Raise on a bad row, or (``skip=True``) count it and keep the first few messages."""

    def __init__(self, skip: bool = False, keep: int = 5):
        self.skip = skip
        self.count = 0
        self.examples: list[str] = []
        self._keep = keep

    def __call__(self, origin: str, row: int, problem: str) -> None:
        message = f"{origin}: row {row}: {problem}"
        if not self.skip:
            raise DataError(f"{message} (fix the row, or set data.skip_bad_rows: true to skip bad rows)")
        self.count += 1
        if len(self.examples) < self._keep:
            self.examples.append(message)

    def report(self) -> None:
        if self.count:
            logger.warning("skipped %d bad rows, e.g.:\n  %s", self.count, "\n  ".join(self.examples))


def iter_texts(rows: Iterable[SourceRow], bad: BadRows, limit: int | None = None) -> Iterator[str]:
    """Non-blank text documents; a non-string cell is a bad row. Stops after ``limit`` documents."""
    n = 0
    for value, origin, row in rows:
        if limit is not None and n >= limit:
            return
        problem = is_unreadable(value)
        if problem is None and not isinstance(value, str):
            problem = f"expected text, got {describe_value(value)}"
        if problem is not None:
            bad(origin, row, problem)
            continue
        if value.strip():
            n += 1
            yield value


def check_messages(value: Any) -> Messages:
    """``value`` as a list of ``{"role", "content", ...}`` dicts, or ValueError saying what is wrong.

    A JSON string (a CSV cell) is parsed first. Roles must be one of :data:`ROLES`
    and contents strings; other keys (``name``, ``tool_calls`` ...) pass through to
    the chat template.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"messages is a string but not JSON ({exc})") from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"messages must be a list of {{role, content}} objects, got {describe_value(value)}")
    if not value:
        raise ValueError("the conversation has no messages")
    messages = check_message_items(value)
    if messages[-1]["role"] == "user":  # nothing answers it: its tokens would be input to no reply, counted nowhere
        raise ValueError(f"the conversation ends with a user turn (message {len(messages) - 1}) that no assistant "
                         "turn answers; end it with the assistant's reply or drop that turn")
    return messages


def check_message_items(value: Sequence[Any]) -> Messages:
    """Each of ``value``'s items as a message (a dict with a known role and string content; null keys
    dropped), or ValueError naming the first bad one. What a whole conversation must be besides
    (non-empty, not ending on a user turn) is :func:`check_messages`'; a preference prompt, which
    does end on a user turn, is checked item by item with this alone."""
    messages: Messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {describe_value(message)}, not an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has unknown role {role!r}; known roles: {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) has content of type {type(content).__name__}, expected a string")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def iter_conversations(
    rows: Iterable[SourceRow], bad: BadRows, limit: int | None = None
) -> Iterator[tuple[Messages, str, int]]:
    """``(messages, origin, row)`` for every valid conversation; invalid ones go to ``bad``."""
    n = 0
    for value, origin, row in rows:
        if limit is not None and n >= limit:
            return
        problem = is_unreadable(value)
        if problem is not None:
            bad(origin, row, problem)
            continue
        try:
            messages = check_messages(value)
        except ValueError as exc:
            bad(origin, row, str(exc))
            continue
        n += 1
        yield messages, origin, row


def describe_value(value: Any) -> str:
    """A bad value in an error message: its type and the start of its repr (a row may hold a whole document)."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
