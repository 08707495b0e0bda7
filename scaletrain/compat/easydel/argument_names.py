"""Other tools' names for ``TrainingArguments`` fields: EasyDeL's and Hugging Face's.

Why a table: an EasyDeL (or HF Trainer) user should change only the import line. A
name whose meaning is ours exactly is renamed on input (:data:`RENAMED`); a switch whose
only value here is the one we always run is accepted at that value (:data:`FIXED`);
everything else is refused with what to set instead (:data:`REFUSED`), never ignored.
Saving writes our names only. docs/from-easydel.md is the same table for people.

:func:`translate_other_names` applies the table; ``TrainingArguments`` calls it before
validating, so the core's fields and validators know only our names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from scaletrain.config_keys import unknown_key_message

# other name -> our field, same meaning and value
RENAMED: dict[str, str] = {
    # EasyDeL
    "save_directory": "output_dir",
    "max_sequence_length": "max_length",
    "do_last_save": "save_at_end",
    # EasyDeL's RayDistributedTrainer documentation's resume example
    "total_steps": "max_training_steps",
    "batch_size": "total_batch_size",
    # Hugging Face Trainer (and TRL's max_seq_length)
    "max_steps": "max_training_steps",
    "logging_steps": "log_steps",
    "max_grad_norm": "clip_grad",
    "eval_steps": "evaluation_steps",
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_epsilon": "epsilon",
    "max_seq_length": "max_length",
}

# EasyDeL switch -> (the values it may take here, why): we always behave that way
FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "do_train": ((True,), "train() always trains"),
    "use_grain": ((True,), "the loader is always grain"),
    "auto_shard_states": ((True,), "the state is always sharded by the partition rules"),
    "init_tx": ((True,), "the optimizer state is always created"),
    "save_optimizer_state": ((True,), "checkpoints always hold the optimizer state (exact resume)"),
    "use_data_collactor": ((True,), "batches always go through the collator"),
    "process_zero_is_admin": ((True,), "process 0 always writes logs and metadata"),
    "remove_ckpt_after_load": ((False,), "no run deletes a checkpoint it did not write"),
    "sparsify_module": ((False,), "sparse modules are not implemented"),
    "offload_dataset": ((False,), "datasets stay in host memory"),
    "aux_loss_enabled": ((False,), "no model family here has an auxiliary loss"),
    "pruning_module": ((None,), "pruning is not implemented"),
    "custom_scheduler": ((None,), "the schedule is scheduler/warmup_steps/learning_rate_end"),
    "loss_config": ((None,), "the loss is set by z_loss and loss_chunk_size"),
    "step_start_point": ((None,), "the start step comes from the checkpoint"),
    "state_apply_fn_kwarguments_to_model": ((None,), "the model is called with the batch only"),
    "tx_mu_dtype": ((None, "float32"), "optimizer moments are always float32 (docs/api.md, precision)"),
    "extra_optimizer_kwargs": (({},), "set beta1, beta2, epsilon, momentum, weight_decay"),
    "ids_to_pop_from_dataset": (([], None), "the collator keeps only the model's inputs"),
}

_BATCH = ("did you mean total_batch_size? (the global batch: per-device batch × devices × "
          "gradient_accumulation_steps)")
_PRECISION = ("did you mean dtype='bfloat16'? (compute dtype; parameters stay float32 unless "
              "param_dtype is set, the optimizer always runs in float32)")

# other name -> what to do instead (EasyDeL's first, then Hugging Face's)
REFUSED: dict[str, str] = {
    "backend": "JAX picks the platform; set JAX_PLATFORMS=cpu|cuda|tpu in the environment",
    "dataloader_num_workers": "the loader reads in-process; packing is done before training",
    "dataloader_pin_memory": "not applicable to JAX host arrays",
    "eval_batch_size": "evaluation uses total_batch_size",
    "grain_shard_index": "each process reads its share of the data automatically",
    "grain_shard_count": "each process reads its share of the data automatically",
    "per_epoch_training_steps": "use max_training_steps (the horizon) or num_train_epochs",
    "per_epoch_evaluation_steps": "use max_evaluation_steps",
    "model_parameters": "model settings go to the model config, not the arguments",
    "model_name": "the run is named by output_dir (wandb: wandb_name)",
    "trainer_prefix": "the run is named by output_dir (wandb: wandb_name)",
    "offload_device_type": "datasets stay in host memory",
    "offload_device_index": "datasets stay in host memory",
    "progress_bar_type": "use progress_bar: true or false (a tqdm bar)",
    "report_steps": "use log_steps",
    "report_metrics": "metrics.jsonl is always written; report_to adds tensorboard/wandb",
    "log_all_workers": "process 0 logs for all",
    "shuffle_seed_train": "the data order follows seed",
    "sparse_module_type": "sparse modules are not implemented",
    "weight_distribution_pattern": "use log_weight_stats: true (every parameter)",
    "weight_distribution_log_steps": "use log_weight_stats: true (logged every log_steps)",
    "metrics_to_show_in_rich_pbar": "the progress bar shows loss, learning rate and throughput",
    "verbose": "set the log level of the 'scaletrain' logger",
    "performance_mode": "nothing to switch off: logging never syncs the device mid-step",
    "track_memory": "see host and device memory in the metrics instead",
    "low_mem_usage": "not applicable",
    "is_fine_tuning": "fine-tuning starts from a pretrained model (recipe model.pretrained)",
    "train_on_inputs": "the data section decides (chat data: assistant-only loss)",
    "remove_unused_columns": "the collator keeps only the model's inputs",
    # Hugging Face Trainer
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
    "group_by_length": "sequences are packed instead",
    "label_smoothing_factor": "not implemented",
    "push_to_hub": "no hub here; export with scaletrain export",
    "hub_model_id": "no hub here; export with scaletrain export",
    "deepspeed": "sharding is the mesh's (mesh.axis_dims and PartitionAxis)",
    "fsdp": "sharding is the mesh's (mesh.axis_dims: the fsdp axis)",
    "torch_compile": "every step is jax.jit-compiled",
}

# Hugging Face's lr_scheduler_type -> our scheduler; linear and cosine decay to 0 there
HF_SCHEDULERS: dict[str, str] = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                                 "constant_with_warmup": "constant"}
# EasyDeL's scheduler names (EasyDeLSchedulers) -> ours
EASYDEL_SCHEDULERS: dict[Any, str] = {None: "constant", "none": "constant", "warm_up_cosine": "cosine",
                                      "warm_up_linear": "linear"}

# keys translated by a rule rather than a table row
_BY_RULE = ("use_wandb", "lr_scheduler_type", "resume_from_checkpoint")


def translate_other_names(data: dict[str, Any], fields: Collection[str], fixed_value: Callable[[Any], Any]
                          ) -> tuple[dict[str, Any], list[tuple[str, str, Any]], bool | None]:
    """``data`` with every key outside ``fields`` translated to ours: ``(data, problems, use_wandb)``.

    ``problems`` holds one ``(key, message, value)`` per key that is refused, unknown, at a
    value other than its :data:`FIXED` one (compared through ``fixed_value``, which names
    dtypes), or given twice under two names. ``use_wandb`` is EasyDeL's switch (None if
    absent), left to the caller since it edits ``report_to``, a field of ours.
    """
    data, problems, use_wandb = dict(data), [], None
    for key in [k for k in data if k not in fields]:
        value = data.pop(key)
        if key in RENAMED:
            if RENAMED[key] in data:
                problems.append((key, f"give {key!r} or {RENAMED[key]!r}, not both (same field)", value))
            data[RENAMED[key]] = value
        elif key == "use_wandb":
            use_wandb = bool(value)
        elif key == "lr_scheduler_type" and str(getattr(value, "value", value)) in HF_SCHEDULERS:
            name = HF_SCHEDULERS[str(getattr(value, "value", value))]
            data.setdefault("scheduler", name)
            if name != "constant":  # Hugging Face's decay ends at 0
                data.setdefault("learning_rate_end", 0.0)
        elif key == "resume_from_checkpoint":
            if isinstance(value, str):
                data.setdefault("resume_from", value)
            elif value:
                data.setdefault("resume_if_possible", True)
        elif key in FIXED:
            allowed, why = FIXED[key]
            if fixed_value(value) not in allowed:
                problems.append((key, f"only {' or '.join(map(repr, allowed))} here: {why}", value))
        elif key in REFUSED:
            problems.append((key, f"not supported: {REFUSED[key]}", value))
        elif key == "lr_scheduler_type":
            problems.append((key, f"use one of {sorted(HF_SCHEDULERS)} (or scheduler)", value))
        else:
            known = [*fields, *RENAMED, *_BY_RULE]
            problems.append((key, unknown_key_message(str(key), known, list_valid=False), value))
    return data, problems, use_wandb
