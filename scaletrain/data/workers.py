"""Running a chunk encoder in worker processes, in order, with bounded memory.

Why processes: rendering chat templates (Jinja) and building masks is Python code
that holds the GIL, so threads would not help. Why ``spawn``: the parent has
usually imported JAX, whose threads make ``fork`` unsafe. Why bounded: at most
``2 * num_workers`` chunks are in flight, so a huge input is never read ahead into
memory. Results come back in input order, so the dataset does not depend on the
number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_worker_fn: Callable[[Any], Any] | None = None


def _init_worker(fn: Callable[[Any], Any]) -> None:
    global _worker_fn
    # one Rust tokenizer thread per worker: the workers are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_fn = fn


def _run_chunk(chunk: Any) -> Any:
    assert _worker_fn is not None, "worker not initialised"
    return _worker_fn(chunk)


def map_chunks(fn: Callable[[T], R], chunks: Iterable[T], num_workers: int = 0) -> Iterator[R]:
    """``fn(chunk)`` for every chunk, in order; in ``num_workers`` spawned processes if > 0.

    ``fn`` must be picklable (a module-level function or an object with
    ``__call__``); it is sent to each worker once. An exception in a worker is
    re-raised here.
    """
    if num_workers <= 0:
        for chunk in chunks:
            yield fn(chunk)
        return
    pool = ProcessPoolExecutor(
        num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(fn,)
    )
    pending: deque[Future[R]] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_run_chunk, chunk))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def chunked(items: Iterable[T], max_items: int, max_chars: int | None = None,
            size: Callable[[T], int] = len) -> Iterator[list[T]]:  # type: ignore[assignment]
    """Consecutive lists of at most ``max_items`` items (and about ``max_chars`` characters)."""
    chunk: list[T] = []
    chars = 0
    for item in items:
        chunk.append(item)
        if max_chars is not None:
            chars += size(item)
        if len(chunk) >= max_items or (max_chars is not None and chars >= max_chars):
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk
