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
4. When another process dies, this one names it in one line and exits (:mod:`.lost`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError
from scaletrain.launch.batch_split import check_batch_split
from scaletrain.launch.jax import rendezvous, stderr_guard
from scaletrain.launch.jax.lost import run_naming_a_lost_process, publish_identity
from scaletrain.launch.jax.settings import JaxJob, resolve_job

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe

#: set by ``scaletrain launch`` for its children: process 0 adopts the launcher's lock of output_dir
LOCK_TOKEN_ENV = "SCALETRAIN_RUN_LOCK_TOKEN"


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
    """``jax.distributed.initialize`` for ``job`` (a no-op when this process already joined one); its
    coordination service listens where :attr:`JaxJob.listen_host` says, and a survivor that JAX ends from
    C++ says in one line which process was lost (:mod:`.stderr_guard`)."""
    import jax

    if jax.distributed.is_initialized():
        return
    stderr_guard.install(job)
    jax.distributed.initialize(
        coordinator_address=job.coordinator_address, num_processes=job.num_processes, process_id=job.process_id,
        initialization_timeout=job.initialization_timeout, heartbeat_timeout_seconds=job.heartbeat_timeout,
        coordinator_bind_address=job.bind_address,
    )
    if jax.process_count() != job.num_processes:  # the rendezvous makes this impossible; say so if it is not
        raise ConfigError(f"jax.distributed formed a job of {jax.process_count()} processes, not the "
                          f"{job.num_processes} this process was started for")
    publish_identity(job)


def _train(recipe: Recipe, job: JaxJob) -> dict[str, Any]:
    from scaletrain.run import run_training
    from scaletrain.training.outputs import set_launch_description

    set_launch_description(job.describe())
    return run_naming_a_lost_process(job, lambda: run_training(recipe))
