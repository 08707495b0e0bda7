"""A process that JAX ends from C++ still says, in one line, which process of the job was lost.

Why a second process: when process 0 dies (it hosts JAX's coordination service), every
survivor's coordination agent finds its error poll cut and JAX ends the survivor from a C++
thread with ``LOG(FATAL)``: gRPC details, a native stack trace, then ``abort()``. Python never
runs again in that process, so nothing in it can print our message. (The hook JAX has for
this, the client's ``missed_heartbeat_callback``, cannot take a Python function in jaxlib
0.10: the status it passes has no Python form, and the process dies of ``std::bad_cast``.)
A small filter process that owns this process's stderr can: :func:`install` points fd 2 at a
pipe into ``python -m scaletrain.launch.jax.stderr_guard``, which passes every line through
unchanged until JAX's fatal line, holds back what follows (and the coordination warnings
that announce it), and when the stream ends writes the one line of
:func:`~scaletrain.launch.jax.lost.lost_message`. The process itself still ends with JAX's
status (SIGABRT: 134); ``scaletrain launch`` reads the line and does not blame that process.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from typing import IO

from scaletrain.launch.jax.settings import JaxJob

#: the line with which JAX ends a process whose coordination agent saw a fatal error
FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
#: absl log lines of the coordination agent that come just before the fatal line (held back a moment)
_ANNOUNCING = re.compile(rb"^[WE]\d{4} [\d:.]+\s+\d+ (preemption_sync_manager|coordination_service_agent)\.cc")
_LOG_LINE = re.compile(rb"^[IWEF]\d{4} ")
_TASK = re.compile(rb"/task:(\d+)")
#: how long announcing lines are held back waiting for a fatal line (seconds)
HOLD_S = 2.0


def install(job: JaxJob) -> None:
    """Route this process's stderr (fd 2) through the guard for a job of several processes."""
    if job.num_processes < 2:
        return
    read_end, write_end = os.pipe()
    real_stderr = os.dup(2)
    try:
        subprocess.Popen([sys.executable, "-m", "scaletrain.launch.jax.stderr_guard", str(job.process_id),
                          str(job.num_processes)], stdin=read_end, stdout=real_stderr, stderr=real_stderr,
                         close_fds=True, start_new_session=False)
    except OSError:  # no guard: JAX's own output stays as it is
        os.close(write_end)
        return
    finally:
        os.close(read_end)
        os.close(real_stderr)
    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)


def lost_from(fatal_text: bytes, process_id: int) -> list[int]:
    """Which processes JAX's fatal text blames: the leader (process 0, which hosts the service) when the
    service cannot be reached, else the tasks it names; [] when it does not say."""
    if b"leader task" in fatal_text or b"Failed to send RPC to coordination service" in fatal_text:
        return [0] if process_id != 0 else []
    return sorted({int(t) for t in _TASK.findall(fatal_text)} - {process_id})


def guard(source: IO[bytes], out: IO[bytes], process_id: int, num_processes: int) -> None:
    """Copy ``source`` to ``out`` line by line until JAX's fatal line; then say the one line at the end."""
    from scaletrain.launch.jax.lost import lost_message

    held: list[bytes] = []  # announcing lines, released when no fatal line follows within HOLD_S
    fatal: list[bytes] = []
    fd = source.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], HOLD_S if held and not fatal else None)
        if not ready:
            out.write(b"".join(held))
            out.flush()
            held.clear()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in (x + b"\n" for x in lines):
            if fatal or FATAL in line:
                fatal.append(line)
            elif _ANNOUNCING.match(line) or (held and not _LOG_LINE.match(line)):
                held.append(line)  # an announcing line, or the gRPC detail lines that continue it
            else:
                out.write(b"".join(held) + line)
                out.flush()
                held.clear()
    if fatal:
        text = b"".join(held + fatal) + pending
        out.write((lost_message(process_id, num_processes, lost_from(text, process_id)) + "\n").encode())
    else:
        out.write(b"".join(held) + pending)
    out.flush()


def main(argv: list[str]) -> None:
    # Ctrl-C reaches the whole process group: the guard outlives the process it serves (it ends when that
    # process's stderr closes), or that process's last words would meet a closed pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guard(sys.stdin.buffer, sys.stdout.buffer, int(argv[0]), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
