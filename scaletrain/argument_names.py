"""Other tools' names for ``TrainingArguments`` fields, and the plugin seam for more of them.

Why a table: a user of the Hugging Face Trainer or TRL should change only the import line. A
name whose meaning is ours exactly is renamed on input; a switch whose only value here is the
one we always run is accepted at that value (``fixed``); everything else is refused with what
to set instead, never ignored. Saving writes our names only.

This module holds the Hugging Face / TRL names (:data:`HUGGING_FACE`), the names most users
know. Other tools' tables plug in as :class:`ArgumentNames` values under the entry-point group
``scaletrain.argument_names`` (pyproject.toml), loaded once on first use: the core finds them
without importing them, so no import runs up the layers (the EasyDeL table is
``scaletrain.compat.easydel.argument_names:TABLE``). ``TrainingArguments`` calls
:func:`translate_other_names` before validating, so its fields and validators know only our names.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from scaletrain.config_keys import unknown_key_message

__all__ = ["ENTRY_POINT_GROUP", "HUGGING_FACE", "ArgumentNames", "Rule", "merge_tables", "merged_table",
           "report_to_names", "translate_other_names"]

#: the entry-point group other tools' tables register under
ENTRY_POINT_GROUP = "scaletrain.argument_names"

#: a key translated by code: ``rule(value, data)`` edits ``data`` (our names) and returns None, or a problem
Rule = Callable[[Any, dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class ArgumentNames:
    """One tool's names for ``TrainingArguments`` fields (each mapping keyed by the other tool's name)."""

    # other name -> our field, same meaning and value
    renamed: Mapping[str, str] = field(default_factory=dict)
    # switch -> (the values it may take here, why): we always behave that way
    fixed: Mapping[str, tuple[tuple[Any, ...], str]] = field(default_factory=dict)
    # other name -> what to do instead
    refused: Mapping[str, str] = field(default_factory=dict)
    # keys whose translation is code rather than a row
    rules: Mapping[str, Rule] = field(default_factory=dict)
    # other spellings of ``scheduler``'s values -> ours
    scheduler_values: Mapping[Any, str] = field(default_factory=dict)
    # renamed names that also read back as attributes (``args.save_directory``)
    read_back: tuple[str, ...] = ()


def report_to_names(value: Any) -> Any:
    """``report_to`` as a tuple: Hugging Face also takes one name, ``"none"`` and ``"all"``."""
    if isinstance(value, str):
        return {"none": (), "all": ("tensorboard", "wandb")}.get(value, (value,))
    return tuple(value) if isinstance(value, list) else value


# Hugging Face's lr_scheduler_type -> our scheduler; linear and cosine decay to 0 there
_HF_SCHEDULERS: dict[str, str] = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                                  "constant_with_warmup": "constant"}


def _lr_scheduler_type(value: Any, data: dict[str, Any]) -> str | None:
    name = _HF_SCHEDULERS.get(str(getattr(value, "value", value)))
    if name is None:
        return f"use one of {sorted(_HF_SCHEDULERS)} (or scheduler)"
    data.setdefault("scheduler", name)
    if name != "constant":  # Hugging Face's decay ends at 0
        data.setdefault("learning_rate_end", 0.0)
    return None


def _resume_from_checkpoint(value: Any, data: dict[str, Any]) -> str | None:
    if isinstance(value, str):
        data.setdefault("resume_from", value)
    elif value:
        data.setdefault("resume_if_possible", True)
    return None


_BATCH = ("did you mean total_batch_size? (the global batch: per-device batch × devices × "
          "gradient_accumulation_steps)")
_PRECISION = ("did you mean dtype='bfloat16'? (compute dtype; parameters stay float32 unless "
              "param_dtype is set, the optimizer always runs in float32)")

#: the Hugging Face Trainer's names (and TRL's ``max_seq_length``)
HUGGING_FACE = ArgumentNames(
    renamed={"max_steps": "max_training_steps", "logging_steps": "log_steps", "max_grad_norm": "clip_grad",
             "eval_steps": "evaluation_steps", "adam_beta1": "beta1", "adam_beta2": "beta2",
             "adam_epsilon": "epsilon", "max_seq_length": "max_length"},
    refused={
        "per_device_train_batch_size": _BATCH,
        "per_device_eval_batch_size": "evaluation uses total_batch_size",
        "auto_find_batch_size": _BATCH,
        "warmup_ratio": "did you mean warmup_steps? (= warmup_ratio × max_training_steps)",
        "bf16": _PRECISION,
        "fp16": "did you mean dtype='float16'? (compute dtype; parameters stay float32)",
        "tf32": "set jax_default_matmul_precision in JAX's config",
        "bf16_full_eval": _PRECISION,
        "optim": "did you mean optimizer? (adamw, lion, adafactor, sgd)",
        "lr_scheduler_kwargs": "use learning_rate_end and warmup_steps",
        "eval_strategy": "did you mean evaluation_steps? (evaluate every N steps)",
        "evaluation_strategy": "did you mean evaluation_steps? (evaluate every N steps)",
        "save_strategy": "did you mean save_steps or save_interval_minutes?",
        "logging_strategy": "did you mean log_steps?",
        "logging_dir": "logs go under output_dir",
        "overwrite_output_dir": "runs never overwrite checkpoints; use resume_if_possible or a new output_dir",
        "gradient_checkpointing": "set gradient_checkpointing on the model config",
        "run_name": "did you mean wandb_name?",
        "load_best_model_at_end": "did you mean save_best?",
        "metric_for_best_model": "save_best keeps the lowest eval loss",
        "data_seed": "the data order follows seed",
        "dataloader_drop_last": "the last partial batch is padded (no loss on padding)",
        "dataloader_num_workers": "the loader reads in-process; packing is done before training",
        "dataloader_pin_memory": "not applicable to JAX host arrays",
        "remove_unused_columns": "the collator keeps only the model's inputs",
        "group_by_length": "sequences are packed instead",
        "label_smoothing_factor": "not implemented",
        "push_to_hub": "no hub here; export with scaletrain export",
        "hub_model_id": "no hub here; export with scaletrain export",
        "deepspeed": "sharding is the mesh's (mesh.axis_dims and PartitionAxis)",
        "fsdp": "sharding is the mesh's (mesh.axis_dims: the fsdp axis)",
        "torch_compile": "every step is jax.jit-compiled",
    },
    rules={"lr_scheduler_type": _lr_scheduler_type, "resume_from_checkpoint": _resume_from_checkpoint},
)


def _plugin_tables() -> list[tuple[str, ArgumentNames]]:
    """The tables registered under :data:`ENTRY_POINT_GROUP`, by entry-point name; none if none is installed."""
    found = {(ep.name, ep.value): ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    tables = []
    for (name, value), ep in sorted(found.items()):
        table = ep.load()
        if not isinstance(table, ArgumentNames):
            raise TypeError(f"entry point {name} = {value!r} (group {ENTRY_POINT_GROUP}) is a "
                            f"{type(table).__name__}, not an ArgumentNames")
        tables.append((f"{name} = {value}", table))
    return tables


def merge_tables(tables: list[tuple[str, ArgumentNames]]) -> ArgumentNames:
    """One table; a name two tables give different meanings is an error naming both."""
    merged: dict[str, dict[Any, Any]] = {k: {} for k in ("renamed", "fixed", "refused", "rules", "scheduler_values")}
    source: dict[tuple[str, Any], str] = {}
    read_back: list[str] = []
    for where, table in tables:
        for kind, rows in merged.items():
            for key, value in getattr(table, kind).items():
                if key in rows and rows[key] != value:
                    raise ValueError(f"argument name {key!r} ({kind}) means two things: in {source[kind, key]} "
                                     f"and in {where}")
                rows[key], source[kind, key] = value, where
        read_back += [n for n in table.read_back if n not in read_back]
    return ArgumentNames(**merged, read_back=tuple(read_back))


@functools.cache
def merged_table() -> ArgumentNames:
    """Hugging Face's names and every installed plugin's, merged once (``merged_table.cache_clear()`` reloads)."""
    return merge_tables([("scaletrain.argument_names:HUGGING_FACE", HUGGING_FACE), *_plugin_tables()])


def translate_other_names(data: dict[str, Any], fields: Collection[str], fixed_value: Callable[[Any], Any],
                          table: ArgumentNames | None = None) -> tuple[dict[str, Any], list[tuple[str, str, Any]]]:
    """``data`` with every key outside ``fields`` translated to ours: ``(data, problems)``.

    ``problems`` holds one ``(key, message, value)`` per key that is refused, unknown, at a value other than
    its ``fixed`` one (compared through ``fixed_value``, which names dtypes), or given twice under two names.
    ``table`` defaults to :func:`merged_table`.
    """
    table = merged_table() if table is None else table
    data, problems = dict(data), []
    for key in [k for k in data if k not in fields]:
        value = data.pop(key)
        if key in table.renamed:
            if table.renamed[key] in data:
                problems.append((key, f"give {key!r} or {table.renamed[key]!r}, not both (same field)", value))
            data[table.renamed[key]] = value
        elif key in table.rules:
            problem = table.rules[key](value, data)
            if problem is not None:
                problems.append((key, problem, value))
        elif key in table.fixed:
            allowed, why = table.fixed[key]
            if fixed_value(value) not in allowed:
                problems.append((key, f"only {' or '.join(map(repr, allowed))} here: {why}", value))
        elif key in table.refused:
            problems.append((key, f"not supported: {table.refused[key]}", value))
        else:
            known = [*fields, *table.renamed, *table.rules]
            problems.append((key, unknown_key_message(str(key), known, list_valid=False), value))
    return data, problems
