"""The processes meet once on the coordinator's port before ``jax.distributed`` starts.

Why our own meeting first: when ``jax.distributed.initialize`` cannot form the job (no
coordinator at the address, a process id the coordinator does not expect, processes
started with different counts, a process that never comes) the JAX runtime aborts the
process from C++ (``LOG(FATAL)``) or, where the counts differ the other way, carries on
with the coordinator's count. Neither gives a message saying what to check, and the
second trains a different job than was asked. Here process 0 listens on the
coordinator's port, every other process says ``{id, n}``, and process 0 answers all of
them at once: go, or the one problem, which every process then raises as the same
:class:`~scaletrain.errors.ConfigError`. Every wait is bounded by
``launch.initialization_timeout``. Process 0 also decides, before anyone is told to go,
whether the run may start at all (its ``admit`` callback takes ``output_dir``'s lock), so
a refused run is refused by every process with one message and nothing is written.

Then the listener is closed and JAX's coordination service binds the same port. Both listen on
the coordinator's own address only (:attr:`~.settings.JaxJob.listen_host`): a single-host job on
127.0.0.1 cannot be reached from the network.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import time
from collections.abc import Callable

from scaletrain.errors import ConfigError
from scaletrain.launch.jax.settings import JaxJob

_RETRY_S = 0.25


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # that process is gone; it learns nothing, and times out on its own


def _read_line(conn: socket.socket, timeout: float) -> dict | None:
    conn.settimeout(max(timeout, 0.1))
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _listen(job: JaxJob) -> list[socket.socket]:
    """Process 0's listening sockets: one per address :attr:`JaxJob.listen_host` resolves to (``localhost``
    is both 127.0.0.1 and ::1), never every interface unless that is what was asked."""
    host, port = job.listen_host, job.host_port[1]
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ConfigError(f"process 0 cannot listen on {host!r} ({err.strerror}): launch.coordinator_address's "
                          "host (or launch.coordinator_bind_address) must name this host") from None
    servers: list[socket.socket] = []
    try:
        skipped: OSError | None = None
        for family, *_, address in dict.fromkeys(found):
            try:
                servers.append(socket.create_server(address, family=family))
            except OSError as err:  # an address family this host lacks (no ::1) is skipped; in use is not
                if err.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    raise
                skipped = err
        if not servers and skipped is not None:
            raise skipped
    except OSError as err:
        for server in servers:
            server.close()
        raise ConfigError(
            f"process 0 cannot listen on {host}:{port} ({err.strerror}): another job uses the port, or the "
            "address is not this host's; choose another port (--coordinator HOST:PORT, launch.coordinator_address) "
            "or set launch.coordinator_bind_address to this host's address"
        ) from None
    return servers


def _accept(servers: list[socket.socket], timeout: float) -> socket.socket | None:
    """The next connection on any of ``servers`` within ``timeout`` seconds, or None."""
    ready, _, _ = select.select(servers, [], [], timeout)
    if not ready:
        return None
    try:
        return ready[0].accept()[0]
    except OSError:
        return None


def host(job: JaxJob, admit: Callable[[], str | None]) -> None:
    """Process 0: wait for processes ``1..N-1``, check they agree with this one, then ``admit()``
    (None: go; else the reason the run may not start) and tell them all."""
    deadline = time.monotonic() + job.initialization_timeout
    joined: set[int] = set()
    conns: list[socket.socket] = []  # every process that said hello, answered together
    servers = _listen(job)
    problem: str | None = None
    try:
        while len(joined) < job.num_processes - 1 and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, job.num_processes)) - joined)
                problem = (f"processes {missing} of {job.num_processes} did not reach the coordinator "
                           f"{job.coordinator_address} within {job.initialization_timeout} s: start them with the "
                           f"same coordinator and --num-processes {job.num_processes}, or raise "
                           "launch.initialization_timeout")
                break
            conn = _accept(servers, min(left, 1.0))
            if conn is None:
                continue
            hello = _read_line(conn, min(10.0, max(deadline - time.monotonic(), 0.1)))
            if hello is None:
                conn.close()
                continue
            conns.append(conn)
            problem = _problem(job, int(hello.get("id", -1)), int(hello.get("n", -1)), joined)
            joined.add(int(hello.get("id", -1)))
        if problem is None:
            problem = admit()
        for conn in conns:
            _send(conn, {"error": problem} if problem else {"go": True})
        for conn in conns:  # let each process close first: its side keeps the closed socket's wait
            _read_line(conn, 2.0)
    finally:
        for conn in conns:
            conn.close()
        for server in servers:
            server.close()
    if problem:
        raise ConfigError(problem)


def _problem(job: JaxJob, pid: int, count: int, joined: set[int]) -> str | None:
    """What is wrong with process ``pid`` (started for ``count`` processes) joining this job, or None."""
    if count != job.num_processes:
        return (f"the processes disagree on the number of processes: process 0 was started with "
                f"{job.num_processes}, process {pid} with {count}; start every process with the same "
                "--num-processes (launch.num_processes)")
    if not 0 < pid < job.num_processes:
        return (f"a process joined with process id {pid}, out of range for {job.num_processes} processes "
                f"(ids 0..{job.num_processes - 1}, 0 being the coordinator's)")
    if pid in joined:
        return f"two processes were started with process id {pid}; give each process its own id"
    return None


def join(job: JaxJob) -> None:
    """Processes 1..N-1: reach process 0 within the timeout, say who this is, and wait for its answer."""
    deadline = time.monotonic() + job.initialization_timeout
    address = job.host_port
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(
                f"could not reach the coordinator at {job.coordinator_address} within {job.initialization_timeout} s "
                f"(this is process {job.process_id} of {job.num_processes}): check that process 0 was started (it "
                "hosts the coordinator), that HOST:PORT is its address and port (--coordinator, "
                "launch.coordinator_address, JAX_COORDINATOR_ADDRESS) and that the port is open between the hosts"
            )
        try:
            conn = socket.create_connection(address, timeout=min(left, 5.0))
        except OSError:
            time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
            continue
        with conn:
            _send(conn, {"id": job.process_id, "n": job.num_processes})
            answer = _read_line(conn, deadline - time.monotonic() + 5.0)
        if answer is None:
            raise ConfigError(f"the coordinator at {job.coordinator_address} closed the connection without an answer "
                              f"(this is process {job.process_id}); see process 0's output")
        if answer.get("error") is not None:
            raise ConfigError(answer["error"])
        return
