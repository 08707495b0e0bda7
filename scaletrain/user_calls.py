"""Calls into user code (reward functions, tools, environments) under a deadline, with a way out.

Why: a user's function may never return (a deadlocked sandbox, a network call without a timeout,
``while True``). Called directly, it hangs the run for good, and a SIGTERM's handler only sets a
flag that the loop reads after the step, which never ends: only ``kill -9`` stops it, losing every
step since the last checkpoint. :func:`call_with_deadline` runs the call in a worker thread and waits
for it in short slices, so the caller gets control back when the deadline passes
(:class:`DeadlineExceeded`) or when ``stop_requested`` reports a signal (:class:`StopRequested`).

Why a thread and not a process: a thread needs nothing pickled (closures, ``functools.partial``,
TRL's callables work as they are), costs microseconds per call and sees the caller's imports; a
process would need the function importable by name and pay its start on every call, or a pool to
keep alive. What a thread cannot do is be killed. A call past its deadline is asked to stop (an
exception raised inside it at its next Python instruction, which ends a pure-Python loop); one
blocked in native code (a ``sleep``, a socket read) is left running as a daemon thread, its result
discarded, and does not keep the process from exiting. :func:`abandoned` counts those still running.
A native call that holds the GIL (a catastrophic regular expression) stalls every thread and is
out of any thread-based reach; only a process could bound it.

User code that needs the main thread (``signal.alarm`` timeouts) must not rely on it here, as in
TRL's own threaded rewards (its ``accuracy_reward`` turns math_verify's alarms off off the main thread).

``async def`` user code (TRL allows it for tools, environment methods and rewards) runs through
:func:`invoke`, in an event loop of its own inside the worker thread; :func:`concurrently` runs many
bounded calls at once (every row's tools, every async reward).

Multi-process runs: each process times out its own calls; what a caller does with the outcome
(score the rows ``None``, stop the step) is gathered by the caller so every process agrees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: how often the waiting thread looks at the clock and at ``stop_requested`` (seconds)
POLL_SECONDS = 0.1

_abandoned: list[threading.Thread] = []


class DeadlineExceeded(Exception):
    """The call did not return within its timeout; ``what`` names it, ``timeout`` is the limit in seconds."""

    def __init__(self, what: str, timeout: float):
        super().__init__(f"{what} did not return within {timeout:g} s")
        self.what, self.timeout = what, timeout


class StopRequested(Exception):
    """A stop (a signal) arrived while waiting for the call; ``reason`` is what ``stop_requested`` said."""

    def __init__(self, what: str, reason: str):
        super().__init__(f"received {reason} while waiting for {what}")
        self.what, self.reason = what, reason


class _Abandon(SystemExit):
    """Raised inside an abandoned call to end it at its next Python instruction. A ``SystemExit``: user code's
    ``except Exception`` does not swallow it, and a thread that ends with it prints nothing."""


def _never() -> str | None:
    return None


def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout: float, what: str = "user code",
                       stop_requested: Callable[[], str | None] = _never, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run in a worker thread; its value, or its exception raised here.

    :class:`DeadlineExceeded` after ``timeout`` seconds; :class:`StopRequested` as soon as
    ``stop_requested()`` returns a reason (checked every :data:`POLL_SECONDS`). Either way the
    call is asked to stop and, if it does not, left running in the background (module docstring).
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except _Abandon:
            return
        except BaseException as exc:  # handed to the waiting thread as it is
            outcome["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, name=f"scaletrain-user-call {what}", daemon=True)
    deadline = time.monotonic() + timeout
    worker.start()
    while not done.wait(max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))):
        reason = stop_requested()
        if reason is not None:
            _abandon(worker, done)
            raise StopRequested(what, reason)
        if time.monotonic() >= deadline:
            _abandon(worker, done)
            raise DeadlineExceeded(what, timeout)
    if "error" in outcome:
        error = outcome.pop("error")
        raise error
    return outcome.get("value")


def _abandon(worker: threading.Thread, done: threading.Event) -> None:
    """Ask ``worker`` to stop (an exception at its next Python instruction) and remember it if it goes on."""
    if worker.ident is not None and not done.is_set():
        ident = ctypes.c_ulong(worker.ident)
        if ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(_Abandon)) > 1:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, None)  # more than one thread state: undo (CPython's rule)
    worker.join(POLL_SECONDS)
    if worker.is_alive():
        _abandoned.append(worker)


def abandoned() -> int:
    """How many calls given up on are still running (blocked in native code)."""
    _abandoned[:] = [t for t in _abandoned if t.is_alive()]
    return len(_abandoned)


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def`` function, or an object whose ``__call__`` is one
    (TRL's test for async reward functions)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; an ``async def`` function (or one returning an awaitable) run to its end in an event
    loop of its own, as TRL allows for tools, environment methods and rewards. Called from a worker thread, so the
    loop never meets the caller's."""
    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def concurrently(jobs: Sequence[Callable[[], Any]], workers: int = 16) -> list[Any]:
    """Every job's value, in job order, the jobs run at once on a thread pool (``workers`` at most). The jobs bound
    their own time (:func:`call_with_deadline`) and catch their own faults."""
    if not jobs:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs))),
                                               thread_name_prefix="scaletrain-user-calls") as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]
