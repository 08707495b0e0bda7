"""Reward functions: Python callables with TRL's signature, loaded by name, scored with the row named on failure.

A reward function is ``f(prompts, completions, **columns) -> list[float | None]``, one value per
completion, exactly as TRL's ``GRPOTrainer`` calls it: ``prompts`` and ``completions`` are text
(or, for a conversational prompt, lists of messages, the completion being
``[{"role": "assistant", "content": ...}]``), every other column of the prompt rows arrives
under its own name (repeated for each of a prompt's completions), plus ``completion_ids``.
``None`` means "not applicable to this row": that function is left out of the row's reward
(``scaletrain.rl.advantages`` sums with NaN skipped). So a function written for TRL works here.

A recipe lists them under TRL's name ``reward_funcs``: ``"package.module:function"``, a
built-in's name (:data:`BUILTINS`), or ``{function: <either>, <keyword>: <value>, ...}`` to
bind options (e.g. a built-in's ``pattern``); ``reward_weights`` weighs them (default 1 each).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from scaletrain.errors import ConfigError, DataError

RewardFn = Callable[..., Sequence[float | None]]


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The final answer a completion states: the last ``\\boxed{...}``, else the last ``<answer>...</answer>``,
    else what follows the last ``####``, else the last number, else the whole text (stripped)."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"<answer>(.*?)</answer>"):
        found = re.findall(pattern, text, flags=re.DOTALL)
        if found:
            return found[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _normal(answer: Any) -> str:
    text = str(answer).strip().rstrip(".").strip().lower()
    number = text.replace(",", "").replace("$", "")
    try:
        value = float(number)
    except ValueError:
        return text
    return repr(int(value)) if value.is_integer() else repr(value)


def exact_answer(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                 **columns: Any) -> list[float | None]:
    """1.0 where the completion's :func:`final_answer` equals the ``answer`` column (numbers compared as
    numbers: ``"1,000"`` = ``"1000.0"``), else 0.0; None for a row without an answer."""
    if answer is None:
        raise ValueError("exact_answer needs an 'answer' column in the prompt rows")
    return [None if a is None else float(_normal(final_answer(completion_text(c))) == _normal(a))
            for c, a in zip(completions, answer)]


DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_regex(prompts: Sequence[Any], completions: Sequence[Any], pattern: str = DEFAULT_FORMAT,
                 **columns: Any) -> list[float | None]:
    """1.0 where the whole completion (stripped) matches ``pattern`` (dot matches newlines), else 0.0."""
    compiled = re.compile(pattern, flags=re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]


BUILTINS: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_regex": format_regex}


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A loaded reward: ``name`` (in figures: ``rewards/<name>/mean``) and the callable."""

    name: str
    fn: RewardFn


def _resolve(path: str, field: str) -> RewardFn:
    if path in BUILTINS:
        return BUILTINS[path]
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{field}={path!r}: name a built-in ({', '.join(BUILTINS)}) or a callable as "
                          f"'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{field}={path!r} cannot be loaded: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"{field}={path!r} is not callable")
    return fn


def recorded_spec(spec: Any) -> Any:
    """A ``reward_funcs`` entry as checkpoints record it (a resume compares them): a name or
    ``{function, **options}`` as written, a callable as ``module:qualname``. Why not the loaded name alone:
    ``{function: format_regex, pattern: ...}`` with another pattern is another reward under the same name."""
    if isinstance(spec, (str, Mapping)):
        return json.loads(json.dumps(spec, default=str))
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', type(spec).__name__)}"


def load_reward(spec: Any, field: str = "reward_funcs[0]") -> RewardFunction:
    """A reward from a recipe entry (a name, ``{function: name, **options}``) or a callable."""
    if callable(spec):
        return RewardFunction(getattr(spec, "__name__", type(spec).__name__), spec)
    if isinstance(spec, str):
        fn = _resolve(spec, field)
        return RewardFunction(getattr(fn, "__name__", spec.rpartition(":")[2]), fn)
    if isinstance(spec, Mapping) and isinstance(spec.get("function"), str):
        options = {k: v for k, v in spec.items() if k != "function"}
        fn = _resolve(spec["function"], f"{field}.function")
        name = str(options.pop("name", getattr(fn, "__name__", spec["function"])))
        return RewardFunction(name, functools.partial(fn, **options))
    raise ConfigError(f"{field}: expected 'module:function', a built-in name or {{function: ..., options}}, "
                      f"got {spec!r}")


def load_rewards(specs: Sequence[Any] | Any, weights: Sequence[float] | None = None
                 ) -> tuple[list[RewardFunction], list[float]]:
    """The rewards and their weights (``reward_weights``; 1.0 each by default, one per function)."""
    specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    if not specs:
        raise ConfigError("reward_funcs: list at least one reward function")
    funcs = [load_reward(s, f"reward_funcs[{i}]") for i, s in enumerate(specs)]
    if weights is None:
        return funcs, [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values but reward_funcs lists {len(funcs)} functions")
    return funcs, [float(w) for w in weights]


def _call(func: RewardFunction, prompts: list[Any], completions: list[Any], columns: Mapping[str, list[Any]],
          ) -> Sequence[float | None]:
    return func.fn(prompts=prompts, completions=completions, **columns)


def _failing_row(func: RewardFunction, prompts: list[Any], completions: list[Any],
                 columns: Mapping[str, list[Any]]) -> int | None:
    """The first row that raises on its own, to name it (None: only the whole batch fails)."""
    for i in range(len(prompts)):
        try:
            _call(func, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()})
        except Exception:
            return i
    return None


def score(funcs: Sequence[RewardFunction], prompts: list[Any], completions: list[Any],
          columns: Mapping[str, list[Any]], rows: Sequence[int] | None = None) -> np.ndarray:
    """[N, F] float32 rewards of N completions by F functions, NaN where a function returned None.

    A function that raises is a DataError naming it and the first row that raises alone (its
    prompt and completion), with the original error; one that returns the wrong number of values
    is named too. ``rows``: the rows' numbers in the whole batch, for that message (default 0, 1, ...: a
    process scoring its own share of the rows passes theirs).
    """
    n = len(completions)
    out = np.full((n, len(funcs)), np.nan, np.float32)
    for j, func in enumerate(funcs):
        try:
            values = list(_call(func, prompts, completions, columns))
        except Exception as exc:
            row = _failing_row(func, prompts, completions, columns)
            number = row if row is None or rows is None else int(rows[row])
            where = "" if row is None else (f" on row {number} (prompt {completion_text(prompts[row])[:80]!r}, "
                                            f"completion {completion_text(completions[row])[:80]!r})")
            raise DataError(f"reward function {func.name!r} raised{where}: {type(exc).__name__}: {exc}") from exc
        if len(values) != n:
            raise DataError(f"reward function {func.name!r} returned {len(values)} rewards for {n} completions; "
                            f"it must return one per completion")
        out[:, j] = [np.nan if v is None else float(v) for v in values]
    return out
