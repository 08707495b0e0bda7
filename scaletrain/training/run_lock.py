"""One run per ``output_dir``: an exclusive lock taken before anything is written there.

Why: two runs started on one folder both trained, interleaved ``metrics.jsonl`` and
crashed at the final save, losing a checkpoint. The second run must refuse at start-up.

How: ``<output_dir>/.scaletrain.lock`` is held open with ``fcntl.flock`` for the run's
lifetime. The kernel drops a flock when its holder dies, ``kill -9`` included, so a
crashed run never leaves the folder locked on its host. The file also records the owner
(pid, host, start time, and the process's start tick from ``/proc``) so the refusal can
name it, and so that where flock does not reach (a filesystem without it, or one whose
locks are local to each client host), a record left by a live process on this host still
refuses, and one left by a dead process (or a recycled pid) is taken over.

A process may take the lock on the same folder more than once (``run_training`` and the
``Trainer`` it builds both do); it is released when the last holder lets go. With several
JAX processes only process 0 takes it: the others write into the folder on its behalf.

A holder that is dying does not refuse a restart: after ``kill -9`` the kernel keeps the
killed process's files open (the flock with them) until it has torn the process down, which
takes a moment for a large process (its main thread already a zombie while the others exit), and
a process it forked keeps an inherited descriptor until it exits too. Supervisors restart at
once (Slurm requeue, a retry loop, Kubernetes), so a start that finds the folder locked polls
for the lock: up to :data:`DYING_GRACE_S` while the recorded holder is gone, a zombie, exiting
or has a SIGKILL pending, up to :data:`LIVE_GRACE_S` while it looks alive; a refusal says how
long it waited.

A Ray launch holds the lock in its driver, for the whole launch (restarts of the worker
group included), so a second launch on the folder is refused before it writes anything.
Its workers are other processes (on this host or others) and would be refused by that
flock; the driver hands them its lock's ``token`` and process 0 *adopts* the lock
(:func:`adopt_run_lock`) instead of taking it: it checks that the record in the file is
still the driver's, unreleased, and then counts as a holder in its own process, so the
``Trainer`` and ``run_training`` it runs take the lock re-entrantly. Only the driver's
flock guards the folder; if the driver dies, the kernel drops it as for any holder.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from scaletrain.errors import ConfigError

logger = logging.getLogger("scaletrain")

LOCK_FILE = ".scaletrain.lock"
#: seconds a start waits for the lock of a holder that is gone, a zombie or exiting (its teardown, or what it forked)
DYING_GRACE_S = 30.0
#: seconds a start waits for the lock of a holder that looks alive (a supervisor that stopped it just before)
LIVE_GRACE_S = 3.0
_POLL_S = 0.05
_PF_EXITING = 0x4  # the kernel's flag, /proc/<pid>/stat field 9, set once a task has begun to exit
_SIGKILL_BIT = 1 << 8  # signal 9 in /proc/<pid>/status's pending masks

_held: dict[str, tuple[RunLock, int]] = {}  # real path of output_dir -> (lock, holders in this process)
_registry = threading.Lock()


def process_start_tick(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None.

    A pid can be reused after its process died; the pair (pid, start tick) cannot.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after its last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def owner_alive(record: dict[str, Any]) -> bool | None:
    """Is the process a lock record names still running? None when it is on another host (unknowable)."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    tick = process_start_tick(pid)
    return record.get("start_tick") is None or tick is None or tick == record["start_tick"]


def holder_state(record: dict[str, Any]) -> str:
    """``"gone"``, ``"dying"`` (a zombie, exiting, or with a SIGKILL pending), ``"alive"``, or ``"unknown"``
    (another host, or no record yet) for the process a lock record names, read from ``/proc``."""
    alive = owner_alive(record) if record else None
    if alive is None:
        return "unknown"
    if not alive:
        return "gone"
    pid = record["pid"]
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, IndexError, ValueError):
        return "gone"  # it went between the checks
    if fields[0] in ("Z", "X", "x") or int(fields[6]) & _PF_EXITING or any(p & _SIGKILL_BIT for p in pending):
        return "dying"
    return "alive"


def describe_owner(record: dict[str, Any]) -> str:
    if not record:
        return "another process (its record is being written)"
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {record.get('pid')} on host {record.get('host')}, started {when}"


class RunLock:
    """The lock file of one ``output_dir``; use :func:`acquire_run_lock` rather than this class."""

    def __init__(self, output_dir: str):
        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_FILE)
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        # what acquire() found, so that a start refused before writing anything can leave no trace
        self._created: list[str] = []  # folders it made, deepest first
        self._previous: bytes | None = None  # the lock file's bytes before (None: there was no file)
        self._snapshot: dict[str, tuple[int, int]] = {}

    def acquire(self) -> None:
        self._created = missing_folders(self.output_dir)
        prepare_output_dir(self.output_dir)
        try:
            with open(self.path, "rb") as f:
                self._previous = f.read()
        except OSError:
            self._previous = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._remove_created()
            raise ConfigError(f"training.output_dir {self.output_dir}: cannot create {LOCK_FILE} there "
                              f"({e.strerror}); make the folder writable or choose another output_dir") from None
        try:
            self._lock_or_refuse(fd)
            self._write_record(fd, released=False)
        except BaseException:
            os.close(fd)
            if self._previous is None:  # refused by a live owner's record: nothing of ours may stay
                self._remove_created()
            raise
        self._snapshot = folder_snapshot(self.output_dir)
        self._fd = fd

    def _lock_or_refuse(self, fd: int) -> None:
        import fcntl

        flocked = True
        try:
            self._flock_waiting_for_a_dying_holder(fd)
        except OSError as e:  # ENOLCK, EOPNOTSUPP...: the filesystem has no flock; fall back on the record
            flocked = False
            logger.warning("%s: the filesystem does not support file locks (%s); relying on the owner record",
                           self.path, e.strerror)
        record = _read_record(fd)
        if not record or record.get("released"):
            return
        alive = owner_alive(record)
        if alive and (not flocked or holder_state(record) == "alive"):  # a live owner on this host, no flock
            self._refuse(record)
        elif alive:  # we hold the flock: the owner has closed its files (a zombie, or still exiting)
            logger.info("%s: taking over the lock of %s, which is exiting", self.path, describe_owner(record))
        elif alive is None and not flocked:
            raise ConfigError(
                f"training.output_dir {self.output_dir} is locked by {describe_owner(record)} and this "
                f"filesystem cannot tell whether that run is still going; if it is not, delete {self.path}"
            )
        elif alive is None:
            logger.warning("%s: taking over a lock that %s did not release (a run that crashed, or one still "
                           "going on a filesystem whose locks do not reach across hosts)",
                           self.path, describe_owner(record))
        else:
            logger.info("%s: taking over the lock of %s, which is no longer running", self.path,
                        describe_owner(record))

    def _flock_waiting_for_a_dying_holder(self, fd: int) -> None:
        """Take the flock, polling while its holder may still let go (see the module docstring); refuse after
        the grace its state allows. OSError other than "held" (a filesystem without flock) propagates."""
        import fcntl

        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                state = holder_state(record)
                waited = time.monotonic() - start
                grace = DYING_GRACE_S if state in ("dying", "gone") else LIVE_GRACE_S
                if waited >= grace:
                    self._refuse(record, waited, state)
                if not told:
                    logger.info("%s is held by %s (%s): waiting up to %.0f s for it to let go", self.path,
                                describe_owner(record), state, grace)
                    told = True
                time.sleep(_POLL_S)
                continue
            waited = time.monotonic() - start
            if waited > _POLL_S:
                logger.info("%s: the lock was let go after waiting %.1f s (its holder was exiting)", self.path, waited)
            return

    def _refuse(self, record: dict[str, Any], waited: float | None = None, state: str = "alive") -> None:
        if waited is None:
            how = ""
        elif state == "dying":
            how = f"; it is exiting, but still held the folder's lock after {waited:.1f} s of waiting"
        elif state == "gone":
            how = (f"; it has exited, but the folder's lock was still held after {waited:.1f} s of waiting, "
                   "by a process it started that inherited the lock file")
        else:
            how = f"; waited {waited:.1f} s for it to exit"
        raise ConfigError(
            f"training.output_dir {self.output_dir} is in use by another run ({describe_owner(record)}{how}); "
            "wait for it to finish, stop it, or choose another training.output_dir"
        )

    def _write_record(self, fd: int, *, released: bool) -> None:
        pid = os.getpid()
        record = {"pid": pid, "host": socket.gethostname(), "started": time.time(),
                  "start_tick": process_start_tick(pid), "token": self.token, "released": released}
        data = json.dumps(record).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def release(self) -> None:
        """Mark the record released and drop the flock (closing the file drops it too).

        A hold under which nothing in the folder changed (a start refused by a later check:
        the data, the model, the checkpoint) undoes itself: the lock file gets its old bytes
        back (when they too said released; a crashed owner's record is marked released), or
        goes with the folders the lock made, so a refused start leaves an existing run byte
        for byte as it was and creates nothing where there was nothing.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        untouched = folder_snapshot(self.output_dir) == self._snapshot
        try:
            if untouched and self._previous is None:
                os.unlink(self.path)  # still under our flock, so no other run read it meanwhile
            elif untouched and _parse_record(self._previous).get("released") is True:  # same meaning: old bytes
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._previous, 0)
            else:
                self._write_record(fd, released=True)
        except OSError:
            pass  # the record only names owners; the flock below is what matters
        finally:
            os.close(fd)
        if untouched and self._previous is None:
            self._remove_created()

    def _remove_created(self) -> None:
        """Remove the folders acquire() made, deepest first, each only while empty."""
        for folder in self._created:
            try:
                os.rmdir(folder)
            except OSError:
                return


def _read_record(fd: int) -> dict[str, Any]:
    try:
        return _parse_record(os.pread(fd, 4096, 0))
    except OSError:
        return {}


def _parse_record(data: bytes) -> dict[str, Any]:
    """A lock file's record, ``{}`` when it is empty or not one."""
    try:
        record = json.loads(data) if data.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def missing_folders(path: str) -> list[str]:
    """The folders ``os.makedirs(path)`` would create, deepest first."""
    out, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def folder_snapshot(folder: str) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of everything under ``folder`` but the lock file.

    Why all of it and not a flag set by the trainer: the lock is held by whoever started the
    run (the CLI, a ``Trainer``, a Ray driver whose workers write), and only the folder itself
    says whether anyone wrote there. Stat calls only, no reads.
    """
    out: dict[str, tuple[int, int]] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == LOCK_FILE:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def prepare_output_dir(output_dir: str) -> None:
    """Create ``output_dir``, or say in one line why it cannot be (a file there, no permission, ...)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"training.output_dir {output_dir} is a file, not a folder; "
                          "remove it or choose another output_dir")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"training.output_dir {output_dir}: cannot create it ({e.strerror}); "
                          "choose a writable location") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"training.output_dir {output_dir} is not writable; "
                          "fix its permissions or choose another output_dir")


def acquire_run_lock(output_dir: str) -> RunLock:
    """Take the lock of ``output_dir`` for this process (again, if it already holds it)."""
    key = os.path.realpath(output_dir)
    with _registry:
        lock, count = _held.get(key, (None, 0))
        if lock is None:
            lock = RunLock(output_dir)
            lock.acquire()
        _held[key] = (lock, count + 1)
    return lock


def release_run_lock(lock: RunLock | None) -> None:
    """Let go of one hold of ``lock``; the file is unlocked when this process's last hold ends."""
    if lock is None:
        return
    key = os.path.realpath(lock.output_dir)
    with _registry:
        held, count = _held.get(key, (None, 0))
        if held is not lock:
            return
        if count > 1:
            _held[key] = (lock, count - 1)
            return
        del _held[key]
        lock.release()


def adopt_run_lock(output_dir: str, token: str) -> RunLock:
    """Hold the lock of ``output_dir`` on behalf of the process that took it with ``token`` (a Ray driver).

    Why not a second flock: the driver's flock would refuse its own workers. Why a token
    and not a flag: a worker must never write into a folder that another run has taken
    over (its driver died, a new run took the lock): the record must still be the
    driver's (same token, not released, owner not known to be dead), else ConfigError.
    The adopted lock has no file of its own; letting go of it leaves the file alone.
    """
    key = os.path.realpath(output_dir)
    with _registry:
        lock, count = _held.get(key, (None, 0))
        if lock is None:
            lock = RunLock(output_dir)
            _check_adoptable(lock, token)
            lock.token = token
        _held[key] = (lock, count + 1)
    return lock


def _check_adoptable(lock: RunLock, token: str) -> None:
    """Raise ConfigError unless ``lock.path`` records a live, unreleased hold taken with ``token``."""
    try:
        fd = os.open(lock.path, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"training.output_dir {lock.output_dir}: the launcher's lock {lock.path} cannot be "
                          f"read ({e.strerror}); every worker must reach output_dir") from None
    try:
        record = _read_record(fd)
    finally:
        os.close(fd)
    if record.get("token") != token or record.get("released") or owner_alive(record) is False:
        state = "released" if record.get("released") else f"held by {describe_owner(record)}"
        raise ConfigError(
            f"training.output_dir {lock.output_dir}: this worker's launcher no longer holds the folder's "
            f"lock ({state}); it stopped or another run took the folder over, so this worker will not write there"
        )


def holds_run_lock(output_dir: str) -> bool:
    """Whether this process holds the lock of ``output_dir``."""
    with _registry:
        return os.path.realpath(output_dir) in _held


__all__ = ["DYING_GRACE_S", "LIVE_GRACE_S", "LOCK_FILE", "RunLock", "acquire_run_lock", "adopt_run_lock",
           "holder_state", "holds_run_lock", "owner_alive", "release_run_lock"]
