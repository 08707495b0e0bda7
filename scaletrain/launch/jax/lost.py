"""Noticing that another process of the job died, and saying which, in one line.

When a process dies (``kill -9``, a crash, a lost node) the others cannot go on: every
step's collectives need it, and nothing more could be saved. A survivor's next collective
fails at once (the peer's connection drops); :func:`run_naming_a_lost_process` then finds
which process is gone, says so and exits with :data:`LOST_EXIT` without waiting: JAX's
normal exit would wait at its shutdown barrier for the dead process.

Which one is gone: each process records its host and pid in the coordination service's
key-value store when it joins (:func:`publish_identity`), so a survivor on the same host
knows at once (the pid no longer exists); for processes on other hosts it asks the
service which processes still send heartbeats, which it knows within
``launch.heartbeat_timeout``. A survivor waiting elsewhere (at a checkpoint's barrier)
learns it from JAX instead, which ends the process with its own message at that timeout.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from scaletrain.errors import ScaletrainError
from scaletrain.launch.jax.settings import JaxJob

T = TypeVar("T")
#: exit status of a process that stopped because another process of its job was lost
LOST_EXIT = 3
_KEY = "scaletrain/process/{}"


def _client() -> Any:
    from jax._src import distributed

    return distributed.global_state.client


def publish_identity(job: JaxJob) -> None:
    """Record this process's host and pid for the others (see the module's docstring)."""
    client = _client()
    if client is not None and job.num_processes > 1:
        client.key_value_set(_KEY.format(job.process_id),
                             json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def run_naming_a_lost_process(job: JaxJob, work: Callable[[], T]) -> T:
    """``work()``; if it fails because another process is gone, name it and exit with :data:`LOST_EXIT`."""
    try:
        return work()
    except ScaletrainError:
        raise
    except Exception:
        lost = lost_processes(job)
        if not lost:
            raise
        exit_lost(job, lost)
        raise  # pragma: no cover - exit_lost does not return


def lost_processes(job: JaxJob) -> list[int]:
    """The processes that are gone ([] if all answer or it cannot tell within the heartbeat timeout + 15 s)."""
    client = _client()
    if client is None or job.num_processes == 1:
        return []
    gone = []
    for other in range(job.num_processes):
        if other == job.process_id:
            continue
        try:
            record = client.key_value_try_get(_KEY.format(other))
        except Exception as err:
            if "NOT_FOUND" in str(err):  # it never got as far as saying who it is
                continue
            return [0]  # the coordination service is gone with process 0
        if _gone_from_this_host(json.loads(record)):
            gone.append(other)
    return gone or _without_heartbeat(client, job)


def _gone_from_this_host(record: dict[str, Any]) -> bool:
    if record.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError):
        return False
    return _is_zombie(int(record["pid"]))


def _is_zombie(pid: int) -> bool:
    """A killed child of a launcher that has not collected it yet still has its pid: it is as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _without_heartbeat(client: Any, job: JaxJob) -> list[int]:
    """Ask the coordination service which processes still answer; it knows within the heartbeat timeout."""
    box: dict[str, Any] = {}

    def ask() -> None:
        try:
            box["live"] = set(client.get_live_nodes(list(range(job.num_processes))))
        except Exception as err:  # the coordinator itself is gone
            box["error"] = err

    helper = threading.Thread(target=ask, name="scaletrain-live-nodes", daemon=True)
    helper.start()
    helper.join(job.heartbeat_timeout + 15)
    if "live" in box:
        return sorted(set(range(job.num_processes)) - box["live"])
    return [0] if "error" in box and job.process_id != 0 else []


def lost_message(process_id: int, num_processes: int, lost: list[int]) -> str:
    """The one line a survivor says (here, or from :mod:`.stderr_guard` when JAX ends it from C++)."""
    who = "process " + ", ".join(str(p) for p in lost) if lost else "a process"
    return (f"scaletrain: error: lost {who} of {num_processes} (it stopped answering: killed, crashed "
            f"or its host is unreachable); process {process_id} stops too. Start every process again with "
            "training.resume_if_possible=true to continue from the newest checkpoint")


def exit_lost(job: JaxJob, lost: list[int]) -> None:
    """One line naming the lost process(es), then exit now (JAX's exit would wait for them)."""
    sys.stdout.flush()
    sys.stderr.write(lost_message(job.process_id, job.num_processes, lost) + "\n")
    sys.stderr.flush()
    os._exit(LOST_EXIT)
