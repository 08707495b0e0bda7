"""What a failed Ray worker group means: a user error (report it, never retry) or a crash (retry).

Why the driver decides and not Ray's ``FailureConfig``: Ray Train retries every worker
failure alike, so a ``ConfigError`` raised on the workers was retried ``max_failures``
times before it was shown, and when the retries ran out Ray printed ~400 lines of
``WorkerGroupError``. The launcher runs Ray with no retries of its own and restarts the
group itself, after asking :func:`user_error_in` whether the failure can be retried;
when the retries run out :func:`exhausted_error` says in one message what failed last
and where the newest checkpoint is.
"""

from __future__ import annotations

from typing import Any

from scaletrain.errors import ScaletrainError
from scaletrain.training.checkpoint import CHECKPOINT_DIR, step_folders


class WorkersFailedError(ScaletrainError):
    """The Ray worker group failed more often than ``ray.max_failures`` allows."""


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and everything under it: each worker's failure, its cause, its context (depth first)."""
    seen: set[int] = set()
    out: list[BaseException] = []
    stack: list[Any] = [err]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        more: list[Any] = [e.__context__, e.__cause__, getattr(e, "cause", None)]
        for attr in ("worker_failures", "errors"):
            group = getattr(e, attr, None)
            if isinstance(group, dict):
                more.extend(group[k] for k in sorted(group, reverse=True))
            elif isinstance(group, (list, tuple)):
                more.extend(reversed(group))
        stack.extend(more)
    return out


def user_error_in(err: BaseException) -> ScaletrainError | None:
    """The first user error (:class:`ScaletrainError`) raised inside a worker, as a fresh copy; else None."""
    for e in _chain(err):
        if isinstance(e, ScaletrainError):
            try:
                return type(e)(str(e))
            except TypeError:  # a subclass with another constructor
                return ScaletrainError(str(e))
    return None


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def root_cause(err: BaseException) -> str:
    """One line: which rank failed and the innermost exception it raised (``rank 1: RuntimeError: boom``)."""
    failures = getattr(err, "worker_failures", None)
    prefix, top = "", err
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        prefix, top = f"rank {rank}: ", failures[rank]
    innermost = top
    while True:
        nxt = getattr(innermost, "cause", None) or innermost.__cause__
        if not isinstance(nxt, BaseException) or nxt is innermost:
            break
        innermost = nxt
    return prefix + _first_line(innermost)


def newest_checkpoint(output_dir: str) -> str | None:
    import os

    folder = os.path.join(output_dir, CHECKPOINT_DIR)
    steps = step_folders(folder)
    return os.path.join(folder, str(max(steps))) if steps else None


def exhausted_error(err: BaseException, failures: int, max_failures: int, output_dir: str,
                    stop_requested: str | None = None) -> WorkersFailedError:
    """One message for a group that failed for good: the last failure's root cause and the newest checkpoint."""
    checkpoint = newest_checkpoint(output_dir)
    where = (f"the newest checkpoint is {checkpoint} (continue from it with training.resume_if_possible=true)"
             if checkpoint else f"no checkpoint was saved in {output_dir}")
    why = (f"after {stop_requested} asked them to stop" if stop_requested
           else f"{failures} time(s), more than ray.max_failures={max_failures} allows")
    return WorkersFailedError(f"the Ray workers failed {why}; last failure: {root_cause(err)}; {where}; "
                              "Ray's full report is in its session logs (/tmp/ray/session_latest/logs)")
