"""The jax backend's parts that need no second JAX process: where a process stands in its job, the
rendezvous that refuses bad starts with one message, and the per-step data fingerprint.

tests/test_jax_launch_runs.py trains with real processes.
"""

import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from scaletrain.errors import ConfigError
from scaletrain.launch.backends import backend_of
from scaletrain.launch.jax import rendezvous
from scaletrain.launch.jax.settings import JaxJob, resolve_job, wants_jax
from scaletrain.recipe import Recipe
from scaletrain.training.steps import data_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLEAR = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT",
          "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
          "SLURM_STEP_NUM_NODES", "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri")


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    for name in _CLEAR:
        monkeypatch.delenv(name, raising=False)


def _recipe(**sections) -> Recipe:
    return Recipe.from_dict(sections)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backend_choice():
    assert backend_of(_recipe()) == "local"
    assert backend_of(_recipe(launch={"num_processes": 1})) == "local"  # one process: nothing to join
    assert backend_of(_recipe(launch={"num_processes": 2})) == "jax"
    assert backend_of(_recipe(launch={"coordinator_address": "h:1"})) == "jax"
    assert backend_of(_recipe(launch={"backend": "jax"})) == "jax"
    assert backend_of(_recipe(ray={"num_workers": 2})) == "ray"
    with pytest.raises(ConfigError, match="launch.backend=jax and ray.num_workers are both set"):
        backend_of(_recipe(ray={"num_workers": 2}, launch={"backend": "jax"}))


def test_where_a_process_stands_first_source_wins(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "envhost:9")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    job = resolve_job(_recipe(launch={"num_processes": 2, "process_id": 1}))
    assert (job.coordinator_address, job.num_processes, job.process_id) == ("envhost:9", 2, 1)
    assert job.source == "environment + launch section" and job.heartbeat_timeout == 60
    # EasyDeL's jax_distributed_config means the same as the launch section (which wins where both say)
    easydel = {"coordinator_address": "ed:7", "num_processes": 3, "process_id": 2, "initialization_timeout": 9,
               "heartbeat_timeout_seconds": 11}
    job = resolve_job(_recipe(training={"jax_distributed_config": easydel}, launch={"initialization_timeout": 5}))
    assert (job.coordinator_address, job.num_processes, job.process_id) == ("ed:7", 3, 2)
    assert (job.initialization_timeout, job.heartbeat_timeout) == (5, 11)
    with pytest.raises(ConfigError, match=r"jax_distributed_config: unknown key\(s\) \['coordinator'\]"):
        resolve_job(_recipe(training={"jax_distributed_config": {"coordinator": "x:1"}}))


def test_slurm_variables_are_found_by_jax_detection(monkeypatch):
    """What srun sets for task 1 of 2 (JAX picks the port from the job id unless JAX_COORDINATOR_PORT)."""
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_NTASKS": "2",
                        "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}.items():
        monkeypatch.setenv(name, value)
    recipe = _recipe()
    assert wants_jax(recipe) and backend_of(recipe) == "jax"
    job = resolve_job(recipe)
    assert (job.coordinator_address, job.num_processes, job.process_id) == ("gpu007:61586", 2, 1)
    assert job.source == "slurm detected by JAX"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "5555")
    assert resolve_job(recipe).coordinator_address == "gpu007:5555"


@pytest.mark.parametrize("launch, message", [
    ({"backend": "jax"}, "does not know its coordinator address, num processes, process id; pass --coordinator "
                         "HOST:PORT --num-processes N --process-id I"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     "launch.process_id=2 (launch section) is out of range for num_processes=2"),
])
def test_what_cannot_be_resolved_is_named(launch, message):
    with pytest.raises(ConfigError) as err:
        resolve_job(_recipe(launch=launch))
    assert message in str(err.value)


def test_recipe_refuses_a_bad_address():
    with pytest.raises(ConfigError, match="launch.coordinator_address"):
        _recipe(launch={"coordinator_address": "no-port"})


# ---- the rendezvous: every process raises the same one message -------------------------------------
def _job(port: int, count: int, pid: int, timeout: int = 5) -> JaxJob:
    return JaxJob(f"127.0.0.1:{port}", count, pid, timeout, 10, "test")


def _meet(jobs: list[JaxJob], admit=lambda: None) -> list[str | None]:
    """Run process 0's side and the others' in threads; each one's error (None when it may go)."""
    results: list[str | None] = [None] * len(jobs)

    def run(i: int, job: JaxJob) -> None:
        try:
            rendezvous.host(job, admit) if job.process_id == 0 else rendezvous.join(job)
        except ConfigError as err:
            results[i] = str(err)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_rendezvous_lets_an_agreeing_job_go():
    port = free_port()
    assert _meet([_job(port, 3, 0), _job(port, 3, 2), _job(port, 3, 1)]) == [None, None, None]


def test_mismatched_process_counts_stop_every_process_with_one_message():
    port = free_port()
    results = _meet([_job(port, 2, 0), _job(port, 3, 1)])
    assert results[0] == results[1] and results[0].startswith(
        "the processes disagree on the number of processes: process 0 was started with 2, process 1 with 3")


def test_a_missing_process_and_an_unreachable_coordinator_end_within_the_timeout():
    port = free_port()
    results = _meet([_job(port, 3, 0, timeout=2), _job(port, 3, 1, timeout=2)])
    assert results[0] == results[1] and results[0].startswith(
        f"processes [2] of 3 did not reach the coordinator 127.0.0.1:{port} within 2 s")
    (alone,) = _meet([_job(free_port(), 2, 1, timeout=1)])
    assert alone.startswith("could not reach the coordinator at 127.0.0.1:") and "check that process 0 was started" \
        in alone


def test_two_processes_with_one_id_are_refused():
    port = free_port()
    results = _meet([_job(port, 3, 0), _job(port, 3, 1), _job(port, 3, 1)])
    assert results.count("two processes were started with process id 1; give each process its own id") == 3


HOLDER = (  # another run: it holds the folder's lock and sleeps
    "import sys, time\n"
    "from scaletrain.training.run_lock import acquire_run_lock\n"
    "acquire_run_lock(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_second_run_on_a_locked_folder_is_refused_by_every_process(tmp_path):
    """Process 0 takes output_dir's lock before anyone is told to go; refused, all raise its message."""
    from scaletrain.launch.jax.backend import _take_lock

    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert child.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in out.iterdir())

        def admit():
            try:
                _take_lock(str(out))
            except ConfigError as err:
                return str(err)

        port = free_port()
        results = _meet([_job(port, 2, 0), _job(port, 2, 1)], admit)
        assert results[0] == results[1] and f"pid {child.pid}" in results[0]
        assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    finally:
        child.kill()
        child.wait()


def test_bad_launches_from_the_command_line_are_one_line_and_exit_2(tmp_path):
    """No JAX is started for these: the recipe, the process's place and the rendezvous come first."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    recipe = os.path.join(ROOT, "examples", "shakespeare.yaml")
    out = f"training.output_dir={tmp_path / 'run'}"

    def cli(*args):
        res = subprocess.run([sys.executable, "-m", "scaletrain", *args], capture_output=True, text=True, env=env,
                             timeout=120)
        lines = [x for x in res.stderr.splitlines() if x.startswith("scaletrain: error:")]
        return res.returncode, lines

    code, lines = cli("train", recipe, out, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                      "--process-id", "1", "launch.initialization_timeout=1")
    assert code == 2 and len(lines) == 1 and "could not reach the coordinator" in lines[0]
    code, lines = cli("train", recipe, out, "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                      "--process-id", "5")
    assert code == 2 and len(lines) == 1 and "launch.process_id=5 (launch section) is out of range" in lines[0]
    code, lines = cli("launch", "--nproc", "3", recipe, out)  # a global batch of 16 rows cannot go to 3 processes
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        "scaletrain: error: training.total_batch_size=16 cannot be split among --nproc=3") and \
        "use a process count that divides it (1, 2, 4, 8, 16)" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was written


# ---- the data fingerprint ---------------------------------------------------------------------------
def test_the_fingerprint_is_the_same_however_the_batch_is_split():
    ids = np.random.default_rng(0).integers(0, 50_000, size=(16, 64), dtype=np.int32)
    batch = {"input_ids": jnp.asarray(ids), "segment_ids": jnp.ones((16, 64), jnp.int32)}
    whole = float(jax.jit(data_fingerprint)(batch))
    mesh = jax.make_mesh((8,), ("dp",))
    sharded = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("dp")))
    assert float(jax.jit(data_fingerprint)(sharded)) == whole
    assert 0 <= whole < 2**24 and whole == int(whole)
    swapped = ids.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same tokens in other rows: another batch
    assert float(data_fingerprint({"input_ids": jnp.asarray(swapped)})) != whole


# process 0 waits in a collective for process 1, which fails alone (a user error only it sees)
_ALONE = r"""
import sys, jax
port, rank = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank, initialization_timeout=60)
if rank == 0:
    from jax.experimental import multihost_utils
    multihost_utils.process_allgather(jax.numpy.ones(1))  # never completes: process 1 does not come
else:
    from scaletrain.cli import main
    sys.exit(main(["train", sys.argv[3]]))
"""


def test_a_process_that_fails_alone_leaves_the_job_instead_of_hanging(tmp_path):
    """Without leaving at once, the failed process would wait at jax.distributed's exit barrier for a
    sibling that waits for it: the job would hang rather than fail, and no launcher could tell."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env["XLA_FLAGS"] = ""
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    missing = str(tmp_path / "missing.yaml")
    procs = [subprocess.Popen([sys.executable, "-c", _ALONE, str(port), str(rank), missing], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        _, err = procs[1].communicate(timeout=120)
        assert procs[1].returncode == 2, err
        assert "missing.yaml" in err
        assert procs[0].poll() is None  # still waiting: the launcher's to stop
    finally:
        for p in procs:
            p.kill()
            p.communicate()
