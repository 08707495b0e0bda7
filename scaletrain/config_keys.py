"""The keys of a config: unknown names get a "did you mean", refused names their reason.

Why one module at the bottom layer: ``PartitionAxis`` (parallel/), ``TrainingArguments``
(arguments.py) and the model configs all accept other tools' names (EasyDeL, eformer,
Hugging Face) and must report the rest alike. A problem is raised as a pydantic
``ValidationError`` located at the key, so a nested config (a recipe's ``training``
section) reports its whole path (``training.max_steps``); direct construction turns it
into :class:`InvalidConfig` with :func:`format_validation_error`.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from scaletrain.errors import ConfigError

# error type of the problems built here: printed as written, without the offending value
KEY_ERROR = "config_key"


class InvalidConfig(ConfigError, ValueError):
    """A config object was built with a bad key or value.

    A ``ConfigError`` (the CLI prints it as one line, docs/api.md promises it) and a
    ``ValueError`` like pydantic's ``ValidationError`` it replaces, so callers that
    caught that keep working.
    """


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the close matches of ``key`` in ``valid`` ('' if none)."""
    close = difflib.get_close_matches(key, sorted(valid), n=3, cutoff=0.6)
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""


def unknown_key_message(key: str, valid: Iterable[str], list_valid: bool = True) -> str:
    """``unknown key; did you mean …`` and, if asked or nothing is close, the valid names."""
    valid = sorted(valid)
    hint = did_you_mean(key, valid)
    listing = f" (valid keys: {', '.join(valid)})" if list_valid or not hint else ""
    return f"unknown key{hint}{listing}"


def key_errors(title: str, problems: list[tuple[str, str, Any]],
               others: ValidationError | None = None) -> ValidationError:
    """A ``ValidationError`` with one ``(key, message, value)`` problem per line, each located at its key.

    Raised from a ``mode="before"`` model validator, pydantic keeps the locations (and
    prefixes the outer ones when the model is nested). ``others``: the errors of the
    remaining keys, reported alongside so one run shows every problem.
    """
    details = [
        InitErrorDetails(type=PydanticCustomError(KEY_ERROR, "{message}", {"message": message}),
                         loc=(key,), input=value)
        for key, message, value in problems
    ]
    for e in others.errors() if others is not None else ():
        details.append(InitErrorDetails(type=PydanticCustomError("value_error", "{message}", {"message": e["msg"]}),
                                        loc=e["loc"], input=e.get("input")))
    return ValidationError.from_exception_data(title, details)


def format_validation_error(err: ValidationError, where: str, model: type[BaseModel] | None = None) -> str:
    """One line per problem: ``where.key: what is wrong (got value)``."""
    return "\n".join(text for _, text in problem_lines(err, where, model))


def problem_lines(err: ValidationError, where: str, model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """``(dotted key path, line)`` per problem. With the validated ``model``, an unknown key gets a "did you mean"
    from the keys valid at its place (a misspelled recipe section, ``mesh.axis_dim``)."""
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        key = ".".join(x for x in (where, path) if x) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            valid = _keys_at(model, e["loc"][:-1]) if model is not None else None
            msg = "unknown key" + (did_you_mean(str(e["loc"][-1]), valid) if valid else "")
        got = e.get("input")
        quiet = e["type"] in ("extra_forbidden", "missing", KEY_ERROR) or isinstance(got, dict)
        shown = "" if quiet else f" (got {got!r})"
        if msg.startswith(f"{key}."):  # a nested validator already named the full key path: don't repeat it
            out.extend(_named_lines(f"{msg}{shown}", path, where))
        else:
            out.append((path, f"{key}: {msg}{shown}"))
    return out


def _named_lines(msg: str, path: str, where: str) -> list[tuple[str, str]]:
    """``(dotted key path, line)`` per line of a nested validator's message, each located at the key it names.

    Why: the objective section validates its options itself and reports every bad option in one
    message located at ``objective``; a command-line override must be matched against the key a
    line names (``objective.generation_batch_size``), not the section, or another override of the
    section gets the blame.
    """
    out = []
    for line in msg.splitlines():
        named = line.split(":", 1)[0] if ":" in line else ""
        rel = named.removeprefix(f"{where}.") if where else named
        inside = " " not in named and (rel == path or rel.startswith(f"{path}.") or not path)
        out.append((rel if inside else path, line))
    return out


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The field names of the (nested) model found at ``loc`` under ``model``; None past a non-model field."""
    cls: Any = model
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        options = typing.get_args(field.annotation) or (field.annotation,)
        cls = next((t for t in options if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if cls is None:
            return None
    return list(cls.model_fields)


def raise_invalid(err: ValidationError, where: str) -> None:
    """Re-raise pydantic's error as :class:`InvalidConfig` (one line per problem, no traceback chain)."""
    raise InvalidConfig(format_validation_error(err, where)) from None


class ConfigModel(BaseModel):
    """A pydantic model whose direct construction raises :class:`InvalidConfig`, not ``ValidationError``.

    Why the flag: nested inside another model (a recipe section, a model config's
    ``partition_axis``) pydantic then validates without this ``__init__``, so the outer
    error keeps the full key path (``training.key``, ``model.partition_axis.key``). It is
    a pydantic 2 internal (checked on 2.14): recheck it when upgrading pydantic.
    """

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise_invalid(err, type(self).__name__)

    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]
