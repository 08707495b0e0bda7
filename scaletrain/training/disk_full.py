"""Recognise a write refused for lack of room (full disk, quota, file-size limit).

Why: such a failure is the user's to fix (free space, move ``output_dir``) and must end a
run with one line, not a traceback. Orbax's writers do not raise the ``OSError`` itself:
TensorStore reports it inside a ``ValueError`` whose text ends in
``No space left on device [os_error_code='28']``, so both forms are recognised.

A save that fails so is also told by orbax's own threads, each with its traceback (the
array writer, the commit, the finalize thread: hundreds of lines before the one that
matters), by asyncio for the gather of writes orbax abandoned, and TensorStore then
resolves the writes it had under way for an event loop orbax already closed, each an
unraisable ``RuntimeError('Event loop is closed')``. :func:`quiet_no_room_noise` drops
exactly these; every other orbax message stays.
"""

from __future__ import annotations

import errno
import logging
import sys
from typing import Any

NO_ROOM = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
           errno.EFBIG: "File too large"}

# where the echoes come from: absl's logger (orbax logs with absl.logging), orbax's own, and
# asyncio's (a gather of the refused writes that orbax abandoned: "exception was never retrieved")
ECHO_LOGGERS = ("absl", "orbax", "asyncio")


def no_room(err: BaseException | None) -> str | None:
    """The reason (``strerror``) if ``err`` or an exception it wraps is a write refused for lack of room."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            return NO_ROOM[err.errno]
        reason = _named_in(str(err))
        if reason is not None:
            return reason
        err = err.__cause__ or err.__context__
    return None


def _named_in(text: str) -> str | None:
    """The reason if ``text`` says a write was refused for lack of room (as TensorStore words it)."""
    for code, reason in NO_ROOM.items():
        if reason in text or f"os_error_code='{code}'" in text:
            return reason
    return None


class NoRoomRecords(logging.Filter):
    """Drops a log record that reports a write refused for lack of room (in its text or its exception).

    Why: the checkpointer turns that failure into one CheckpointError naming the folder;
    orbax's own reports of it (with tracebacks) only bury that line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and no_room(record.exc_info[1]) is not None:
            return False
        try:
            return _named_in(record.getMessage()) is None
        except Exception:  # a record whose arguments do not fit its format: logging reports it itself
            return True


def _closed_loop(unraisable: Any) -> bool:
    """TensorStore finishing a write for an event loop that orbax closed after a failed save."""
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def _quiet_unraisable_hook(previous: Any) -> Any:
    def hook(unraisable: Any) -> None:
        if not _closed_loop(unraisable):
            previous(unraisable)

    hook.scaletrain_quiet = True  # type: ignore[attr-defined]
    return hook


def quiet_no_room_noise() -> None:
    """Silence orbax's echoes of a save refused for lack of room (idempotent; see the module's docstring)."""
    for name in ECHO_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, NoRoomRecords) for f in log.filters):
            log.addFilter(NoRoomRecords())
    if not getattr(sys.unraisablehook, "scaletrain_quiet", False):
        sys.unraisablehook = _quiet_unraisable_hook(sys.unraisablehook)
