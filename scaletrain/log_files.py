"""The logs a run appends to (``metrics.jsonl``, ``completions.jsonl``, ``ray_attempts.jsonl``): whole lines or none.

Why: a write the disk refuses part-way (a full disk, a quota, a file-size limit, an I/O
error) used to leave half a JSON line at the end of the file, and a resumed run appended
after it. Here every append is a few ``os.write`` calls on one ``O_APPEND`` descriptor; if
one fails (or a signal interrupts them) the file is cut back to its size before the
append, so it holds the lines it held, and the error names the file (a file object's
``OSError`` names none). Should even that cut fail (the disk gone), the next run repairs
the file when it opens it (:func:`repair_last_line`), saying so.

A resumed run also removes the records it is about to write again (:func:`drop_records_after`),
so a log holds what an uninterrupted run's holds. One writer per file: the run lock
(``training/run_lock.py``) keeps a second run out of the folder.
"""

from __future__ import annotations

import json
import logging
import os

from scaletrain.errors import DataError

logger = logging.getLogger("scaletrain")

_CHUNK = 1 << 16


class AppendLog:
    """An open log file that takes whole appends only (:meth:`append`); opened lazily, created if missing."""

    def __init__(self, path: str):
        self.path = path
        self._fd = -1

    def append(self, text: str) -> None:
        """Append ``text`` (whole lines) all at once, or leave the file as it was and raise an ``OSError`` naming it."""
        data = text.encode("utf-8")
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            start = os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as err:
            err.filename = err.filename or self.path
            raise
        done = 0
        try:
            while done < len(data):
                n = os.write(self._fd, data[done:])
                if n <= 0:  # no room and no error: the kernel would say ENOSPC on the next try
                    raise OSError(28, os.strerror(28))
                done += n
        except BaseException as err:  # a refused write, or a signal between two writes: no part of it stays
            if done:
                self._cut_back(start)
            if isinstance(err, OSError):
                err.filename = err.filename or self.path
            raise

    def _cut_back(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as err:  # the next run's repair_last_line removes the part line
            logger.warning("%s: could not remove the part of a record a refused write left (%s)", self.path,
                           err.strerror or err)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def append_lines(path: str, lines: list[str]) -> None:
    """Append ``lines`` (each without its newline) to ``path`` as one whole append (see :class:`AppendLog`)."""
    if not lines:
        return
    log = AppendLog(path)
    try:
        log.append("".join(line + "\n" for line in lines))
    finally:
        log.close()


def repair_last_line(path: str) -> int:
    """Cut what follows the last newline of ``path`` (a record a refused write left half-written), warning; the
    number of bytes cut. A missing file is fine.

    Why: a resumed run appending after that half would glue its first record to it, and the
    file would no longer be one JSON object per line.
    """
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        keep = end
        while keep > 0:
            start = max(0, keep - _CHUNK)
            f.seek(start)
            newline = f.read(keep - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        if keep < end:
            f.truncate(keep)
            logger.warning("%s: its last line was cut (%d bytes, a write refused part-way); removed it, the file "
                           "keeps its %s whole lines", path, end - keep, "earlier" if keep else "no")
    return end - keep


def drop_records_after(path: str, step: int) -> int:
    """Remove the records of ``path`` (JSON lines with a ``step``, in step order) after ``step``, the step a run
    resumes from, saying so; first :func:`repair_last_line`. The number of records removed.

    Why: a run killed after its last checkpoint had logged the steps it then redoes on resume;
    appending them again would leave both copies. A line that is not a record is refused (a
    DataError naming the file and line): the log was changed by something else.
    """
    repair_last_line(path)
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        offset, cut, number, later = 0, None, 0, []
        for number, line in enumerate(f, start=1):
            try:
                record_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}, line {number}: not a JSON record with a step; move the file aside (the "
                                f"run starts a new one) or remove that line, then resume") from None
            if cut is None and record_step > step:
                cut = offset
            if cut is not None:
                later.append(record_step)
            offset += len(line)
        if cut is None:
            return 0
        f.truncate(cut)
    steps = f"step {later[0]}" if later[0] == later[-1] else f"steps {later[0]}-{later[-1]}"
    logger.warning("%s: removed %d records of %s, logged after step %d where this run %s; they are logged again "
                   "as those steps are redone", path, len(later), steps, step,
                   "resumes" if step else "starts (no checkpoint)")
    return len(later)
