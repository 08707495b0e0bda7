"""EasyDeL's names for ``TrainingArguments`` fields: the table the core finds through its plugin seam.

Why a table: an EasyDeL user should change only the import line. A name whose meaning is ours
exactly is renamed on input; a switch whose only value here is the one we always run is accepted
at that value (``fixed``); everything else is refused with what to set instead, never ignored.
docs/from-easydel.md is the same table for people.

:data:`TABLE` is registered under the entry-point group ``scaletrain.argument_names``
(pyproject.toml); :mod:`scaletrain.argument_names` loads it on first use, beside Hugging Face's
names, so the core never imports this module.
"""

from __future__ import annotations

from typing import Any

from scaletrain.argument_names import ArgumentNames, report_to_names

# other name -> our field, same meaning and value
RENAMED: dict[str, str] = {
    "save_directory": "output_dir",
    "max_sequence_length": "max_length",
    "do_last_save": "save_at_end",
    # EasyDeL's RayDistributedTrainer documentation's resume example
    "total_steps": "max_training_steps",
    "batch_size": "total_batch_size",
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

# other name -> what to do instead 
REFUSED: dict[str, str] = {
    "backend": "JAX picks the platform; set JAX_PLATFORMS=cpu|cuda|tpu in the environment",
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
}

# EasyDeL's scheduler names (EasyDeLSchedulers) -> ours
SCHEDULERS: dict[Any, str] = {None: "constant", "none": "constant", "warm_up_cosine": "cosine",
                              "warm_up_linear": "linear"}


def _use_wandb(value: Any, data: dict[str, Any]) -> None:
    """EasyDeL's switch adds or removes ``"wandb"`` in ``report_to`` (ours)."""
    report = [r for r in report_to_names(data.get("report_to", ("tensorboard",))) if r != "wandb"]
    data["report_to"] = tuple(report + ["wandb"] if value else report)


TABLE = ArgumentNames(renamed=RENAMED, fixed=FIXED, refused=REFUSED, rules={"use_wandb": _use_wandb},
                      scheduler_values=SCHEDULERS, read_back=("save_directory", "max_sequence_length"))
