"""What defines a run, read from checkpoint metadata, and the refusal of a resume that changes it.

Why: a resume continues the optimisation the checkpoint's steps began. Resuming a DPO run with
another ``beta`` or ``loss_type``, or a GRPO run with another ``reward_funcs`` list, trains a
different objective from then on while the run's files (``recipe.yaml``, the summary) say it
was one run; the first steps and the last would not belong to the same experiment. So the
objective (type and options), the rewards, the data kind and the model's architecture are
compared with what the checkpoint recorded, and a change is refused naming the key.

What may change: the training budget and schedule (``training.*``, checked nowhere here),
how the run is laid out (mesh, remat, attention kernels, ``scan_layers``), and the options
that only change what a person reads (GRPO's ``log_completions*``) or bound a wait (``reward_timeout``).
For the preference kinds, how rows are prepared and cut (``data.preparation``,
``training.truncation_mode``) defines the run too: another value gives other token ids. The reference model is
compared by the digest of its weights (``training/frozen.py``), not by its name here.

Read from the same metadata a checkpoint saves (``Trainer.checkpoint_metadata``), so the
saved and the current identity are built by one function, and checkpoints written before
this module existed (which hold the same records) are checked too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from scaletrain.errors import CheckpointError

#: objective options that change what a person reads or how the reference is reached, not what is optimised
#: (the reference itself is checked by its weights' digest: ``check_reference``)
FREE_OBJECTIVE_KEYS = frozenset({"name", "log_completions", "log_completions_steps", "num_completions_to_print",
                                 "reference", "reference_source", "precompute_ref_log_probs", "reward_timeout",
                                 "rollout_engine", "rollout_slots", "rollout_cache_pages", "rollout_keep_pages",
                                 "tool_timeout"})
#: the data kinds whose rows are prepared by ``data.preparation`` and cut by ``training.truncation_mode`` as
#: their objective's TRL trainer does by default: another value gives other token ids for the same pair
_PREPARED_KINDS = frozenset({"preference", "unpaired_preference"})
#: recorded objective keys shown under the option a user sets (GRPO records its rewards' names and their entries)
_SHOWN_AS = {"reward_specs": "reward_funcs (entries)"}
#: model config keys that lay out or run the same model (mesh, remat, kernels, layers stacked or not)
FREE_MODEL_KEYS = frozenset({"gradient_checkpointing", "attn_mechanism", "attn_dtype", "attn_softmax_dtype", "fp8",
                             "scan_layers", "sharding_axis_names", "sharding_axis_dims", "sharding_dcn_axis_dims",
                             "partition_axis"})


def run_identity(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``{dotted key: value}`` of what defines the run whose checkpoint metadata is ``meta``.

    Keys are named as a recipe names them (``objective.beta``, ``objective.reward_funcs``,
    ``data.kind``, ``model.rope_theta``), so a refusal points at what the user can set back.
    Values are JSON values (a tuple is a list), as they come back from a saved checkpoint.
    """
    meta = json.loads(json.dumps(dict(meta), default=str))  # the saved form: lists, not tuples
    objective = meta.get("objective") or {"name": "lm"}
    out: dict[str, Any] = {"objective.type": objective.get("name")}
    out.update({f"objective.{_SHOWN_AS.get(k, k)}": v for k, v in objective.items() if k not in FREE_OBJECTIVE_KEYS})
    recipe = meta.get("recipe") or {}
    if isinstance(recipe.get("data"), dict) and "kind" in recipe["data"]:
        out["data.kind"] = recipe["data"]["kind"]
        if out["data.kind"] in _PREPARED_KINDS:  # a default that changed between versions must not slip in
            out["data.preparation"] = recipe["data"].get("preparation")
            out["training.truncation_mode"] = (recipe.get("training") or {}).get("truncation_mode")
    config = meta.get("config") or {}
    out.update({f"model.{k}": v for k, v in config.items() if k not in FREE_MODEL_KEYS})
    return out


def identity_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for each key both record with different values, sorted by key.

    A key only one side records (an option added by a later version, a run started from Python
    without a recipe) is not a change: there is nothing to compare it with.
    """
    return [(k, saved[k], current[k]) for k in sorted(set(saved) & set(current)) if saved[k] != current[k]]


def check_run_identity(saved_meta: Mapping[str, Any], current_meta: Mapping[str, Any], checkpoint: str,
                       allowed: tuple[str, ...] | list[str] = ()) -> list[tuple[str, Any, Any]]:
    """The changes ``allowed`` lets through, ``(key, old, new)``; CheckpointError naming each other changed key.

    ``allowed``: ``training.resume_allow_changes``, the keys the user explicitly lets a resume change
    (a key names itself and any key under it: ``objective.reward_funcs`` covers its entries too).
    """
    changes = identity_changes(run_identity(saved_meta), run_identity(current_meta))
    refused = [c for c in changes if not any(c[0] == a or c[0].startswith(f"{a} ") for a in allowed)]
    if refused:
        listed = ", ".join(f"{key} {_shown(old)} -> {_shown(new)}" for key, old, new in refused)
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained with another objective, rewards, data kind or model: {listed}; "
            "a resume continues the same run, so set these back to the checkpoint's values, train the new "
            "settings into another training.output_dir (from an export of this run for its weights), or "
            "list the keys in training.resume_allow_changes to change them from this step on (recorded in "
            "the checkpoints' changes_on_resume)"
        )
    return changes


def record_changes(saved_meta: Mapping[str, Any], changes: list[tuple[str, Any, Any]], step: int
                   ) -> list[dict[str, Any]]:
    """The run's ``changes_on_resume`` record: the checkpoint's, plus this resume's ``changes`` at ``step``
    (the first step trained with the new values is ``step + 1``)."""
    earlier = list(saved_meta.get("changes_on_resume") or [])
    return earlier + [{"after_step": step, "key": key, "old": old, "new": new} for key, old, new in changes]


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["check_run_identity", "identity_changes", "record_changes", "run_identity"]
