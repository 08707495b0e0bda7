"""Checkpoints of a run: orbax, asynchronous, complete or invisible.

A checkpoint holds everything a run needs to continue bit for bit: the train
state pytree (step, parameters, optimizer state, RNG), the data iterator's state,
and metadata (model config, arguments, recipe). Orbax writes each step into a
temporary folder and renames it only when complete, so a run killed mid-save
leaves nothing that resume would pick. The retention policy keeps the newest
``save_total_limit`` steps plus, optionally, the best by eval loss; it only ever
deletes steps that this policy itself wrote.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from scaletrain.errors import CheckpointError

logger = logging.getLogger("scaletrain")

CHECKPOINT_DIR = "checkpoints"


def _state_tree(state: Any) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}


def _shape_of(leaf: Any) -> tuple[int, ...] | None:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(int(s) for s in shape)


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...] | None]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path): _shape_of(leaf)
            for path, leaf in flat}


class Checkpointer:
    """Save and restore checkpoints under ``<directory>/<step>`` (a run's ``output_dir/checkpoints``)."""

    def __init__(self, directory: str, *, save_total_limit: int | None = None, keep_best: bool = False,
                 async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(directory)
        self.save_total_limit = save_total_limit
        self.keep_best = keep_best
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=False,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._written: list[int] = []  # steps this run saved: the only ones its policy may delete
        self._scores: dict[int, float] = self._load_scores()

    @classmethod
    def for_run(cls, output_dir: str, **kw: Any) -> Checkpointer:
        return cls(os.path.join(output_dir, CHECKPOINT_DIR), **kw)

    # ---- discovery ----------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Complete checkpoints, oldest first (temporary, unfinished folders are not listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ---- save -----------------------------------------------------------------
    def save(self, step: int, state: Any, data_state: dict[str, Any] | None, meta: dict[str, Any],
             eval_loss: float | None = None) -> str:
        """Start an asynchronous save of ``state`` at ``step``; returns the final path."""
        ocp = self._ocp
        if step in self.all_steps():
            return self.path(step)
        self._manager.wait_until_finished()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_state_tree(state)),
            data=ocp.args.JsonSave(data_state or {}),
            meta=ocp.args.JsonSave(meta),
        )
        self._manager.save(step, args=args)
        self._written.append(step)
        if eval_loss is not None:
            self._scores[step] = float(eval_loss)
            self._store_scores()
        self._apply_retention()
        return self.path(step)

    def record_eval(self, step: int, eval_loss: float) -> None:
        """Remember the eval loss of a saved step (for keep-best retention)."""
        if step in self._written:
            self._scores[step] = float(eval_loss)
            self._store_scores()

    def _apply_retention(self) -> None:
        if not self.save_total_limit:
            return
        keep = set(self._written[-self.save_total_limit:])
        if self.keep_best and self._scores:
            keep.add(min(self._scores, key=self._scores.get))
        for step in list(self._written):
            if step not in keep:
                self._manager.wait_until_finished()
                self._manager.delete(step)
                self._written.remove(step)
                self._scores.pop(step, None)

    def _scores_path(self) -> str:
        return os.path.join(self.directory, "eval_scores.json")

    def _load_scores(self) -> dict[int, float]:
        try:
            with open(self._scores_path()) as f:
                return {int(k): float(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            return {}

    def _store_scores(self) -> None:
        if jax.process_index() != 0:
            return
        tmp = self._scores_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump({str(k): v for k, v in self._scores.items()}, f)
        os.replace(tmp, self._scores_path())

    # ---- restore --------------------------------------------------------------
    def read_meta(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.path(step), "meta", "metadata")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint {self.path(step)}: cannot read its metadata ({err})") from None

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Restore ``step`` into the shapes and shardings of ``template`` (a TrainState).

        The template's shardings decide placement, so a checkpoint saved on one mesh
        restores onto another. Any mismatch raises CheckpointError naming the
        checkpoint and the first differences; the checkpoint is never modified.
        """
        ocp = self._ocp
        where = self.path(step)
        meta = self.read_meta(step)
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as err:  # unreadable or corrupt metadata
            raise CheckpointError(f"checkpoint {where} is unreadable: {err}") from None
        want = _flat_shapes(_state_tree(template))
        have = _flat_shapes(stored) if stored is not None else {}
        problems = []
        for key in sorted(set(want) | set(have)):
            if key not in have:
                problems.append(f"{key} missing from the checkpoint")
            elif key not in want:
                problems.append(f"{key} in the checkpoint but not in this model")
            elif want[key] != have[key]:
                problems.append(f"{key} has shape {have[key]} in the checkpoint but {want[key]} here")
        if problems:
            cfg = meta.get("config", {})
            hint = ", ".join(f"{k}={cfg[k]}" for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k in cfg)
            raise CheckpointError(
                f"checkpoint {where} does not fit this model ({len(problems)} mismatches; saved with {hint}): "
                + "; ".join(problems[:5])
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state_tree(template))
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract),
                    data=ocp.args.JsonRestore(),
                ),
            )
        except Exception as err:
            raise CheckpointError(f"checkpoint {where} could not be loaded: {type(err).__name__}: {err}") from None
        tree = restored["state"]
        state = template.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                                 rng=tree["rng"])
        return state, dict(restored["data"] or {}), meta

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def resolve_checkpoint(path: str) -> tuple[str, int]:
    """``(checkpoints_dir, step)`` for a step folder, a checkpoints folder or a run folder.

    A folder that holds no complete checkpoint raises CheckpointError naming it.
    """
    path = os.path.abspath(path)
    if os.path.basename(path).isdigit() and os.path.isdir(path):
        directory, step = os.path.dirname(path), int(os.path.basename(path))
        if not os.path.exists(os.path.join(path, "commit_success.txt")) and not os.path.isdir(
            os.path.join(path, "state")
        ):
            raise CheckpointError(f"checkpoint {path} is incomplete (no state was committed)")
        return directory, step
    for candidate in (os.path.join(path, CHECKPOINT_DIR), path):
        steps = step_folders(candidate)
        if steps:
            return candidate, steps[-1]
    raise CheckpointError(f"no checkpoint found at {path}")


def step_folders(directory: str) -> list[int]:
    """Steps with a folder under a checkpoints directory (read without orbax; oldest first)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def refuse_start_over(directory: str, steps: list[int]) -> None:
    """A run never starts fresh on top of checkpoints it did not write: name them and say what to do."""
    if steps:
        raise CheckpointError(
            f"{directory} already holds checkpoints {steps}; set training.resume_if_possible=true to "
            "continue that run, or choose a new training.output_dir"
        )


def resume_source(own: Checkpointer, resume_from: str | None,
                  resume_if_possible: bool) -> tuple[Checkpointer, int] | None:
    """Where a run continues from: ``resume_from``, else (if allowed) its own newest step, else nowhere.

    The resume policy in one place. Starting fresh while ``own`` already holds
    checkpoints is an error (:func:`refuse_start_over`).
    """
    if resume_from:
        directory, step = resolve_checkpoint(resume_from)
        source = own if os.path.abspath(directory) == own.directory else Checkpointer(directory)
        return source, step
    latest = own.latest_step()
    if resume_if_possible and latest is not None:
        return own, latest
    refuse_start_over(own.directory, own.all_steps())
    return None
