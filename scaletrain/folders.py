"""Output folders that are replaced whole, never seen half-written or missing, with ordinary permissions.

Why: an export (``scaletrain export``, a PEFT adapter) is a folder of several files that a
user or transformers opens by its path. It is written under a hidden sibling name
(``.<name>.tmp-*``, :class:`StagedFolder`) and installed at the end. Where Linux offers
``renameat2(RENAME_EXCHANGE)`` (ext4, xfs, btrfs, tmpfs) the previous folder and the new
one swap names in one atomic step: at every instant the path holds the old export or
the new one. Elsewhere (some network filesystems) the old folder is renamed aside
(``.<name>.old-*``) and the new one renamed in; a kill between those two renames leaves the
path missing for that instant, with both complete folders beside it. The next export to
that path (:func:`recover`, run before anything else) puts the new one in place, or the old
one if the new one never finished, and removes every leftover of a killed export.

A staging folder in use is ``flock``-ed by its writer, so a concurrent export to the same
path never deletes it as a leftover; the lock dies with its process, however it dies.
Swaps and recovery hold a lock on the parent folder, so they never interleave. Where a
folder cannot be locked (NFS), an unfinished staging folder counts as a leftover only
once untouched for a day, and swaps rely on one export per path at a time. Just before
the swap the path is checked again, so a folder someone else made there meanwhile is
refused, never swapped away and deleted.

Everything is created with the modes any file gets (``0o666`` / ``0o777`` less the umask):
``mkdtemp`` folders are ``0o700`` and safetensors writes files ``0o600``, which made
exports unreadable by the group that shares them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from typing import Any

from scaletrain.errors import ConfigError

logger = logging.getLogger("scaletrain")

STAGING = "tmp"
ASIDE = "old"
#: where folders cannot be locked, an unfinished staging folder untouched this long is a leftover
STALE_AFTER_S = 24 * 3600


def current_umask() -> int:
    """The process umask, read without changing it (``/proc``), else by the set-and-restore idiom."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_modes(root: str) -> None:
    """Give ``root`` and everything under it the modes a plain ``open``/``mkdir`` would (umask applied)."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic rename (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False  # this filesystem cannot exchange: the caller falls back to two renames
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _hidden(out_dir: str, kind: str) -> str:
    """A fresh hidden sibling name of ``out_dir`` of ``kind`` (``tmp`` or ``old``)."""
    parent, name = os.path.split(out_dir)
    return os.path.join(parent, f".{name}.{kind}-{secrets.token_hex(4)}")


def _leftovers(out_dir: str, kind: str) -> list[str]:
    """The hidden siblings of ``kind`` an earlier export to ``out_dir`` left, newest first."""
    parent, name = os.path.split(out_dir)
    pattern = re.compile(rf"\.{re.escape(name)}\.{kind}-[0-9a-z_]+")
    found = {}
    for entry in os.scandir(parent):
        if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):  # a failed export discards its own meanwhile
                found[entry.path] = entry.stat(follow_symlinks=False).st_mtime_ns
    return sorted(found, key=found.__getitem__, reverse=True)


def _flock(fd: int, blocking: bool) -> bool | None:
    """Lock ``fd`` exclusively: True; False if another holds it (``blocking`` off); None where the
    filesystem cannot lock a folder (NFS emulates flock with write locks, refused on a read-only fd)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


@contextlib.contextmanager
def _locked(folder: str, blocking: bool = True) -> Iterator[bool | None]:
    """Hold an exclusive lock on ``folder`` for the block; yields :func:`_flock`'s answer."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield _flock(fd, blocking)
    finally:
        os.close(fd)


def _abandoned(path: str) -> bool:
    """True unless a live process may still be filling the staging folder ``path``: it holds its lock,
    or, where folders cannot be locked, it changed within :data:`STALE_AFTER_S`."""
    try:
        with _locked(path, blocking=False) as free:
            if free is None:
                return time.time() - os.stat(path).st_mtime > STALE_AFTER_S
            return free
    except FileNotFoundError:
        return False


def recover(out_dir: str, marker: str) -> None:
    """Undo what a killed export to ``out_dir`` left: put a complete folder back at the path if it is
    missing, and remove the hidden leftovers. A folder is complete when it holds ``marker`` (written last)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    if os.path.isdir(parent):
        with _locked(parent):
            _recover_locked(os.path.abspath(out_dir), marker)


def _recover_locked(out_dir: str, marker: str) -> None:
    """:func:`recover`, the parent lock held."""
    staged = [p for p in _leftovers(out_dir, STAGING) if _abandoned(p)]
    aside = _leftovers(out_dir, ASIDE)  # only a dead swap leaves one: a live one holds the parent lock
    if not os.path.lexists(out_dir):
        # the new folder if it was finished (the swap was all that was left), else the old one
        complete = [p for p in staged if os.path.isfile(os.path.join(p, marker))] + aside
        if complete:
            os.rename(complete[0], out_dir)
            logger.warning("restored %s from %s, left by an export that was killed while swapping it",
                           out_dir, complete[0])
    for path in staged + aside:
        if os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by an interrupted export", path)


def refuse_foreign(out_dir: str, marker: str) -> None:
    """ConfigError if ``out_dir`` is something an install would replace but no export of ours wrote."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir}: exists and is not a directory; choose another export path")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, marker)):
        raise ConfigError(f"{out_dir}: not empty and not a previous scaletrain export; refusing to overwrite it. "
                          "Choose an empty or new directory.")


class StagedFolder:
    """A hidden sibling of ``out_dir`` to write an export into, then :meth:`install` at ``out_dir``.

    Created with the umask's mode and locked until installed or discarded, so no other
    export's :func:`recover` mistakes it for a leftover.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = os.path.abspath(out_dir)
        os.makedirs(os.path.dirname(self.out_dir), exist_ok=True)
        while True:
            self.path = _hidden(self.out_dir, STAGING)
            try:
                os.mkdir(self.path, 0o777)  # the umask applies, as to any folder
                break
            except FileExistsError:
                continue
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        _flock(self._fd, blocking=True)  # held until installed or discarded (None: this filesystem cannot)

    def install(self, marker: str) -> None:
        """Give the files plain modes and swap the folder into ``out_dir``; the previous one is then removed."""
        normal_modes(self.path)
        parent = os.path.dirname(self.out_dir)
        with _locked(parent):
            _recover_locked(self.out_dir, marker)
            refuse_foreign(self.out_dir, marker)  # made since the export began: never swapped away
            old = self._swap_in()
            self._release()
            if old is not None:
                shutil.rmtree(old)

    def _swap_in(self) -> str | None:
        """Put the staged folder at ``out_dir``; returns where the previous folder now is (None if none)."""
        if not os.path.lexists(self.out_dir):
            os.rename(self.path, self.out_dir)
            return None
        if exchange(self.path, self.out_dir):
            return self.path  # the staging name now holds the previous folder
        old = _hidden(self.out_dir, ASIDE)
        os.rename(self.out_dir, old)  # the only window with no folder at out_dir: recover() closes it
        os.rename(self.path, self.out_dir)
        return old

    def discard(self) -> None:
        """Remove the unfinished folder (an export that failed)."""
        self._release()
        shutil.rmtree(self.path, ignore_errors=True)

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@contextlib.contextmanager
def staged(out_dir: str, marker: str) -> Iterator[str]:
    """Yield a :class:`StagedFolder`'s path to fill; installed at ``out_dir`` if the block completes, else removed."""
    folder = StagedFolder(out_dir)
    try:
        yield folder.path
        folder.install(marker)
    except BaseException:
        folder.discard()  # after a swap, the staging name holds the previous folder or nothing
        raise


def write_atomic(path: str, content: str | bytes) -> None:
    """Write one file so that a reader sees the old file or the new one, never half of it.

    The bytes go to a sibling named for this process (two writers never share one) and are renamed
    over ``path``; a write that fails removes its sibling. The file gets the modes any file gets.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    """:func:`write_atomic` of ``obj`` as indented JSON with sorted keys (numpy numbers written as floats)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=float))
