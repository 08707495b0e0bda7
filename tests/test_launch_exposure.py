"""What a multi-process job exposes and says: process 0 listens on the coordinator's own address (a
single-host job on the loopback is unreachable from the network), and a survivor that JAX ends from C++
after losing process 0 says so in the one documented line instead of a native stack trace."""

import io
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from launch_net_testing import listening_addresses
from scaletrain.errors import ConfigError
from scaletrain.launch.jax import rendezvous
from scaletrain.launch.jax.lost import lost_message
from scaletrain.launch.jax.settings import JaxJob
from scaletrain.launch.jax.stderr_guard import guard, lost_from
from scaletrain.launch.jax.supervisor import _cause, _pump, _Said

# what a survivor printed when process 0 was killed (jaxlib 0.10.2; stack addresses shortened)
JAX_FATAL = b"""\
W1128 02:29:41.096227   14173 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from \
coordination service: UNAVAILABLE: Socket closed
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/GetKeyValue:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}. This is only expected if one \
of the tasks is unhealthy. Check the logs for the actual root cause.
E1128 02:29:41.096275   14173 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: \
FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER.
E1128 02:29:41.096319   14173 coordination_service_agent.cc:289] Polled an error from coordination service \
(this can be an error from this or another task).
F1128 02:29:41.096324   14173 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: \
UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted \
unexpectedly or this task is experiencing network issues.
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
*** Check failure stack trace: ***
    @     0x7f5490630634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f548c6f40ee  xla::CoordinationServiceAgent::SetError()
    @     0x7f549f2a71f5  (unknown)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_while_process_0_waits(job: JaxJob) -> list:
    """The addresses process 0's rendezvous listens on, read while it waits for process 1 (which never comes)."""
    errors: list[Exception] = []

    def host() -> None:
        try:
            rendezvous.host(job, lambda: None)
        except ConfigError as err:  # process 1 never comes: the rendezvous times out, as it should
            errors.append(err)

    waiter = threading.Thread(target=host, daemon=True)
    waiter.start()
    port = job.host_port[1]
    deadline = time.monotonic() + 20
    while not (found := listening_addresses(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    waiter.join(30)
    assert not waiter.is_alive() and len(errors) == 1 and "did not reach the coordinator" in str(errors[0])
    return found


def test_a_single_host_job_listens_on_the_loopback_only():
    """`scaletrain launch` and a by-hand job on 127.0.0.1 / localhost: nothing listens on another interface."""
    for host in ("127.0.0.1", "localhost"):
        port = _free_port()
        found = _listening_while_process_0_waits(JaxJob(f"{host}:{port}", 2, 0, 2, 10, "test"))
        assert found and all(ip.is_loopback for ip in found), (host, found)
    assert JaxJob("127.0.0.1:1234", 2, 0, 2, 10, "test").bind_address == "127.0.0.1:1234"  # what JAX's service binds


def test_an_explicit_bind_address_is_where_process_0_listens():
    """launch.coordinator_bind_address=0.0.0.0 is the way to listen on every interface (asked for, not default)."""
    port = _free_port()
    job = JaxJob(f"127.0.0.1:{port}", 2, 0, 2, 10, "test", "0.0.0.0")
    assert [str(ip) for ip in _listening_while_process_0_waits(job)] == ["0.0.0.0"]
    assert job.bind_address == f"0.0.0.0:{port}"
    assert JaxJob("[::1]:80", 2, 0, 2, 10, "test").bind_address == "[::1]:80"


def test_a_port_in_use_is_one_message_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"process 0 cannot listen on 127.0.0.1:{port} .*another job uses"):
            rendezvous.host(JaxJob(f"127.0.0.1:{port}", 2, 0, 2, 10, "test"), lambda: None)


def _guarded(text: bytes, process_id: int = 1) -> str:
    read_end, write_end = os.pipe()
    os.write(write_end, text)
    os.close(write_end)
    out = io.BytesIO()
    with os.fdopen(read_end, "rb") as source:
        guard(source, out, process_id, 2)
    return out.getvalue().decode()


def test_jax_ending_a_survivor_of_lost_process_0_is_the_one_lost_process_line():
    before = b"step 3 loss 2.5\n"
    assert _guarded(before + JAX_FATAL) == before.decode() + lost_message(1, 2, [0]) + "\n"
    assert "lost process 0 of 2" in lost_message(1, 2, [0])


def test_coordination_warnings_without_a_fatal_end_pass_through_unchanged():
    warning = JAX_FATAL.split(b"F1128")[0]  # the announcing lines, then the process carries on
    text = warning + b"step 4 loss 2.4\nunfinished line"
    assert _guarded(text) == text.decode()


def test_the_fatal_text_names_the_lost_process():
    assert lost_from(JAX_FATAL, 1) == [0]
    assert lost_from(b"F] Terminating process ... task /job:jax_worker/replica:0/task:2 heartbeat timeout", 0) == [2]
    assert lost_from(b"F] Terminating process because ...", 1) == []
    assert lost_message(0, 3, []).startswith("scaletrain: error: lost a process of 3 ")


def test_the_launcher_blames_the_process_that_died_not_the_one_jax_ended():
    """Process 1 was killed; process 0 said the lost line (its guard writes it once JAX has ended it) and
    aborted. `scaletrain launch` reports process 1 as the cause, as it does when a survivor exits with 3."""
    said_lost = f"import os, sys; sys.stderr.write({lost_message(0, 2, [1])!r} + '\\n'); sys.stderr.flush(); os.abort()"
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    survivor = subprocess.Popen([sys.executable, "-c", said_lost], stderr=subprocess.PIPE)
    lost = subprocess.Popen([sys.executable, "-c", killed])
    heard = [_Said(open_streams=1), _Said(open_streams=0)]
    _pump(survivor.stderr, b"[0] ", io.BytesIO(), threading.Lock(), heard[0])
    survivor.wait()
    lost.wait()
    assert heard[0].lost and heard[0].open_streams == 0
    assert (survivor.returncode, lost.returncode) == (-6, -9)
    assert _cause([survivor, lost], heard)[0] == 1
    assert _cause([survivor, lost], [_Said(open_streams=0), _Said(open_streams=0)])[0] == 0  # lowest rank otherwise
