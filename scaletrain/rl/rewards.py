"""Reward functions: Python callables with TRL's signature, loaded by name, scored with the row named on failure.

A reward function is ``f(prompts, completions, **columns) -> list[float | None]``, one value per
completion, exactly as TRL's ``GRPOTrainer`` calls it: ``prompts`` and ``completions`` are text
(or, for a conversational prompt, lists of messages, the completion being
``[{"role": "assistant", "content": ...}]``), every other column of the prompt rows arrives
under its own name (repeated for each of a prompt's completions), plus ``completion_ids``.
``None`` means "not applicable to this row": that function is left out of the row's reward
(``scaletrain.rl.advantages`` sums with NaN skipped), and so is NaN. So a function written for TRL works here.
Anything else that is not a finite number (a string, ``inf``) stops the run with one line naming the
function and the row: ``inf`` is not a score of anything (it comes from a ``log(0)`` or a division by
zero) and would turn its whole group's advantages into NaN, so unlike NaN it is not quietly skipped.
Each call runs under a deadline (``reward_timeout``, :mod:`scaletrain.user_calls`): a call that does
not return in time scores its rows None and is counted (``rewards/<name>/timeouts``), and a signal
while waiting for one stops the step.

A recipe lists them under TRL's name ``reward_funcs``: ``"package.module:function"``, a
built-in's name (:data:`BUILTINS`), ``{function: <either>, <keyword>: <value>, ...}`` to
bind options (e.g. a built-in's ``pattern``), or ``{model: DIR}``, a reward model's folder
(:mod:`scaletrain.rl.reward_model`); ``reward_weights`` weighs them (default 1 each).
A ``module`` is looked for first in the recipe's folder, then in the working directory (as
``python script.py`` finds the modules beside it), then on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from scaletrain.errors import ConfigError, DataError
from scaletrain.user_calls import DeadlineExceeded, StopRequested, call_with_deadline, concurrently, invoke, is_async

logger = logging.getLogger("scaletrain")

RewardFn = Callable[..., Sequence[float | None]]


def message_text(messages: Any) -> str:
    """The text of a prompt or completion: itself, or the content of its last message."""
    if isinstance(messages, str):
        return messages
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(messages)


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its last **assistant** message. Why not the last
    message: a multi-turn completion that stops after a tool result or an environment's user turn (the model
    said nothing more) ends with text the model did not write, which must not count as its answer."""
    if isinstance(completion, list) and completion and all(isinstance(m, dict) for m in completion):
        replies = [m for m in completion if m.get("role", "assistant") == "assistant"]
        return message_text(replies[-1:] or [{"content": ""}])
    return message_text(completion)


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


def _module_folder(module: str, folders: Sequence[str]) -> str | None:
    """The first of ``folders`` that holds ``module``'s top package (``top.py`` or ``top/``), as ``python`` finds
    a script's neighbours."""
    top = module.partition(".")[0]
    for folder in folders:
        if os.path.isfile(os.path.join(folder, top + ".py")) or os.path.isdir(os.path.join(folder, top)):
            return os.path.abspath(folder)
    return None


def _import(module: str, folders: Sequence[str]) -> Any:
    """``module``, looked for first in ``folders`` (put on ``sys.path`` as ``python script.py`` puts the script's
    folder), then where Python looks."""
    folder = _module_folder(module, folders)
    if folder is not None and folder not in sys.path:
        sys.path.insert(0, folder)
        importlib.invalidate_caches()
    return importlib.import_module(module)


def _resolve(path: str, field: str, folders: Sequence[str] = ()) -> RewardFn:
    if path in BUILTINS:
        return BUILTINS[path]
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{field}={path!r}: name a built-in ({', '.join(BUILTINS)}) or a callable as "
                          f"'package.module:function'")
    folders = [*folders, os.getcwd()]
    try:
        fn = getattr(_import(module, folders), attr)
    except (ImportError, AttributeError) as exc:
        where = ", ".join(dict.fromkeys(os.path.abspath(f) for f in folders))
        raise ConfigError(f"{field}={path!r} cannot be loaded: {exc} (looked in {where}, then on sys.path)"
                          ) from None
    except Exception as exc:  # the module itself fails as it is imported
        raise ConfigError(f"{field}={path!r}: importing {module!r} raised {type(exc).__name__}: {exc}") from None
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


def load_reward(spec: Any, field: str = "reward_funcs[0]", folders: Sequence[str] = (),
                tokenizer: Any = None) -> RewardFunction:
    """A reward from a recipe entry (a name, ``{function: name, **options}``) or a callable; a
    ``module:function`` is looked for in ``folders`` (a recipe's folder), then the working directory,
    then on ``sys.path``."""
    if callable(spec):
        return RewardFunction(getattr(spec, "__name__", type(spec).__name__), spec)
    if isinstance(spec, str):
        fn = _resolve(spec, field, folders)
        return RewardFunction(getattr(fn, "__name__", spec.rpartition(":")[2]), fn)
    if isinstance(spec, Mapping) and "model" in spec:  # a reward model's folder (rl/reward_model.py)
        from scaletrain.rl.reward_model import ModelReward

        extra = sorted(set(spec) - {"model", "name"})
        if extra:
            raise ConfigError(f"{field}: a reward model entry takes model (and name), not {extra}")
        fn = ModelReward(spec["model"], field, tokenizer)
        return RewardFunction(str(spec.get("name", fn.__name__)), fn)
    if isinstance(spec, Mapping) and isinstance(spec.get("function"), str):
        options = {k: v for k, v in spec.items() if k != "function"}
        fn = _resolve(spec["function"], f"{field}.function", folders)
        name = str(options.pop("name", getattr(fn, "__name__", spec["function"])))
        return RewardFunction(name, functools.partial(fn, **options))
    raise ConfigError(f"{field}: expected 'module:function', a built-in name or {{function: ..., options}}, "
                      f"got {spec!r}")


def load_rewards(specs: Sequence[Any] | Any, weights: Sequence[float] | None = None, folders: Sequence[str] = (),
                 field: str = "reward_funcs", tokenizer: Any = None) -> tuple[list[RewardFunction], list[float]]:
    """The rewards and their weights (``reward_weights``; 1.0 each by default, one per function); ``folders``
    as for :func:`load_reward`; ``field``: the list's name in messages (a recipe's ``objective.reward_funcs``);
    ``tokenizer``: the policy's, which a reward model's must equal."""
    specs = list(specs) if isinstance(specs, (list, tuple)) else [specs]
    if not specs:
        raise ConfigError(f"{field}: list at least one reward function")
    funcs = [load_reward(s, f"{field}[{i}]", folders, tokenizer) for i, s in enumerate(specs)]
    if weights is None:
        return funcs, [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values but reward_funcs lists {len(funcs)} functions")
    return funcs, [float(w) for w in weights]


#: the default of ``reward_timeout`` (``objective.reward_timeout``): seconds one call may take
DEFAULT_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Scores:
    """``values``: [N, F] float32 rewards, NaN where a function returned None or timed out; ``timed_out``: [N, F]
    bool, the rows whose function's call did not return within the timeout (``rewards/<name>/timeouts``)."""

    values: np.ndarray
    timed_out: np.ndarray


def _call(func: RewardFunction, prompts: list[Any], completions: list[Any], columns: Mapping[str, list[Any]],
          timeout: float, stop_requested: Callable[[], str | None]) -> Sequence[float | None]:
    return call_with_deadline(invoke, func.fn, timeout=timeout, what=f"reward function {func.name!r}",
                              stop_requested=stop_requested, prompts=prompts, completions=completions, **columns)


def _attempt(func: RewardFunction, prompts: list[Any], completions: list[Any], columns: Mapping[str, list[Any]],
             timeout: float, stop_requested: Callable[[], str | None]) -> Any:
    """:func:`_call`'s values, or the exception it raised (handed back, so calls run at once are judged in order)."""
    try:
        return list(_call(func, prompts, completions, columns, timeout, stop_requested))
    except Exception as exc:
        return exc


def _failing_row(func: RewardFunction, prompts: list[Any], completions: list[Any],
                 columns: Mapping[str, list[Any]], timeout: float, stop_requested: Callable[[], str | None]
                 ) -> int | None:
    """The first row that raises on its own, to name it (None: only the whole batch fails, or a row's call
    timed out before one did)."""
    for i in range(len(prompts)):
        try:
            _call(func, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()},
                  timeout, stop_requested)
        except DeadlineExceeded:
            return None
        except StopRequested:
            raise
        except Exception:
            return i
    return None


def _rows_text(numbers: Sequence[int]) -> str:
    """Row numbers as a log names them: ``row 3``, ``rows 0-7`` when consecutive, else the list."""
    if len(numbers) == 1:
        return f"row {numbers[0]}"
    if list(numbers) == list(range(numbers[0], numbers[0] + len(numbers))):
        return f"rows {numbers[0]}-{numbers[-1]}"
    return "rows " + ", ".join(map(str, numbers))


def _row_text(prompts: list[Any], completions: list[Any], row: int) -> str:
    return f"prompt {message_text(prompts[row])[:80]!r}, completion {message_text(completions[row])[:80]!r}"


def _number(func: RewardFunction, value: Any, row: int, row_number: int, prompts: list[Any],
            completions: list[Any]) -> float:
    """``value`` as a reward: None and NaN are NaN (the row is left out, as TRL does); ``±inf``, or anything that
    is not a number (a string, even ``"1.0"``: TRL's ``torch.tensor`` refuses it too), is a DataError naming the
    function and the row. A number is whatever ``float()`` takes except text: Python's and NumPy's numbers, a
    0-d NumPy or JAX array."""
    if value is None:
        return math.nan
    number = None
    if not isinstance(value, (str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    where = f"for row {row_number} ({_row_text(prompts, completions, row)})"
    if number is None:
        raise DataError(f"reward function {func.name!r} returned {value!r} ({type(value).__name__}) {where}; "
                        f"return a number (float) or None per completion")
    if math.isinf(number):
        raise DataError(f"reward function {func.name!r} returned {number} {where}; return a finite number, or None "
                        f"for a row it does not score")
    return number


def score_calls(funcs: Sequence[RewardFunction], prompts: list[Any], completions: list[Any],
                columns: Mapping[str, list[Any]], rows: Sequence[int] | None = None, *,
                timeout: float = DEFAULT_TIMEOUT, stop_requested: Callable[[], str | None] | None = None) -> Scores:
    """The rewards of N completions by F functions, each call under ``timeout`` seconds (:class:`Scores`).

    A call past ``timeout`` scores its rows NaN (``None``) and is logged; a stop request
    (``stop_requested()`` returning a reason, checked while waiting) raises
    :class:`~scaletrain.user_calls.StopRequested`. A function that raises is a DataError naming it and the
    first row that raises alone (its prompt and completion), with the original error; one that returns
    the wrong number of values, a value that is not a number, or ±inf is named too, with the row.
    ``rows``: the rows' numbers in the whole batch, for those messages (default 0, 1, ...: a process
    scoring its own share of the rows passes theirs).
    """
    stop = stop_requested or (lambda: None)
    n = len(completions)
    out = np.full((n, len(funcs)), np.nan, np.float32)
    timed_out = np.zeros((n, len(funcs)), bool)
    numbers = list(range(n)) if rows is None else [int(r) for r in rows]
    # async def rewards run at once (TRL gathers them on its event loop), each in its own loop and thread
    together = [j for j, f in enumerate(funcs) if is_async(f.fn)]
    gathered = dict(zip(together, concurrently([functools.partial(_attempt, funcs[j], prompts, completions, columns,
                                                                   timeout, stop) for j in together])))
    for j, func in enumerate(funcs):
        values = gathered[j] if j in gathered else _attempt(func, prompts, completions, columns, timeout, stop)
        if isinstance(values, DeadlineExceeded):
            logger.warning("%s (objective.reward_timeout): its %d rows (%s) score None", values, n,
                           _rows_text(numbers))
            timed_out[:, j] = True
            continue
        if isinstance(values, StopRequested):
            raise values
        if isinstance(values, Exception):
            exc = values
            row = _failing_row(func, prompts, completions, columns, timeout, stop)
            where = "" if row is None else f" on row {numbers[row]} ({_row_text(prompts, completions, row)})"
            raise DataError(f"reward function {func.name!r} raised{where}: {type(exc).__name__}: {exc}") from exc
        if len(values) != n:
            raise DataError(f"reward function {func.name!r} returned {len(values)} rewards for {n} completions; "
                            f"it must return one per completion")
        out[:, j] = [_number(func, v, i, numbers[i], prompts, completions) for i, v in enumerate(values)]
    return Scores(out, timed_out)


def score(funcs: Sequence[RewardFunction], prompts: list[Any], completions: list[Any],
          columns: Mapping[str, list[Any]], rows: Sequence[int] | None = None, *,
          timeout: float = DEFAULT_TIMEOUT) -> np.ndarray:
    """[N, F] float32 rewards of N completions by F functions, NaN where a function returned None (or NaN, or its
    call timed out): :func:`score_calls`'s values."""
    return score_calls(funcs, prompts, completions, columns, rows, timeout=timeout).values
