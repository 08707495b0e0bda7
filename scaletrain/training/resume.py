"""Checks a resume makes after the train state is back: the same run, the data position, and what lies ahead.

The train state alone does not make a resume exact: the data iterator must continue
at the batch after the last one the state consumed. A checkpoint without that
position would silently train on other batches, so it is an error here.
"""

from __future__ import annotations

import logging
from typing import Any

from scaletrain.errors import CheckpointError
from scaletrain.training.lora_state import check_lora_base
from scaletrain.training.run_identity import check_run_identity, record_changes

logger = logging.getLogger("scaletrain")


def check_same_run(saved: dict[str, Any], current: dict[str, Any], where: str, step: int,
                   allowed: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """CheckpointError unless checkpoint ``where`` (its metadata ``saved``) belongs to the run this trainer would
    save as ``current``: the same LoRA base, and the same objective, rewards, data kind and model
    (:mod:`scaletrain.training.run_identity`) but for the keys in ``allowed``. Raised before anything is
    written, so a refused resume leaves the run's files as they were. Returns the run's record of changes
    made on resume (the checkpoint's and this one's, each logged), which later checkpoints carry on."""
    check_lora_base(saved.get("lora"), current.get("lora"), where)
    changes = check_run_identity(saved, current, where, allowed)
    for key, old, new in changes:
        logger.warning("resuming %s with %s changed from %r to %r (training.resume_allow_changes): steps after "
                       "%d train with the new value; recorded in the checkpoints' changes_on_resume",
                       where, key, old, new, step)
    rows = current.get("train_rows")
    if saved.get("train_rows") not in (None, rows):
        logger.warning("resuming with a different training set (%s rows, checkpoint had %s): the data "
                       "order will not match the original run", rows, saved.get("train_rows"))
    return record_changes(saved, changes, step)


def restore_data_position(iterator: Any, where: str, data_state: dict[str, Any]) -> None:
    """Put ``iterator`` where checkpoint ``where`` says; a missing or unusable position is a CheckpointError."""
    source = f"{where}/data/metadata"
    if "train" not in data_state:
        raise CheckpointError(
            f"checkpoint {where} is incomplete: {source} lacks the training data position ('train'); "
            "resume from another checkpoint with training.resume_from=PATH"
        )
    try:
        iterator.set_state(data_state["train"])
    except Exception as err:  # grain's own error for a position that does not fit this iterator
        raise CheckpointError(
            f"checkpoint {where}: the training data position in {source} ({data_state['train']!r}) does not "
            f"fit this data loader ({type(err).__name__}: {err})"
        ) from None


def warn_about_later_checkpoints(directory: str, steps: list[int], step: int) -> None:
    """Say so when a run goes back to ``step`` while its folder holds later checkpoints.

    They belong to an earlier invocation's future; this run replaces each one it
    reaches (``Checkpointer.save``) and leaves the others, which a later
    ``resume_if_possible`` would pick as the newest.
    """
    later = [s for s in steps if s > step]
    if later:
        logger.warning("resuming from step %d while %s holds later checkpoints %s of an earlier invocation: this "
                       "run replaces each one it reaches; the others stay, and resume_if_possible would pick the "
                       "newest", step, directory, later)
