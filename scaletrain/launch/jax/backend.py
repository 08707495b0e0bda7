"""The ``jax`` backend: this process is one of N that were started together (srun, a TPU pod, by hand).

What each process does, and why:

1. It learns its place (:mod:`.settings`), meets the others on the coordinator's port
   (:mod:`.rendezvous`: every bad start is one message on every process), and only then
   initialises ``jax.distributed`` with bounded waits (``initialization_timeout``,
   ``heartbeat_timeout``), before anything touches a device.
2. It runs :func:`scaletrain.run.run_training`, the same code a single process and a Ray
   worker run: the global mesh spans every process's devices, each process reads its own
   rows of each global batch, orbax writes checkpoints from all processes, process 0
   alone writes logs, ``summary.json`` and plots, and the stop rules agree across
   processes at log steps.
3. ``output_dir``'s run lock is process 0's: taken before the others are told to go (or
   adopted from ``scaletrain launch``, which took it first and passes its token in
   :data:`LOCK_TOKEN_ENV`), and held until the run ends.
4. When another process dies, this one's next collective fails; it asks the coordination
   service which processes still answer (it knows within ``heartbeat_timeout``), says
   which one was lost in one line and exits with :data:`LOST_EXIT` at once: nothing it
   could still do would be saved, and JAX's own exit would wait for the dead process.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.launch.batch_split import check_batch_split
from scaletrain.launch.jax import rendezvous
from scaletrain.launch.jax.settings import JaxJob, resolve_job

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe

#: set by ``scaletrain launch`` for its children: process 0 adopts the launcher's lock of output_dir
LOCK_TOKEN_ENV = "SCALETRAIN_RUN_LOCK_TOKEN"
#: exit status of a process that stopped because another process of its job was lost
LOST_EXIT = 3


def run_recipe_on_jax(recipe: Recipe) -> dict[str, Any]:
    """The ``jax`` backend of ``scaletrain train``: join the job, train, return the summary."""
    from scaletrain.training.run_lock import release_run_lock

    job = resolve_job(recipe)
    check_batch_split(recipe.training.total_batch_size, job.num_processes, "launch.num_processes")
    lock: list[Any] = []

    def admit() -> str | None:  # process 0, once every process has joined: may this run use output_dir?
        try:
            lock.append(_take_lock(recipe.training.output_dir))
        except ConfigError as err:
            return str(err)
        return None

    try:
        if job.process_id == 0:
            rendezvous.host(job, admit)
        else:
            rendezvous.join(job)
        initialize(job)
        return _train(recipe, job)
    finally:
        for held in lock:
            release_run_lock(held)


def _take_lock(output_dir: str) -> Any:
    from scaletrain.training.run_lock import acquire_run_lock, adopt_run_lock

    token = os.environ.get(LOCK_TOKEN_ENV)
    return adopt_run_lock(output_dir, token) if token else acquire_run_lock(output_dir)


def initialize(job: JaxJob) -> None:
    """``jax.distributed.initialize`` for ``job`` (a no-op when this process already joined one)."""
    import jax

    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize(
        coordinator_address=job.coordinator_address, num_processes=job.num_processes, process_id=job.process_id,
        initialization_timeout=job.initialization_timeout, heartbeat_timeout_seconds=job.heartbeat_timeout,
    )
    if jax.process_count() != job.num_processes:  # the rendezvous makes this impossible; say so if it is not
        raise ConfigError(f"jax.distributed formed a job of {jax.process_count()} processes, not the "
                          f"{job.num_processes} this process was started for")


def _train(recipe: Recipe, job: JaxJob) -> dict[str, Any]:
    from scaletrain.run import run_training
    from scaletrain.training.outputs import set_launch_description

    set_launch_description(job.describe())
    try:
        return run_training(recipe)
    except ScaletrainError:
        raise
    except Exception:
        lost = lost_processes(job)
        if not lost:
            raise
        _exit_lost(job, lost)
        raise  # pragma: no cover - _exit_lost does not return


def lost_processes(job: JaxJob) -> list[int]:
    """The processes the coordination service no longer hears from ([] if all answer or it cannot tell).

    Bounded: the service declares a process dead after ``heartbeat_timeout``; this waits that
    long and a little more, then gives up (the caller then reports the original error).
    """
    if job.num_processes == 1:
        return []
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return []
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


def _exit_lost(job: JaxJob, lost: list[int]) -> None:
    """One line naming the lost process(es), then exit now (JAX's exit would wait for them)."""
    names = ", ".join(str(p) for p in lost)
    sys.stdout.flush()
    sys.stderr.write(
        f"scaletrain: error: lost process {names} of {job.num_processes} (it stopped answering the coordinator "
        f"{job.coordinator_address}: killed, crashed or its host is unreachable); process {job.process_id} stops "
        "too. Start every process again with training.resume_if_possible=true to continue from the newest "
        "checkpoint\n")
    sys.stderr.flush()
    os._exit(LOST_EXIT)
