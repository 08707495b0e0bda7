"""Tools a model may call during a rollout: their JSON schemas, one row's toolbox, and the calls run under a deadline.

Why a module of its own: TRL 1.16's contract (``GRPOTrainer(tools=..., environment_factory=...)``) is that a tool
is a plain callable with type hints and a docstring, shown to the model through the chat template as the JSON
schema transformers derives from it (``transformers.utils.get_json_schema``), and that an environment's public
methods are tools bound to that rollout's instance. Running them is user code: every call here is bounded by
``tool_timeout`` (:func:`scaletrain.user_calls.call_with_deadline`), the calls of different rows run at the
same time on a thread pool (``async def`` tools too, each in its own event loop), and a tool that raises or
does not return in time gives the model its error text and counts as a failure, with the tool and the row
named in the log. A hung tool never hangs the run: its thread is abandoned as the user-call module says.

The text a tool's result becomes is TRL's: ``str(result)``, and for a failure ``str({"error": message})``,
so the trajectories compare token for token with TRL's.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scaletrain.user_calls import DeadlineExceeded, call_with_deadline, concurrently, invoke

logger = logging.getLogger("scaletrain")

#: the default of ``tool_timeout`` (``objective.tool_timeout``): seconds one tool call may take
DEFAULT_TOOL_TIMEOUT = 60.0
#: methods of an environment that are not tools (TRL's rule: these, and every name starting with ``_``)
NOT_TOOLS = ("reset", "get_reward", "step")


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """The public methods of ``environment``'s class bound to it, by name (TRL's rule: every function of the class
    whose name does not start with ``_``, less ``reset``, ``get_reward`` and ``step``)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """``tool``'s JSON schema as the chat template receives it (transformers' ``get_json_schema``: the type hints
    and the Google-style docstring's ``Args:``); ValueError naming the tool when they are missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(tool, '__name__', tool)!r}: {err} (a tool needs type hints and a "
                         f"docstring with an Args: section)") from None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's ``name`` and its ``arguments``; ``kind`` is the call's ``type``
    (only ``"function"`` runs)."""

    name: str
    arguments: Any  # a mapping when the model wrote a JSON object; anything else fails the call
    kind: str = "function"


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a call gave back: the ``name`` the tool message carries, its ``content`` text, whether it ``failed``,
    and the seconds it took."""

    name: str
    content: str
    failed: bool
    seconds: float = 0.0


class Toolbox:
    """The tools of one rollout row: the standalone ``tools`` plus its environment's methods, by name."""

    def __init__(self, tools: Sequence[Callable[..., Any]], environment: Any = None):
        self.environment = environment
        every = list(tools) + (environment_tools(environment) if environment is not None else [])
        self.by_name: dict[str, Callable[..., Any]] = {t.__name__: t for t in every}

    @property
    def tools(self) -> list[Callable[..., Any]]:
        """The callables, as the chat template and the response parser take them."""
        return list(self.by_name.values())

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(t) for t in self.by_name.values()]

    def call(self, call: ToolCall) -> Any:
        """Run ``call`` here (no deadline: :func:`run_calls` adds it); an ``async def`` tool in its own event loop."""
        if call.kind != "function":
            raise ValueError(f"Unsupported tool call type: {call.kind}")
        fn = self.by_name.get(call.name)
        if fn is None:
            raise ValueError(f"Tool {call.name} not found.")
        if not isinstance(call.arguments, Mapping):
            raise TypeError(not_an_object(fn, call.arguments))
        return invoke(fn, **call.arguments)


def not_an_object(fn: Callable[..., Any], arguments: Any) -> str:
    """The error a call gets whose ``arguments`` are not a JSON object (a string, a list, a number; null means no
    arguments): the text Python gives ``fn(**arguments)``, which TRL 1.16 calls, so the model reads what TRL's
    would (it names the tool)."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    where = name if module in (None, "builtins") else f"{module}.{name}"
    return f"{where}() argument after ** must be a mapping, not {type(arguments).__name__}"


def _one(box: Toolbox, call: ToolCall, row: int, timeout: float) -> ToolResult:
    import time

    start = time.perf_counter()
    what = f"tool {call.name!r} (row {row})"
    try:
        value = call_with_deadline(box.call, call, timeout=timeout, what=what)
    except DeadlineExceeded as err:
        logger.warning("%s (objective.tool_timeout): the model reads the error", err)
        return ToolResult(call.name, str({"error": str(err)}), True, time.perf_counter() - start)
    except Exception as err:  # the model reads the error text, as TRL gives it
        logger.warning("%s raised %s: %s; the model reads the error", what, type(err).__name__, err)
        return ToolResult(call.name, str({"error": str(err)}), True, time.perf_counter() - start)
    return ToolResult(call.name, value if isinstance(value, list) else str(value), False,
                      time.perf_counter() - start)


def run_calls(requests: Sequence[tuple[int, Toolbox, Sequence[ToolCall]]], timeout: float = DEFAULT_TOOL_TIMEOUT,
              workers: int = 16) -> dict[int, list[ToolResult]]:
    """Every row's calls (``(row, toolbox, calls)``), all at once on a thread pool, each under ``timeout`` seconds;
    ``{row: results in call order}``. Never raises for a tool's fault and never waits past the deadlines."""
    out: dict[int, list[ToolResult]] = {row: [] for row, _, _ in requests}
    jobs = call_jobs(requests, timeout)
    for (row, _), result in zip(jobs, concurrently([job for _, job in jobs], workers)):
        out[row].append(result)
    return out


def call_jobs(requests: Sequence[tuple[int, Toolbox, Sequence[ToolCall]]], timeout: float
              ) -> list[tuple[int, Callable[[], ToolResult]]]:
    """The calls of ``requests`` as ``(row, job)`` pairs for :func:`concurrently` (each job bounded by ``timeout``)."""
    return [(row, functools.partial(_one, box, call, row, timeout)) for row, box, calls in requests for call in calls]
