"""The callbacks every Ray worker adds to its trainer: metrics to Ray, where the state sits, restarts.

Apart from :mod:`.launcher` (which starts the workers) because they run inside each worker's
trainer and touch only what the callback interface gives them (:class:`TrainerView`), the
run folder they are handed, and Ray's report barrier.
"""

from __future__ import annotations

import os
from typing import Any

from scaletrain.folders import write_json_atomic
from scaletrain.training.protocol import TrainerView

PLACEMENT_FILE = "placement-{rank}.json"  # under <output_dir>/ray, one per process


def report_callback() -> Any:
    from scaletrain.training.callbacks import Callback

    class RayReport(Callback):
        """``ray.train.report`` of the newest train record at each checkpoint, never at every log step.

        Why so rarely: a report is a barrier across the ranks, and Ray keeps one unread report
        per worker, taken when Ray Train's controller polls (every 2 s by default), so a report at
        each log step held fast steps back by up to 2 s each. Ray Train 2 keeps no metrics that
        come without a checkpoint in its ``Result`` either: the run's own ``metrics.jsonl`` is the
        record, and these reports only show progress in Ray's console and dashboard. Checkpoint
        steps are the same on every rank (as a barrier needs), and a save already waits.
        """

        def post_checkpoint(self, trainer: TrainerView, step: int, path: str) -> None:
            import ray.train

            record = {k: v for k, v in trainer.last_train_metrics.items() if isinstance(v, (int, float, str))}
            ray.train.report({**record, "checkpoint_step": step})

    return RayReport()


def placement_callback(folder: str) -> Any:
    from scaletrain.training.callbacks import Callback

    class RecordPlacement(Callback):
        """Write ``placement-<rank>.json``: the mesh's processes and how the parameters are spread.

        Why: a run that silently trained N replicas instead of one sharded model looks
        fine from its losses; this file shows the state really spans the processes.
        """

        def post_init(self, trainer: TrainerView) -> None:
            import jax

            leaves = jax.tree.leaves(trainer.model_state.params)
            sharded = [x for x in leaves if not x.sharding.is_fully_replicated]
            record = {
                "pid": os.getpid(),
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "local_devices": jax.local_device_count(),
                "global_devices": jax.device_count(),
                "mesh": dict(trainer.mesh.shape),
                "mesh_processes": sorted({int(d.process_index) for d in trainer.mesh.devices.flat}),
                "params": len(leaves),
                "sharded_params": len(sharded),
                "fully_addressable_sharded_params": sum(bool(x.is_fully_addressable) for x in sharded),
            }
            os.makedirs(folder, exist_ok=True)
            write_json_atomic(os.path.join(folder, PLACEMENT_FILE.format(rank=jax.process_index())), record)

    return RecordPlacement()


def restart_marker_callback(attempt: int) -> Any:
    from scaletrain.training.callbacks import Callback

    class MarkRestart(Callback):
        """One ``metrics.jsonl`` record where a restarted group resumed, before the steps it redoes.

        Why: the steps after the checkpoint were logged by the failed attempt and are
        logged again; readers keep the later record of a step (``plot.read_metrics``).
        """

        def pre_train(self, trainer: TrainerView, state: Any) -> None:
            step = trainer.global_step
            trainer.write_metrics({"step": step, "split": "restart", "resumed_from_step": step, "attempt": attempt})

    return MarkRestart()
