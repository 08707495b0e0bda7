"""Rendering a chat template, with a template the sandbox refuses told apart from a bad data row.

Why: Transformers renders chat templates in jinja2's immutable sandbox, which refuses
changing the messages (``messages.append``, ``m.update``), private attributes and the like
with a ``SecurityError``. That is a property of the template, the same on every row, but the
data builders reported it as "row 1: the chat template failed on this conversation" (and
``skip_bad_rows`` would skip every row for it). :func:`apply_chat_template` raises it as one
:class:`~scaletrain.errors.DataError` naming the template (``data.chat_template`` or the
tokenizer's own) and what to change; any other failure is left to the caller, which names
the row.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.errors import DataError

#: where a tokenizer's template came from, when scaletrain set it (``data.chat_template``)
_ORIGIN = "_scaletrain_chat_template_origin"


def set_chat_template(tokenizer: Any, template: str, origin: str) -> None:
    """Put ``template`` on ``tokenizer`` (a saved checkpoint then carries it), remembering ``origin`` for messages."""
    tokenizer.chat_template = template
    setattr(tokenizer, _ORIGIN, origin)


def template_origin(tokenizer: Any) -> str:
    """``data.chat_template (FILE)`` when the recipe set the template, else the tokenizer's folder or name."""
    origin = getattr(tokenizer, _ORIGIN, None)
    if origin:
        return origin
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"the tokenizer's ({name})"


def sandbox_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is jinja2's sandbox refusing an operation of the template (not a problem of the data)."""
    try:
        from jinja2.exceptions import SecurityError
    except ImportError:  # pragma: no cover - transformers needs jinja2 to render templates at all
        return False
    return isinstance(exc, SecurityError)


def sandbox_error(tokenizer: Any, exc: BaseException) -> DataError:
    """The one-line error for a template the sandbox refused."""
    return DataError(
        f"chat template {template_origin(tokenizer)}: Transformers' template sandbox refuses what it does ({exc}); "
        "this is the template, not the data: rewrite that part (the sandbox allows no changes to messages or "
        "their dicts, e.g. .append / .update, and no private attributes; use namespace() for state) and give the "
        "fixed template as data.chat_template (Jinja text or a .jinja file)")


def apply_chat_template(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(*args, **kwargs)``; a sandbox refusal raised as :func:`sandbox_error`."""
    try:
        return tokenizer.apply_chat_template(*args, **kwargs)
    except Exception as exc:
        if sandbox_refused(exc):
            raise sandbox_error(tokenizer, exc) from None
        raise


def origin_of_setting(value: str) -> str:
    """How ``data.chat_template: value`` is named in messages: its file, or "inline" for Jinja text."""
    return f"data.chat_template ({os.path.expanduser(value)})" if "{" not in value else "data.chat_template (inline)"
