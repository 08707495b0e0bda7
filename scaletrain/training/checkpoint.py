"""Checkpoints of a run: orbax, asynchronous, complete or invisible.

A checkpoint holds everything a run needs to continue bit for bit: the train
state pytree (step, parameters, optimizer state, RNG), the data iterator's state,
and metadata (model config, arguments, recipe). Orbax writes each step into a
temporary folder and renames it only when complete, so a run killed mid-save
leaves nothing that resume would pick. The retention policy keeps the newest
``save_total_limit`` steps plus, optionally, the best by eval loss; it only ever
deletes steps that this policy itself wrote.

A run owns what it writes: a save at a step whose folder an earlier invocation left
(a run resumed from an older step of its own folder reaches it again) replaces that
folder. The new checkpoint is written complete under ``.replacing/`` and then swapped
with the stale one in one rename, so the step folder always holds one complete
checkpoint, old or new. A restore that finds a piece of the state missing, or a tensor
it cannot read, names it and the checkpoints to resume from instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import jax

from scaletrain.errors import CheckpointError
from scaletrain.folders import exchange, write_atomic
from scaletrain.training.disk_full import no_room, quiet_no_room_noise
from scaletrain.training.restore_checks import fit_error, unreadable

logger = logging.getLogger("scaletrain")

CHECKPOINT_DIR = "checkpoints"
REPLACING_DIR = ".replacing"  # not a step name: nothing under it is ever listed or resumed from
STATE_PIECES = ("step", "params", "opt_state", "rng")


def _state_tree(state: Any) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}


def _sync(name: str) -> None:
    """Barrier across JAX processes (a no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _handlers(ocp: Any) -> dict[str, Any]:
    return {
        "state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _finish_interrupted_replacement(directory: str) -> None:
    """Move a complete replacement whose swap a crash interrupted into its step folder.

    Only the two-rename fallback of :meth:`Checkpointer._replace` can be interrupted
    with the step folder absent; the complete new checkpoint is then under
    ``.replacing/<step>`` (orbax names it so only once committed).
    """
    staging = os.path.join(directory, REPLACING_DIR)
    if not os.path.isdir(staging):
        return
    for name in os.listdir(staging):
        if name.isdigit() and not os.path.lexists(os.path.join(directory, name)):
            os.rename(os.path.join(staging, name), os.path.join(directory, name))
            logger.warning("finished replacing checkpoint %s (a crash had interrupted it)",
                           os.path.join(directory, name))


class Checkpointer:
    """Save and restore checkpoints under ``<directory>/<step>`` (a run's ``output_dir/checkpoints``)."""

    def __init__(self, directory: str, *, save_total_limit: int | None = None, keep_best: bool = False,
                 async_save: bool = True):
        import orbax.checkpoint as ocp

        quiet_no_room_noise()  # a save refused for lack of room is told once, by _raise_if_no_room
        self.directory = os.path.abspath(directory)
        self.save_total_limit = save_total_limit
        self.keep_best = keep_best
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=False,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers(ocp))
        self._unchecked = False  # an asynchronous save started whose outcome nobody has read yet
        self._written: list[int] = []  # steps this run saved: the only ones its policy may delete
        self._current: set[int] = set()  # steps whose folder holds this run's state (saved or restored)
        self._scores: dict[int, float] = self._load_scores()

    @classmethod
    def for_run(cls, output_dir: str, **kw: Any) -> Checkpointer:
        """The checkpoints of a run this process owns (it finishes a swap a crash interrupted)."""
        directory = os.path.join(output_dir, CHECKPOINT_DIR)
        if jax.process_index() == 0:
            _finish_interrupted_replacement(directory)
        _sync("scaletrain_checkpoints_recovered")
        return cls(directory, **kw)

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
        """Start an asynchronous save of ``state`` at ``step``; returns the final path.

        A step this run already saved (or restored from this folder) holds this very
        state and is left as is. A folder an earlier invocation left at ``step`` is
        stale (this run went back to an older step and reached ``step`` again) or
        broken: it is replaced, synchronously and atomically (:meth:`_replace`).
        """
        ocp = self._ocp
        if step in self._current:
            return self.path(step)
        self.wait()
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_state_tree(state)),
            data=ocp.args.JsonSave(data_state or {}),
            meta=ocp.args.JsonSave(meta),
        )
        try:
            if os.path.lexists(self.path(step)):
                self._replace(step, args)
            elif not self._manager.save(step, args=args, force=True):  # force: also below the newest step
                raise CheckpointError(f"checkpoint {self.path(step)} was not written (orbax declined the save)")
        except Exception as err:
            self._raise_if_no_room(err)
            raise
        self._unchecked = True
        self._current.add(step)
        self._written.append(step)
        stale_score = self._scores.pop(step, None)  # an eval loss of the replaced folder's weights
        if eval_loss is not None:
            self._scores[step] = float(eval_loss)
        if eval_loss is not None or stale_score is not None:
            self._store_scores()
        self._apply_retention()
        return self.path(step)

    def _replace(self, step: int, args: Any) -> None:
        """Write ``step`` complete under ``.replacing/``, then swap it with the stale folder.

        With ``renameat2(RENAME_EXCHANGE)`` the swap is one atomic rename; where the
        filesystem lacks it, the old folder moves aside and the new one in (a crash
        between the two leaves the new one complete under ``.replacing/``, and
        :meth:`for_run` moves it into place). No moment exists where a half-written
        folder carries a step's name. Synchronous: a replacement is rare.
        """
        ocp = self._ocp
        target = self.path(step)
        logger.warning("replacing checkpoint %s, left by an earlier invocation, with this run's step %d",
                       target, step)
        staging = os.path.join(self.directory, REPLACING_DIR)
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # leftovers of an interrupted replacement
        _sync(f"scaletrain_replace_start_{step}")
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False, create=True,
                                               cleanup_tmp_directories=False)
        manager = ocp.CheckpointManager(staging, options=options, item_handlers=_handlers(ocp))
        try:
            manager.save(step, args=args, force=True)
            manager.wait_until_finished()
        finally:
            manager.close()
        if jax.process_index() == 0:
            new = os.path.join(staging, str(step))
            if not exchange(new, target):
                aside = new + ".old"
                os.rename(target, aside)
                os.rename(new, target)
            shutil.rmtree(staging, ignore_errors=True)
        _sync(f"scaletrain_replace_done_{step}")
        self._manager.reload()  # a broken stale folder was not listed; the new one must be

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
                self.wait()  # a save refused for lack of room is one CheckpointError here too
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
        write_atomic(self._scores_path(), json.dumps({str(k): v for k, v in self._scores.items()}))

    # ---- restore --------------------------------------------------------------
    def read_meta(self, step: int) -> dict[str, Any]:
        return read_meta(self.path(step))

    def restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """Restore ``step`` into the shapes and shardings of ``template`` (a TrainState).

        The template's shardings decide placement, so a checkpoint saved on one mesh
        restores onto another. Any mismatch raises CheckpointError naming the
        checkpoint and the first differences; a missing piece of the state or an
        unreadable tensor names it and the earlier checkpoints to resume from
        (:meth:`_damaged`); the checkpoint is never modified. ``data`` is ``{}`` when
        the checkpoint has no data item (the trainer, which needs it, says so).
        """
        ocp = self._ocp
        where = self.path(step)
        meta = self.read_meta(step)
        stored = self._stored_state(step, STATE_PIECES)
        tree = _state_tree(template)
        mismatch = fit_error(where, meta, tree, stored)
        if mismatch is not None:
            raise mismatch
        items = {"state": ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))}
        has_data = os.path.isfile(os.path.join(where, "data", "metadata"))
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:
            raise self._damaged(step, unreadable(err)) from None
        tree = restored["state"]
        state = template.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                                 rng=tree["rng"])
        data = restored["data"] if has_data else None
        self._current.add(step)  # this folder now holds the state the run continues from
        return state, dict(data or {}), meta

    def restore_params(self, step: int, params: Any) -> Any:
        """The parameters of ``step`` alone, in the shapes and shardings of ``params`` (a TrainState's ``params``).

        For export and inference: the values of the optimizer state (two float32
        moments per parameter with AdamW, twice the parameters' bytes), the step, the
        RNG and the data position are never read, so the device needs room for the
        parameters only. orbax's partial restore (``PyTreeRestore(partial_restore=True)``)
        reads the ``params`` subtree of the saved state; the checks are :meth:`restore`'s
        for that subtree (shape mismatches, a missing or unreadable tensor, the checkpoint
        never modified; orbax's metadata of the whole state, shapes only, is read for
        them). The step is not marked as this run's (nothing continues from it). A damaged
        checkpoint's message names the other checkpoints to load instead, not a resume.
        """
        ocp = self._ocp
        where = self.path(step)
        meta = self.read_meta(step)
        stored = self._stored_state(step, ("params",), for_resume=False)
        mismatch = fit_error(where, meta, {"params": params}, {"params": stored["params"]})
        if mismatch is not None:
            raise mismatch
        target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params)}
        reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())  # reads what StandardSave wrote: the same format
        try:
            restored = reader.restore(os.path.join(where, "state"), args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
        except Exception as err:
            raise self._damaged(step, unreadable(err), for_resume=False) from None
        finally:
            reader.close()
        return restored["params"]

    def _stored_state(self, step: int, pieces: tuple[str, ...], for_resume: bool = True) -> Any:
        """orbax's metadata of the saved train state of ``step``, once it is there with ``pieces``."""
        where = self.path(step)
        if not os.path.isdir(os.path.join(where, "state")):
            raise self._damaged(step, "its train state folder state/ (" + ", ".join(STATE_PIECES) + ") is missing",
                                for_resume)
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as err:  # unreadable or corrupt metadata
            raise self._damaged(step, unreadable(err), for_resume) from None
        names = set(stored.keys()) if hasattr(stored, "keys") else set()  # orbax's TreeMetadata is a mapping
        missing = [k for k in pieces if k not in names]
        if missing:
            raise self._damaged(step, f"its train state lacks {', '.join(missing)} (in {where}/state)", for_resume)
        return stored

    def _damaged(self, step: int, problem: str, for_resume: bool = True) -> CheckpointError:
        """A CheckpointError for an incomplete or unreadable ``step`` that names what to use instead: an
        earlier checkpoint to resume from, or (``for_resume`` off: export, generate) another to load."""
        if not for_resume:
            return CheckpointError(f"checkpoint {self.path(step)} is damaged: {problem}; {self._load_instead(step)}")
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            hint = (f"resume from an earlier complete checkpoint instead, e.g. "
                    f"training.resume_from={self.path(earlier[-1])} (earlier checkpoints here: {earlier})")
        else:
            hint = "no earlier checkpoint is left here: start again in a new training.output_dir"
        return CheckpointError(f"checkpoint {self.path(step)} is damaged: {problem}; {hint}")

    def _load_instead(self, step: int) -> str:
        """What ``scaletrain generate`` / ``export`` should load instead of the damaged ``step``."""
        others = [s for s in self.all_steps() if s != step]
        if not others:
            return ("no other checkpoint is here: use a folder `scaletrain export` wrote from this run earlier, "
                    "or train again")
        pick = max([s for s in others if s < step] or others)
        return (f"load another checkpoint instead with --checkpoint {pick} (scaletrain generate or export; in "
                f"Python its step folder {self.path(pick)}), e.g. to export it again; other checkpoints "
                f"here: {others}")

    def wait(self) -> None:
        """Finish pending writes; a write refused for lack of room is a CheckpointError naming the folder."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._raise_if_no_room(err)
            raise
        finally:
            self._unchecked = False

    def raise_if_failed(self) -> None:
        """Raise now if an asynchronous save has ended in failure; never blocks.

        Why: the loop calls this every step, so a save refused for lack of room stops the
        run within a step of the failure (one CheckpointError, as :meth:`wait` raises it),
        not at the next save, which may be hours later. Orbax keeps a finished save's
        error for the first ``wait_until_finished``; a save still running is left alone.
        With several processes it does nothing: each would see the save end at its own
        step and leave the others waiting in a collective; the next save's :meth:`wait`
        (or the run's last) raises it instead, at the same step on every process.
        """
        if self._unchecked and jax.process_count() == 1 and not self._manager.is_saving_in_progress():
            self.wait()

    def _raise_if_no_room(self, err: Exception) -> None:
        reason = no_room(err)
        if reason is None:
            return
        raise CheckpointError(
            f"{self.directory}: cannot write a checkpoint ({reason}); free space or move training.output_dir, "
            f"then resume with training.resume_if_possible=true. The complete checkpoints {self.all_steps()} "
            "are intact; the unfinished one is never picked for resume"
        ) from err

    def close(self) -> None:
        self.wait()
        self._manager.close()


def read_meta(step_dir: str) -> dict[str, Any]:
    """The metadata saved with the checkpoint in ``step_dir`` (read without orbax; CheckpointError if unreadable)."""
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {step_dir}: cannot read its metadata ({err})") from None


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
