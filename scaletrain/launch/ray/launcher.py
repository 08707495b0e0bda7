"""Run one training on N JAX processes with Ray Train (``ray.train.v2.jax.JaxTrainer``).

What each worker does, and why:

1. ``jax.distributed`` is initialised before JAX touches a device. On GPU/TPU Ray's
   JAX backend does it. On CPU Ray does not (``JaxConfig`` skips CPU), so rank 0 picks
   a coordinator address, ``ray.train.collective.broadcast_from_rank_zero`` hands it
   to everyone, and each worker calls ``jax.distributed.initialize``. Workers run with
   ``XLA_FLAGS`` cleared: one CPU device per process (several local devices per
   process can hang later steps on the gloo collectives).
2. The job (any picklable callable: :class:`RecipeJob` for a recipe, the EasyDeL
   façade's ``TrainJob``) builds the model on the global mesh and trains;
   :func:`make_batch_iterator` gives each process its own rows of every global batch;
   orbax writes checkpoints from all processes into the run's ``output_dir`` (which
   every worker must reach: a shared or network folder).
3. ``metrics.jsonl`` and ``summary.json`` are written by process 0; the newest train record
   goes to Ray through ``ray.train.report`` at each checkpoint and the summary at the end (a
   report is a barrier, so all ranks call it, at the same steps).

Fault tolerance: with ``max_failures > 0`` the driver starts the whole worker group again
after a worker dies (:mod:`.failures`: a user error is reported at once, never retried);
the new processes resume from the newest complete checkpoint in ``output_dir``
(``resume_if_possible``) and rank 0 marks the restart in ``metrics.jsonl``. SIGTERM or
SIGINT to the driver is forwarded to the workers, which checkpoint and stop
(:mod:`.driver_stop`). The driver refuses to start on top of
checkpoints it did not write unless ``resume_if_possible`` is set, so every checkpoint
a restarted worker finds belongs to this run.

One launch per ``output_dir``: the driver takes the folder's run lock before it writes
anything there and keeps it for the whole launch, restarts included. The workers are
other processes, which that lock would refuse, so the driver hands its lock's token to
them and process 0 adopts the lock (it checks the record is still the driver's) rather
than taking it; the Trainer it runs then holds it re-entrantly. One lock file, one
owner: a launch, a single-process run and a sweep member on one folder all exclude each
other, which a second lock file guarding only launches would not do.

:func:`run_recipe_on_ray` is the ``ray`` backend of ``scaletrain train``
(:mod:`scaletrain.launch.backends` chooses it); :mod:`scaletrain.run`, what every worker
runs, never imports :mod:`scaletrain.launch`: the two import one way only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.launch.ray.cluster import ensure_ray, import_ray, make_worker_env
from scaletrain.launch.ray.driver_stop import (
    DriverSignals,
    RelayDriverStop,
    call_off_main_thread,
    clear_stop_request,
    stop_request_path,
)
from scaletrain.launch.ray.failures import exhausted_error, root_cause, user_error_in
from scaletrain.launch.ray.worker_callbacks import (
    PLACEMENT_FILE,
    placement_callback,
    report_callback,
    restart_marker_callback,
)
from scaletrain.log_files import append_lines
from scaletrain.logs import setup_logging
from scaletrain.training.checkpoint import CHECKPOINT_DIR, refuse_start_over, step_folders
from scaletrain.training.outputs import read_summary
from scaletrain.training.run_lock import acquire_run_lock, adopt_run_lock, release_run_lock

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.recipe import Recipe

logger = logging.getLogger("scaletrain")

ATTEMPTS_FILE = "ray_attempts.jsonl"
RAY_DIR = "ray"  # under output_dir: Ray Train's run state (RunConfig name) and the placement records


# ---- the CLI's job, and its launch ---------------------------------------------------------
@dataclass
class RecipeJob:
    """``scaletrain.run.run_training(recipe)`` on every worker (the CLI's path)."""

    recipe: Any

    def __call__(self, callbacks: Sequence[Any]) -> dict[str, Any]:
        from scaletrain.run import run_training

        recipe = self.recipe.model_copy(deep=True)
        recipe.training.resume_if_possible = True
        return run_training(recipe, callbacks=callbacks)


def run_recipe_on_ray(recipe: Recipe) -> dict[str, Any]:
    """The ``ray`` backend of ``scaletrain train``: ``ray.num_workers`` processes run the recipe; the summary."""
    from scaletrain.launch.ray.prelaunch import check_recipe_before_launch

    check_recipe_before_launch(recipe)  # what needs no worker fails here, once, before Ray starts
    recipe = recipe.model_copy(deep=True)
    recipe.training.output_dir = os.path.abspath(recipe.training.output_dir)
    r = recipe.ray
    result = launch_on_ray(
        RecipeJob(recipe), num_workers=r.num_workers, output_dir=recipe.training.output_dir,
        max_failures=r.max_failures, ray_address=r.address, resources_per_worker=r.resources_per_worker,
        use_gpu=r.use_gpu, num_cpus=r.num_cpus, resume_if_possible=recipe.training.resume_if_possible,
    )
    return result.summary


# ---- inside a worker -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_jax_distributed(rank: int, world_size: int) -> None:
    """Join this process to the JAX job (CPU: coordinator address broadcast from rank 0)."""
    import jax

    if jax.distributed.is_initialized():  # Ray's JAX backend did it (GPU/TPU)
        return
    from ray.train.collective import broadcast_from_rank_zero
    from ray.util import get_node_ip_address

    address = f"{get_node_ip_address()}:{free_port()}" if rank == 0 else None
    address = broadcast_from_rank_zero(address)
    # the coordination service listens on the node's address the workers were given, not on every interface
    jax.distributed.initialize(coordinator_address=address, num_processes=world_size, process_id=rank,
                               coordinator_bind_address=address)


def worker_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the JaxTrainer."""
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    setup_logging(rank)
    started = time.time()
    if os.path.isdir(config.get("cwd") or ""):
        os.chdir(config["cwd"])  # Ray starts workers in its own folder: relative paths mean the driver's
    init_jax_distributed(rank, world)
    import jax

    out, attempt = config["output_dir"], int(config.get("attempt", 1))
    # the driver holds output_dir's lock; process 0 (the one whose Trainer would take it) adopts it
    lock = adopt_run_lock(out, config["run_lock_token"]) if jax.process_index() == 0 else None
    try:
        if rank == 0:
            append_lines(os.path.join(out, ATTEMPTS_FILE), [json.dumps({
                "started": started, "jax_ready": time.time(), "processes": jax.process_count(),
                "devices": jax.device_count(), "attempt": attempt})])
        callbacks = [report_callback(), placement_callback(os.path.join(out, RAY_DIR)),
                     RelayDriverStop(stop_request_path(os.path.join(out, RAY_DIR)))]
        if attempt > 1:
            callbacks.append(restart_marker_callback(attempt))
        summary = config["job"](callbacks)
    finally:
        release_run_lock(lock)
    ray.train.report({"finished": 1, "final_step": summary.get("final_step"),
                      "params_sha256": summary.get("params_sha256"),
                      "final_train_loss": summary.get("final_train_loss"),
                      "final_eval_loss": summary.get("final_eval_loss")})


# ---- on the driver -----------------------------------------------------------------------
@dataclass
class LaunchResult:
    """What a Ray run left.

    ``summary``: process 0's ``summary.json``; ``attempts``: one record per start of the
    worker group (``restarts`` = attempts - 1); ``placement``: per process, the mesh and
    how many sharded parameters it could address fully (0 when sharded across
    processes); ``ray_result``: Ray Train's ``Result``.
    """

    output_dir: str
    summary: dict[str, Any]
    ray_result: Any = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    placement: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def restarts(self) -> int:
        """How many times the worker group was started again after a failure."""
        return max(0, len(self.attempts) - 1)


def launch_on_ray(
    job: Callable[[Sequence[Any]], dict[str, Any]],
    *,
    num_workers: int,
    output_dir: str,
    max_failures: int = 0,
    ray_address: str | None = None,
    resources_per_worker: dict[str, float] | None = None,
    use_gpu: bool = False,
    use_tpu: bool = False,
    worker_env: dict[str, str] | None = None,
    num_cpus: int | None = None,
    resume_if_possible: bool = False,
) -> LaunchResult:
    """Run ``job`` on ``num_workers`` Ray Train workers; one JAX process each.

    - ``ray_address``: None starts a local Ray instance (``num_cpus`` logical CPUs,
      default ``num_workers`` × the CPUs per worker) and stops it afterwards;
      ``"auto"`` or ``"ray://host:port"`` joins an existing cluster (scaletrain must be
      importable on its nodes, and ``output_dir`` reachable from all of them).
    - ``resources_per_worker``: e.g. ``{"CPU": 1}`` (default) or ``{"GPU": 1}``.
    - ``use_gpu`` / ``use_tpu``: Ray's JAX backend initialises ``jax.distributed``.
    - ``max_failures``: restarts of the worker group after a failure (-1: unlimited);
      each restart resumes from the newest checkpoint (set ``save_steps``). A user
      error (``ScaletrainError``) raised on a worker is re-raised at once, never
      retried; when the restarts run out, a :class:`~.failures.WorkersFailedError`
      names the last failure's root cause and the newest checkpoint.
    - SIGTERM / SIGINT to this process (on its main thread) make the workers save a
      checkpoint and stop; the result then has the summary's ``stop_reason``.
    - ``worker_env``: extra environment variables for the workers.
    - ``output_dir`` is locked (:mod:`scaletrain.training.run_lock`) from before anything
      is written there until the launch ends, however it ends: a second launch or run on
      the folder is refused at start. The workers adopt this lock rather than take it.
    """
    import_ray()
    if num_workers < 1:
        raise ConfigError(f"ray.num_workers must be >= 1, got {num_workers}")
    output_dir = os.path.abspath(output_dir)
    lock = acquire_run_lock(output_dir)  # before anything is written into output_dir
    try:
        return _launch_locked(
            job, num_workers=num_workers, output_dir=output_dir, lock_token=lock.token, max_failures=max_failures,
            ray_address=ray_address, resources_per_worker=resources_per_worker, use_gpu=use_gpu,
            use_tpu=use_tpu, worker_env=worker_env, num_cpus=num_cpus, resume_if_possible=resume_if_possible,
        )
    finally:
        release_run_lock(lock)


def _launch_locked(
    job: Callable[[Sequence[Any]], dict[str, Any]],
    *,
    num_workers: int,
    output_dir: str,
    lock_token: str,
    max_failures: int,
    ray_address: str | None,
    resources_per_worker: dict[str, float] | None,
    use_gpu: bool,
    use_tpu: bool,
    worker_env: dict[str, str] | None,
    num_cpus: int | None,
    resume_if_possible: bool,
) -> LaunchResult:
    """:func:`launch_on_ray` once ``output_dir``'s lock is held (its token goes to the workers)."""
    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    if not resume_if_possible:
        folder = os.path.join(output_dir, CHECKPOINT_DIR)
        refuse_start_over(folder, step_folders(folder))
    resources = dict(resources_per_worker or ({"GPU": 1} if use_gpu else {"CPU": 1}))
    if num_cpus is None and ray_address is None:
        num_cpus = max(1, int(num_workers * resources.get("CPU", 1)))
    ray_dir = os.path.join(output_dir, RAY_DIR)
    stop_path = clear_stop_request(ray_dir)
    started_ray = ensure_ray(ray_address, num_cpus)
    t0, wall0 = time.perf_counter(), time.time()
    failures = 0
    try:
        with DriverSignals(stop_path) as signals:  # after ray.init, which installs its own SIGTERM handler
            while True:
                if signals.requested:  # before (re)starting a group: nothing runs that could save
                    raise ScaletrainError(f"received {signals.requested} before the Ray workers started; "
                                          f"nothing new was trained (newest checkpoints are in {output_dir})")
                trainer = JaxTrainer(
                    worker_loop,
                    train_loop_config={"job": job, "output_dir": output_dir, "cwd": os.getcwd(),
                                       "attempt": failures + 1, "run_lock_token": lock_token},
                    scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, use_tpu=use_tpu,
                                                 resources_per_worker=resources),
                    run_config=RunConfig(
                        name=RAY_DIR,
                        storage_path=output_dir,
                        failure_config=FailureConfig(max_failures=0),  # restarts are decided below
                        worker_runtime_env={"env_vars": make_worker_env(use_gpu, use_tpu, worker_env)},
                    ),
                )
                try:  # off the main thread: Ray Train would replace our SIGINT handler there
                    result = call_off_main_thread(trainer.fit)
                    break
                except Exception as err:
                    user = user_error_in(err)
                    if user is not None:
                        raise user from err
                    failures += 1
                    if signals.requested or (max_failures != -1 and failures > max_failures):
                        raise exhausted_error(err, failures, max_failures, output_dir, signals.requested) from err
                    logger.warning("the Ray worker group failed (%s); restart %d of %s from the newest checkpoint",
                                   root_cause(err), failures, "unlimited" if max_failures == -1 else max_failures)
    finally:
        if started_ray:
            ray.shutdown()
    return LaunchResult(
        output_dir=output_dir,
        summary=read_summary(output_dir) or {},
        ray_result=result,
        attempts=[a for a in _read_attempts(output_dir) if a.get("started", 0) >= wall0],
        placement=[_read_placement(output_dir, rank) for rank in range(num_workers)],
        elapsed_s=time.perf_counter() - t0,
    )


def _read_placement(output_dir: str, rank: int) -> dict[str, Any]:
    """What ``RecordPlacement`` wrote for process ``rank``; {} if that process never got that far."""
    try:
        with open(os.path.join(output_dir, RAY_DIR, PLACEMENT_FILE.format(rank=rank))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _read_attempts(output_dir: str) -> list[dict[str, Any]]:
    try:
        with open(os.path.join(output_dir, ATTEMPTS_FILE)) as f:
            return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]  # whole lines
    except OSError:
        return []
